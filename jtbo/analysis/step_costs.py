"""The step model's per-operation cost table: loaded, checked and interpolated.

The table is measured on one device by ``python -m jtbo.bench predict --measure``
(its measuring module says what each section times); the one shipped with jtbo,
``step_costs_h200.json`` beside this module, was measured on an H200 (BENCHMARKS.md, "TBO
step model: validation"). Each section holds times at a grid of sizes; between grid points a
time is interpolated linearly in log(size) - log(time) (after ``work_curve`` makes the curve
one a batch could follow: no dearer per unit at a larger size), below the grid it is the smallest
size's time (a launch floor), and above it the largest size's time scaled in proportion to
the size (past the grid every operation is throughput-bound).

* a dense GEMM ``[rows, K] @ [K, N]`` between two measured weight shapes is interpolated
  between their times at its rows, log-log in ``K * N``; outside them it takes the nearest
  shape's time scaled by ``K * N`` over that shape's (at a fixed row count both the FLOPs and
  the weight bytes grow with ``K * N``). Scaling a measured time inside the range would scale
  its per-call floor too;
* the grouped GEMM of ``experts`` local experts takes the time per expert of the nearest
  measured expert count at the rows per expert, times ``experts``, scaled by its expert shape
  (``hidden * ffn``) over the measured one's;
* extend attention is a sum over prompts of the time of a prompt's length; decode attention
  is interpolated in the KV rows read (sequences x context);
* a row-wise operation over rows of another width is priced as the measured width's rows of
  the same bytes (``rows * width / hidden``): its work is its bytes, and scaling the time
  instead would scale the per-call floor.
"""

import bisect
import dataclasses
import importlib.resources
import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

VERSION = 1
KIND = "jtbo_step_costs"
SHIPPED = "step_costs_h200.json"
SECTIONS = ("dense_gemm", "grouped_gemm", "attention", "rowwise", "host_ms", "slowdown")
"""The sections every table has."""
OPTIONAL_SECTIONS = ("runner_host",)
"""Sections a table may lack: ``runner_host`` (the runner's own host time per step), for
which the round trip ``host_ms`` then stands."""
ROWWISE_OPS = ("rmsnorm", "add", "gather", "routing")


def work_curve(xs: Sequence[float], ys: Sequence[float]) -> list[float]:
    """A measured curve made physical: a larger size costs no more per unit than a smaller one
    (it could run as pieces of the smaller size) and no less in all (measurement noise can
    break either).

    Args:
      xs: increasing positive sizes.
      ys: their measured times.

    Returns:
      The times, lowered where the time per unit rose and then raised where the time fell.
    """
    out: list[float] = []
    for x, y in zip(xs, ys, strict=True):
        if out:
            previous_x = xs[len(out) - 1]
            y = max(min(y, out[-1] * x / previous_x), out[-1])
        out.append(y)
    return out


def interpolate(xs: Sequence[float], ys: Sequence[float], x: float, as_work: bool = True) -> float:
    """``y(x)`` from a measured curve (module docstring: log-log inside, floor below, linear
    above).

    Args:
      xs: increasing positive sizes.
      ys: positive times at those sizes.
      x: the size asked for (> 0).
      as_work: first make the curve physical (``work_curve``); False for a curve that grows
        faster than its size by nature (causal attention over a prompt's length).

    Returns:
      The interpolated time.
    """
    ys = work_curve(xs, ys) if as_work else ys
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1] * x / xs[-1]
    i = bisect.bisect_right(xs, x) - 1
    f = (math.log(x) - math.log(xs[i])) / (math.log(xs[i + 1]) - math.log(xs[i]))
    return math.exp(math.log(ys[i]) + f * (math.log(ys[i + 1]) - math.log(ys[i])))


def _nearest(values: Sequence[float], target: float) -> int:
    """Index of the value nearest ``target`` in log."""
    return min(range(len(values)), key=lambda i: abs(math.log(values[i] / target)))


