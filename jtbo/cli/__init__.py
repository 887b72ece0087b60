"""jtbo.cli: the command-line programs, above everything they drive.

* ``demo``: ``python -m jtbo.demo``, the end-to-end model demo (TBO off, on and "auto"
  against each other and the float64 reference, and the 8xH200 overlap report).
* ``generate``: ``python -m jtbo.generate``, serving a Hugging Face checkpoint.

The ``python -m`` entry modules (``jtbo/demo.py``, ``jtbo/generate.py``) choose the platform
before jax starts, then call these.
"""
