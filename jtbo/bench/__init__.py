"""Benchmarks: ``python -m jtbo.bench NAME [flags]``; each NAME is a module here with ``main``."""
