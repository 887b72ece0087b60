"""The parent's side: each variant in fresh child process(es) (``python -m jtbo.bench
overlap --worker I``), one after another, their results collected from the JSON lines.

The parent never starts a JAX backend (it would hold the GPUs the children need).
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import jtbo
from jtbo.bench.overlap import processes, results, variants

STDERR_TAIL_LINES = 25


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def worker_argv(
    args: argparse.Namespace, variant: variants.Variant, process_id: int, port: int
) -> list:
    """The command line of one child of ``variant`` (the measurement flags, its options;
    its ``opt:windows`` wins over ``--windows``)."""
    argv = [sys.executable, "-m", "jtbo.bench", "overlap", "--worker", str(process_id),
            "--coordinator", f"127.0.0.1:{port}", "--variant-name", variant.name,
            "--processes", str(args.processes), "--cpu-devices", str(args.cpu_devices),
            "--collectives", ",".join(args.collectives), "--chain", str(args.chain),
            "--iters", str(args.iters), "--dtype", args.dtype, "--seed", str(args.seed),
            "--windows", variant.windows or args.windows]  # fmt: skip
    optional = {"--bytes": args.bytes, "--matmul": args.matmul,
                "--matmuls-per-window": args.matmuls_per_window,
                "--profile": args.profile and os.path.abspath(args.profile)}  # fmt: skip
    argv += [item for flag, value in optional.items() if value for item in (flag, str(value))]
    for key, value in variant.xla:
        argv += ["--xla-option", f"{key}={variants.format_option_value(value)}"]
    return argv


def _worker_env(variant: variants.Variant) -> dict[str, str]:
    """The parent's environment, the variant's variables, and this jtbo importable."""
    package_root = str(Path(jtbo.__file__).resolve().parents[1])
    path = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
    return {**os.environ, **dict(variant.env), "PYTHONPATH": path}


class _LogRelay:
    """Prints the lines a child adds to its stdout file, without the JSON ones."""

    def __init__(self, path: Path, prefix: str):
        self.path, self.prefix, self.offset = path, prefix, 0

    def relay(self) -> None:
        text = self.path.read_text(errors="replace")
        end = text.rfind("\n") + 1  # only whole lines
        for line in text[self.offset : end].splitlines():
            if not line.startswith(processes.RESULT_MARKER):
                print(f"{self.prefix}{line}", flush=True)
        self.offset = max(self.offset, end)


def _start_workers(args, variant: variants.Variant, folder: Path) -> list[subprocess.Popen]:
    port, procs = _free_port(), []
    for process_id in range(args.processes):
        out, err = folder / f"out{process_id}.txt", folder / f"err{process_id}.txt"
        with open(out, "w") as stdout, open(err, "w") as stderr:
            procs.append(subprocess.Popen(
                worker_argv(args, variant, process_id, port), env=_worker_env(variant),
                stdout=stdout, stderr=stderr,
            ))  # fmt: skip
    return procs


def _wait_workers(procs, relay: _LogRelay, timeout_s: float) -> str | None:
    """Waits for every child; kills the rest once one fails or time runs out.

    Returns:
      None if all exited 0, else what went wrong.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        relay.relay()
        codes = [proc.poll() for proc in procs]
        failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if None not in codes and not failed:
            return None
        if failed or time.monotonic() > deadline:
            for proc in procs:
                proc.kill()  # a no-op for one that has exited
                proc.wait()
            relay.relay()
            what = ", ".join(f"process {i} exit code {c}" for i, c in failed)
            return what or f"ran past --variant-timeout {timeout_s:g} s"
        time.sleep(0.2)


def _records(stdout: str) -> list[dict]:
    """The JSON records among a child's stdout lines."""
    marker = processes.RESULT_MARKER
    lines = [line for line in stdout.splitlines() if line.startswith(marker)]
    return [json.loads(line[len(marker) :]) for line in lines]


def _tail(paths: Sequence[Path]) -> str:
    lines = []
    for path in paths:
        text = path.read_text(errors="replace").splitlines()[-STDERR_TAIL_LINES:]
        lines += [f"[{path.stem}] {line}" for line in text]
    return "\n".join(lines)


def _outcome(variant, failure, records, collectives, stderr_paths) -> results.VariantOutcome:
    """A variant's outcome from its records; missing collectives count as a failure."""
    infos = [results.RunInfo(**{k: v for k, v in r.items() if k != "kind"}) for r in records
             if r["kind"] == "info"]  # fmt: skip
    found = tuple(results.ProbeResult(**{k: v for k, v in r.items() if k != "kind"})
                  for r in records if r["kind"] == "result")  # fmt: skip
    missing = [name for name in collectives if name not in {r.collective for r in found}]
    if failure is None and missing:
        failure = f"no result for {', '.join(missing)}"
    tail = _tail(stderr_paths) if failure else ""
    return results.VariantOutcome(variant, infos[0] if infos else None, found, failure, tail)


def run_variant(args: argparse.Namespace, variant: variants.Variant) -> results.VariantOutcome:
    """Runs one variant in fresh child process(es) and collects what they report.

    Returns:
      The outcome; a failing or hanging child gives a ``failure`` and its stderr tail.
    """
    with tempfile.TemporaryDirectory(prefix="jtbo_overlap_") as name:
        folder = Path(name)
        print(f"[{variant.name}] starting: {variant.spec() or 'defaults'}", flush=True)
        procs = _start_workers(args, variant, folder)
        relay = _LogRelay(folder / "out0.txt", f"[{variant.name}] ")
        failure = _wait_workers(procs, relay, args.variant_timeout)
        records = _records((folder / "out0.txt").read_text(errors="replace"))
        stderr_paths = [folder / f"err{i}.txt" for i in range(args.processes)]
        return _outcome(variant, failure, records, args.collectives, stderr_paths)