@dataclasses.dataclass(frozen=True)
class StepCosts:
    """A checked cost table (``load``); every method returns milliseconds."""

    table: Mapping[str, Any]  # the JSON object (module docstring; version 1)

    def dense_gemm(self, rows: float, k: int, n: int) -> float:
        """A ``[rows, k] @ [k, n]`` bf16 matmul (0 for no rows; module docstring)."""
        if rows <= 0:
            return 0.0
        curves = sorted(self.table["dense_gemm"], key=lambda c: c["k"] * c["n"])
        sizes = [c["k"] * c["n"] for c in curves]
        times = [interpolate(c["rows"], c["ms"], rows) for c in curves]
        size = k * n
        if size <= sizes[0] or size >= sizes[-1]:
            end = 0 if size <= sizes[0] else -1
            return times[end] * size / sizes[end]
        return interpolate(sizes, times, size, as_work=False)

    def _expert_curve(self, experts: int) -> tuple[list[float], list[float]]:
        """The measured expert count nearest ``experts``: rows per expert and its time per
        expert (``work_curve``)."""
        curves = self.table["grouped_gemm"]["curves"]
        curve = curves[_nearest([c["experts"] for c in curves], experts)]
        sizes = curve["rows_per_expert"]
        return sizes, work_curve(sizes, [t / curve["experts"] for t in curve["ms"]])

    def grouped_gemm(self, rows: float, experts: int, hidden: int, ffn: int) -> float:
        """The routed-expert layer over ``rows`` (token, expert) pairs on ``experts`` local
        experts of shape ``hidden x ffn`` (0 for no rows)."""
        if rows <= 0:
            return 0.0
        section = self.table["grouped_gemm"]
        sizes, per_expert = self._expert_curve(experts)
        scale = hidden * ffn / (section["hidden"] * section["ffn"])
        return interpolate(sizes, per_expert, rows / experts) * experts * scale

    def grouped_gemm_fp8(
        self, rows: float, experts: int, hidden: int, ffn: int, speedup: float, byte_ratio: float
    ) -> float:
        """The routed-expert layer with FP8 weights and activations, priced from the measured
        bf16 layer (``grouped_gemm``) by a roofline of the bf16 curve: its weight-read time is
        its time at the smallest measured rows per expert, its compute time at ``rows`` the
        largest measured point's time scaled to ``rows``; the FP8 layer reads ``byte_ratio``
        of the weight bytes and computes at ``speedup`` times the bf16 rate, and the bf16 time
        is scaled by ``max(fp8 weight read, fp8 compute) / max(weight read, compute)``: the
        bytes' ratio where the layer is weight-bound, the rate's where compute-bound, never
        above the bf16 time.

        Args:
          rows: (token, expert) pairs.
          experts: local experts.
          hidden: expert input width.
          ffn: expert intermediate width.
          speedup: FP8 GEMM rate over the bf16 rate (>= 1).
          byte_ratio: FP8 weight bytes over bf16 weight bytes (scales included, <= 1).

        Returns:
          Milliseconds.

        Raises:
          ValueError: a speedup below 1 or a byte ratio outside (0, 1].
        """
        if speedup < 1 or not 0 < byte_ratio <= 1:
            raise ValueError(
                f"FP8 speedup {speedup} must be >= 1, byte ratio {byte_ratio} in (0, 1]"
            )
        bf16 = self.grouped_gemm(rows, experts, hidden, ffn)
        if bf16 <= 0:
            return 0.0
        sizes, per_expert = self._expert_curve(experts)
        memory = per_expert[0]
        compute = per_expert[-1] * rows / experts / sizes[-1]
        fp8 = max(byte_ratio * memory, compute / speedup)
        return bf16 * fp8 / max(memory, compute)

    def extend_attention(self, kind: str, seq_lens: Sequence[int]) -> float:
        """Causal attention over fresh prompts of ``seq_lens`` tokens (``kind``: mla or gqa)."""
        curve = self.table["attention"][kind]["extend"]
        lens, times = curve["seq_len"], curve["ms_per_seq"]
        return sum(interpolate(lens, times, n, as_work=False) for n in seq_lens if n)

    def decode_attention(self, kind: str, seqs: float, context: int) -> float:
        """Decode attention of ``seqs`` sequences at ``context`` tokens each."""
        if seqs <= 0:
            return 0.0
        curve = self.table["attention"][kind]["decode"]
        rows = [s * c for s, c in zip(curve["seqs"], curve["context"], strict=True)]
        points = sorted(zip(rows, curve["ms"], strict=True))
        return interpolate([p[0] for p in points], [p[1] for p in points], seqs * context)

    def rowwise(self, op: str, rows: float, width: int) -> float:
        """A row-wise operation (``ROWWISE_OPS``) over ``rows`` rows of ``width`` values (the
        router's top-k: ``width`` experts)."""
        if rows <= 0:
            return 0.0
        section = self.table["rowwise"]
        measured = section["routing_experts"] if op == "routing" else section["hidden"]
        return interpolate(section["rows"], section[op], rows * width / measured)

    @property
    def host_ms(self) -> float:
        """The host's round trip per step."""
        return float(self.table["host_ms"])

    def step_host_ms(self, mode: str, tbo: bool) -> float:
        """The host's time per step of ``mode`` ("prefill" or "decode"), plain or TBO: the
        runner's measured host phases where the table has them (``runner_host``), else the
        round trip (``host_ms``)."""
        runner = self.table.get("runner_host")
        if runner is None:
            return self.host_ms
        return float(runner[mode]["tbo_ms" if tbo else "plain_ms"])

    def slowdown(self, engine: str) -> float:
        """Compute time beside an exchange over compute time alone (``engine``: sm or copy)."""
        return float(self.table["slowdown"][engine])


