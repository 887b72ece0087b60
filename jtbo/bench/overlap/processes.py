"""A child's side: joins ``jax.distributed`` for ``--processes N`` (one process per local
device, coordinator on 127.0.0.1), measures, and prints results as ``RESULT_MARKER`` JSON."""

import argparse
import dataclasses
import json
import os

import jax

from jtbo.bench.overlap import probe, table

RESULT_MARKER = "JTBO_OVERLAP_JSON "
"""Prefix of the JSON lines a child prints for the parent."""


def _emit_json(kind: str, payload: object) -> None:
    if kind == "result":
        print(table.progress_line(payload), flush=True)
    record = {"kind": kind, **dataclasses.asdict(payload)}
    print(RESULT_MARKER + json.dumps(record), flush=True)


def _join_distributed(args: argparse.Namespace) -> None:
    """Joins the ``jax.distributed`` run as process ``--worker`` (before any backend use)."""
    if os.environ.get("JAX_PLATFORMS") == "cpu":
        # Cross-process CPU collectives need gloo; jax_num_cpu_devices wins over XLA_FLAGS.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    jax.distributed.initialize(
        coordinator_address=args.coordinator, num_processes=args.processes,
        process_id=args.worker, local_device_ids=[args.worker],
    )  # fmt: skip


def worker_main(args: argparse.Namespace) -> None:
    """A child's run: the measurement, results as ``RESULT_MARKER`` JSON lines."""
    if args.processes > 1:
        _join_distributed(args)
    probe.measure(args, args.variant_name, _emit_json)
    if args.processes > 1:
        jax.distributed.shutdown()