def check(table: Mapping[str, Any]) -> None:
    """Checks a table's schema.

    Raises:
      ValueError: a wrong version or kind, a missing section, or a curve whose sizes are not
        increasing and positive or whose times are not positive (named).
    """
    if table.get("kind") != KIND or table.get("version") != VERSION:
        raise ValueError(f"not a version-{VERSION} {KIND} table: {table.get('kind')!r}")
    missing = [name for name in SECTIONS if name not in table]
    if missing:
        raise ValueError(f"cost table lacks sections {missing}")
    for curve in table["dense_gemm"]:
        _check_curve(f"dense_gemm {curve['k']}x{curve['n']}", curve["rows"], curve["ms"])
    for curve in table["grouped_gemm"]["curves"]:
        _check_curve(f"grouped_gemm E={curve['experts']}", curve["rows_per_expert"], curve["ms"])
    for kind, section in table["attention"].items():
        _check_curve(
            f"attention {kind} extend",
            section["extend"]["seq_len"],
            section["extend"]["ms_per_seq"],
        )
        decode = section["decode"]
        if not len(decode["seqs"]) == len(decode["context"]) == len(decode["ms"]) > 0:
            raise ValueError(f"attention {kind} decode: seqs, context and ms differ in length")
    for op in ROWWISE_OPS:
        _check_curve(f"rowwise {op}", table["rowwise"]["rows"], table["rowwise"][op])
    if not table["host_ms"] >= 0 or not all(table["slowdown"][e] >= 1 for e in ("sm", "copy")):
        raise ValueError("host_ms must be >= 0 and slowdown factors >= 1")
    if "runner_host" in table:
        _check_runner_host(table["runner_host"])


def _check_runner_host(section: Mapping[str, Any]) -> None:
    for mode in ("prefill", "decode"):
        times = [section.get(mode, {}).get(key) for key in ("plain_ms", "tbo_ms")]
        if not all(isinstance(t, (int, float)) and t >= 0 for t in times):
            raise ValueError(f"runner_host {mode}: plain_ms and tbo_ms must be >= 0, got {times}")


def _check_curve(name: str, xs: Sequence[float], ys: Sequence[float]) -> None:
    if len(xs) != len(ys) or not xs:
        raise ValueError(f"{name}: {len(xs)} sizes against {len(ys)} times")
    if any(b <= a for a, b in zip(xs[:-1], xs[1:], strict=True)) or xs[0] <= 0:
        raise ValueError(f"{name}: sizes {list(xs)} are not increasing and positive")
    if any(not y > 0 for y in ys):
        raise ValueError(f"{name}: times {list(ys)} are not all positive")


def load(path: str | os.PathLike | None = None) -> StepCosts:
    """Reads and checks a table (``check``).

    Args:
      path: a table file; None: the shipped H200 table.

    Returns:
      The table.

    Raises:
      ValueError: a table that fails ``check`` (the path is named).
    """
    if path is None:
        text = importlib.resources.files("jtbo.analysis").joinpath(SHIPPED).read_text()
        name = SHIPPED
    else:
        with open(path) as file:
            text, name = file.read(), os.fspath(path)
    table = json.loads(text)
    try:
        check(table)
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{name}: {error}") from error
    return StepCosts(table)
