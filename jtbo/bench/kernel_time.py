"""Where a step's GPU time goes: profiler kernel times attributed to the model's operations.

A ``jax.profiler`` trace (its ``*.trace.json.gz``) lists every GPU kernel with its duration;
the optimized HLO of the same compile (``--xla_dump_to``) names, for every fusion, the
``op_name`` of the jax code it came from (``tbo_a/L2.attn_core/while/body/...``). Joining the
two answers "which operation costs what", per step:

* a kernel named like a fusion (``gemm_fusion_dot_141`` is HLO ``gemm_fusion_dot.141``) takes
  that fusion's ``op_name``;
* cuBLAS kernels (``nvjet_*``, ``sm90_xmma_*``, ...) carry no HLO name: the k-th of a step is
  the k-th cuBLAS custom call of the entry computation, which is in schedule order;
* the ``op_name`` becomes an operation: micro-batch prefix (``tbo_a``, ``tbo_b``, or
  ``tbo_joint`` for an operation run once for both) and layer index dropped
  (``attn_core``, ``experts``, ``dispatch_b``, ``attn_core (loop)`` for a loop body), a
  parameter's name for fusions XLA attributes to a weight (e.g. the input concatenation of
  a merged matmul), else the kernel family.

Built to find TBO's cost on one H200, where the joined table showed each micro-batch reading
the Q/K/V weights on its own (docs/benchmarks/, "TBO step cost on one H200", fused weights and
one CUDA graph per step).

``collective_bytes`` reads the other side of the same HLO: how many bytes each collective of
a step moves on one device (for ``bench tbo``'s bytes per exchange and achieved GB/s).
"""

import argparse
import bisect
import collections
import dataclasses
import gzip
import json
import os
import re

from jtbo.analysis import hlo_schedule

CUBLAS_PREFIXES = ("nvjet", "sm90_", "sm80_", "cutlass", "void cutlass", "gemv", "gemmk1")
"""Kernel-name prefixes of cuBLAS / cuBLASLt kernels."""
NCCL_PREFIXES = ("nccl",)
"""Kernel-name prefixes of NCCL collectives (communication)."""
PEER_COPY_PREFIXES = ("MemcpyP2P", "MemcpyD2H", "MemcpyH2D")
"""Names of the ``peer_copy`` EP exchange's transfers in the trace (as jax's GPU profiler names
them): peer-to-peer copies, and the device-to-host and host-to-device copies of an exchange
staged through host memory (``JTBO_PEER_COPY_VIA_HOST=1``; a jitted step makes no other host
transfers)."""
NOT_COMPUTE_PREFIXES = ("Memcpy", "Memset", "memcpy", "memset")
"""Kernel-name prefixes that are data movement, neither communication nor compute."""


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One GPU kernel execution of a trace."""

    name: str  # kernel name as the profiler recorded it
    module: str  # HLO module it belongs to ("" when the trace does not say)
    microseconds: float  # duration
    device: int = 0  # the trace's process id of the GPU
    start: float = 0.0  # start time in microseconds


def gpu_kernels(trace: dict) -> list[Kernel]:
    """GPU kernel executions of a parsed ``*.trace.json`` in start order.

    Args:
      trace: the trace's JSON object (``{"traceEvents": [...]}``).

    Returns:
      Every complete event of a process whose name mentions a GPU.
    """
    events = trace["traceEvents"]
    gpu_pids = {
        event["pid"]
        for event in events
        if event.get("ph") == "M"
        and event.get("name") == "process_name"
        and "GPU" in event.get("args", {}).get("name", "")
    }
    kernels = [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu_pids and "dur" in e]
    kernels.sort(key=lambda event: event["ts"])
    return [
        Kernel(
            e["name"],
            str(e.get("args", {}).get("hlo_module", "")),
            float(e["dur"]),
            e["pid"],
            float(e["ts"]),
        )  # fmt: skip
        for e in kernels
    ]


def read_trace(path: str) -> dict:
    """Parses a ``*.trace.json.gz`` (or plain ``*.trace.json``) file."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as file:
        return json.load(file)


def hlo_op_names(hlo_text: str) -> tuple[dict[str, str], list[str]]:
    """Kernel name -> ``op_name`` of every fusion, and the entry's cuBLAS calls in order.

    Args:
      hlo_text: an optimized, scheduled HLO module (``*after_optimizations.txt``).

    Returns:
      ``(by_kernel_name, cublas_op_names)``: fusion ``a.12`` is keyed ``a_12``.
    """
    by_name, cublas, in_entry = {}, [], False
    for line in hlo_text.splitlines():
        if line.startswith("ENTRY"):
            in_entry = True
        elif line.startswith("}"):
            in_entry = False
        match = re.match(r"\s*(?:ROOT )?%(\S+) = .*? (fusion|custom-call)\(", line)
        if not match:
            continue
        op_name = re.search(r'op_name="([^"]*)"', line)
        op_name = op_name.group(1) if op_name else ""
        if match.group(2) == "fusion":
            by_name[match.group(1).replace(".", "_")] = op_name
        elif in_entry and re.search(r'custom_call_target="__cublas', line):
            cublas.append(op_name)
    return by_name, cublas


def operation(op_name: str, kernel_name: str) -> str:
    """The operation an ``op_name`` belongs to (see the module docstring)."""
    name = re.sub(r"jit\([^)]*\)/", "", op_name)
    name = re.sub(r"^(shard_map(/|$))+", "", name)  # multi-device steps nest in a shard_map
    name = re.sub(r"^tbo_(?:a|b|joint)/", "", name)  # the lockstep's joint operations too
    layer = re.match(r"L\d+\.(\w+)", name)
    if layer:
        return layer.group(1) + (" (loop)" if "/while/" in name else "")
    weight = re.findall(r"\[\\?'(\w+)\\?'\]", name)
    if weight:
        return "weight " + ".".join(part for part in weight if not part.isdigit())
    if name:
        return name.split("/")[0]
    return re.sub(r"[._]\d+$", "", kernel_name)


def attribute(kernels: list[Kernel], hlo_text: str, steps: int) -> dict[str, float]:
    """Microseconds per step and GPU of every operation.

    Args:
      kernels: one module's kernel executions over ``steps`` steps (``gpu_kernels``), on one
        or several GPUs (each runs the whole step; the result is their mean).
      hlo_text: that module's optimized HLO.
      steps: how many steps the trace holds.

    Returns:
      operation -> microseconds per step and GPU (cuBLAS kernels that cannot be matched by
      order go to "cuBLAS (unmatched)", other kernels without an HLO fusion to their family
      name).
    """
    devices = sorted({kernel.device for kernel in kernels})
    totals = collections.defaultdict(float)
    for device in devices:
        mine = [kernel for kernel in kernels if kernel.device == device]
        for key, value in _attribute_one(mine, hlo_text, steps).items():
            totals[key] += value / len(devices)
    return dict(totals)


def _attribute_one(kernels: list[Kernel], hlo_text: str, steps: int) -> dict[str, float]:
    """``attribute`` for the kernels of one GPU (cuBLAS calls are matched in its order)."""
    totals = collections.defaultdict(float)
    for kernel, key in zip(kernels, _operations_of(kernels, hlo_text, steps), strict=True):
        totals[key] += kernel.microseconds / steps
    return dict(totals)


def _operations_of(kernels: list[Kernel], hlo_text: str, steps: int) -> list[str]:
    """The operation of each of one GPU's kernels, in their order (see ``attribute``)."""
    by_name, cublas = hlo_op_names(hlo_text)
    blas = [k for k in kernels if k.name.startswith(CUBLAS_PREFIXES)]
    matched = bool(cublas) and len(blas) == steps * len(cublas)
    keys, blas_index = [], 0
    for kernel in kernels:
        if kernel.name.startswith(CUBLAS_PREFIXES):
            key = "cuBLAS (unmatched)"
            if matched:
                key = operation(cublas[blas_index % len(cublas)], kernel.name)
                blas_index += 1
        else:
            key = operation(by_name.get(kernel.name, ""), kernel.name)
        keys.append(key)
    return keys


def largest_kernels_table(kernels: list[Kernel], hlo_text: str, steps: int, top: int = 15) -> str:
    """Markdown table of the kernels with the most time per step on one GPU, with their
    operation: what an operation's line of ``attribute`` is made of.

    Args:
      kernels: one module's kernel executions over ``steps`` steps (``gpu_kernels``).
      hlo_text: that module's optimized HLO.
      steps: how many steps the trace holds.
      top: rows listed.

    Returns:
      ``| operation | kernel | us per step | launches per step |`` rows, largest first (the
      first GPU of the trace).
    """
    first = [kernel for kernel in kernels if kernel.device == kernels[0].device] if kernels else []
    totals, counts = collections.Counter(), collections.Counter()
    for kernel, key in zip(first, _operations_of(first, hlo_text, steps), strict=True):
        totals[(key, kernel.name)] += kernel.microseconds / steps
        counts[(key, kernel.name)] += 1
    lines = ["| operation | kernel | us per step | launches per step |", "|---|---|---|---|"]
    for (key, name), micros in totals.most_common(top):
        lines.append(f"| {key} | {name} | {micros:.1f} | {counts[(key, name)] / steps:g} |")
    return "\n".join(lines)


def compare_table(plain: dict[str, float], tbo: dict[str, float], top: int = 25) -> str:
    """Markdown table of per-operation microseconds, largest TBO - plain difference first."""
    keys = sorted(set(plain) | set(tbo), key=lambda k: -(tbo.get(k, 0.0) - plain.get(k, 0.0)))
    lines = ["| operation | no TBO (us) | TBO (us) | TBO - no TBO |", "|---|---|---|---|"]
    for key in keys[:top]:
        a, b = plain.get(key, 0.0), tbo.get(key, 0.0)
        lines.append(f"| {key} | {a:.1f} | {b:.1f} | {b - a:+.1f} |")
    a, b = sum(plain.values()), sum(tbo.values())
    lines.append(f"| **all kernels** | {a:.1f} | {b:.1f} | {b - a:+.1f} |")
    return "\n".join(lines)


def step_module(kernels: list[Kernel]) -> str:
    """The HLO module most of a trace's kernel time belongs to (the profiled step)."""
    time_by_module = collections.Counter()
    for kernel in kernels:
        time_by_module[kernel.module] += kernel.microseconds
    if not time_by_module:
        raise ValueError("the trace holds no GPU kernels (was it taken on a GPU?)")
    return time_by_module.most_common(1)[0][0]


def hlo_dump_of(dump_dir: str, module: str) -> str:
    """The optimized HLO text of ``module`` in an ``--xla_dump_to`` folder.

    A program compiled once and loaded again from the persistent compilation cache is dumped
    twice under one name; such dumps differ in metadata only (their fusions and op names are
    the same), and the first is returned.

    Raises:
      ValueError: no dump of that module, or dumps of different programs under its name.
    """
    pattern = re.compile(rf"module_\d+\.{re.escape(module)}\.\S*after_optimizations\.txt$")
    matches = [name for name in sorted(os.listdir(dump_dir)) if pattern.search(name)]
    texts = []
    for name in matches:
        with open(os.path.join(dump_dir, name)) as file:
            texts.append(file.read())
    programs = {tuple(sorted(hlo_op_names(text)[0].items())) for text in texts}
    if len(programs) != 1:
        raise ValueError(
            f"{len(matches)} optimized-HLO dumps of {len(programs)} programs named {module} "
            f"in {dump_dir}"
        )
    return texts[0]


def step_summary(trace_path: str, dump_dir: str, steps: int) -> tuple[dict[str, float], list[str]]:
    """Everything this module reports on one profiled step, reading its trace once.

    Args:
      trace_path: a ``*.trace.json.gz`` holding ``steps`` steps of one module.
      dump_dir: the ``--xla_dump_to`` folder holding that module's optimized HLO.
      steps: how many steps the trace holds.

    Returns:
      ``(attribution, lines)``: ``attribute`` of the profiled step's module, and the
      ``communication_summary`` and ``busy_summary`` lines.
    """
    kernels = gpu_kernels(read_trace(trace_path))
    module = step_module(kernels)
    mine = [kernel for kernel in kernels if kernel.module == module]
    attribution = attribute(mine, hlo_dump_of(dump_dir, module), steps)
    return attribution, [communication_summary(kernels), busy_summary(mine, steps)]


def _is_communication(kernel: Kernel) -> bool:
    return kernel.name.startswith(NCCL_PREFIXES + PEER_COPY_PREFIXES)


def _is_compute(kernel: Kernel) -> bool:
    return not kernel.name.startswith(NCCL_PREFIXES + PEER_COPY_PREFIXES + NOT_COMPUTE_PREFIXES)


def _by_device(kernels: list[Kernel]) -> dict[int, list[Kernel]]:
    """Each GPU's kernels, in the order given."""
    groups = collections.defaultdict(list)
    for kernel in kernels:
        groups[kernel.device].append(kernel)
    return dict(sorted(groups.items()))


def _intervals(kernels: list[Kernel], keep) -> list[tuple[float, float]]:
    """The union of the kept kernels' ``[start, end)`` intervals (``_merged``)."""
    return _merged([(k.start, k.start + k.microseconds) for k in kernels if keep(k)])


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of intervals as sorted, disjoint ``(start, end)`` pairs."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _overlap(start: float, end: float, union: list[tuple[float, float]]) -> float:
    """Length of ``[start, end)`` covered by the sorted, disjoint ``union``."""
    first = bisect.bisect_right(union, (start, float("inf"))) - 1
    covered = 0.0
    for low, high in union[max(first, 0) :]:
        if low >= end:
            break
        covered += max(0.0, min(end, high) - max(start, low))
    return covered


def hidden_communication(kernels: list[Kernel]) -> tuple[float, float]:
    """How much NCCL time runs while the same GPU computes (the "hidden" fraction).

    Args:
      kernels: a trace's GPU kernels (``gpu_kernels``), any number of devices.

    Returns:
      ``(hidden, total)`` microseconds summed over devices: ``total`` is the NCCL kernels'
      time, ``hidden`` the part of it during which another (non-NCCL, non-copy) kernel of the
      same GPU ran on another stream.
    """
    hidden = total = 0.0
    for mine in _by_device(kernels).values():
        compute = _intervals(mine, _is_compute)
        for kernel in filter(_is_communication, mine):
            total += kernel.microseconds
            hidden += _overlap(kernel.start, kernel.start + kernel.microseconds, compute)
    return hidden, total


@dataclasses.dataclass(frozen=True)
class BusyTimes:
    """Where one GPU's step time goes, in microseconds per step (mean over GPUs).

    ``max(compute, communication)`` bounds what perfect overlap could reach; ``span`` is what
    the step took on the GPU, first kernel start to last kernel end (a plain step without
    overlap comes close to ``compute + communication``).
    """

    compute: float  # time some compute kernel (not NCCL, not a copy) ran
    communication: float  # time some NCCL kernel ran
    span: float  # first kernel start to last kernel end


def busy_times(kernels: list[Kernel], steps: int) -> BusyTimes:
    """Compute, communication and span per step of a module's kernels (``BusyTimes``).

    Args:
      kernels: one module's kernel executions over ``steps`` identical steps, any number of
        GPUs.
      steps: how many steps the trace holds.

    Returns:
      The mean over GPUs and steps.

    Raises:
      ValueError: no kernels, or a GPU with fewer kernels than ``steps``.
    """
    devices = _by_device(kernels)
    if not devices:
        raise ValueError("no kernels to time")
    compute = communication = span = 0.0
    for mine in devices.values():
        for step in _split_steps(mine, steps):
            compute += _union_length(step, _is_compute)
            communication += _union_length(step, _is_communication)
            span += max(k.start + k.microseconds for k in step) - step[0].start
    count = len(devices) * steps
    return BusyTimes(compute / count, communication / count, span / count)


def _split_steps(kernels: list[Kernel], steps: int) -> list[list[Kernel]]:
    """One GPU's kernels (in start order) cut into ``steps`` steps at the ``steps - 1``
    longest idle gaps (between steps the GPU waits for the host; a profiler may drop a
    kernel, so equal counts are not assumed)."""
    if len(kernels) < steps:
        raise ValueError(f"{len(kernels)} kernels cannot hold {steps} steps")
    gaps, end = [], kernels[0].start
    for index in range(1, len(kernels)):
        end = max(end, kernels[index - 1].start + kernels[index - 1].microseconds)
        gaps.append((kernels[index].start - end, index))
    cuts = sorted(index for _, index in sorted(gaps, reverse=True)[: steps - 1])
    bounds = [0, *cuts, len(kernels)]
    return [kernels[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def _union_length(kernels: list[Kernel], keep) -> float:
    """Length of the union of the kept kernels' intervals."""
    return sum(end - start for start, end in _intervals(kernels, keep))


def busy_summary(kernels: list[Kernel], steps: int) -> str:
    """One line of ``busy_times`` of a module's kernels, in ms."""
    times = busy_times(kernels, steps)
    bound = max(times.compute, times.communication)
    return (
        f"per GPU and step: compute {times.compute / 1e3:.2f} ms, communication "
        f"{times.communication / 1e3:.2f} ms, span {times.span / 1e3:.2f} ms "
        f"({times.span / bound:.3f} x max(compute, communication))"
    )


def _compute_totals(kernels: list[Kernel]) -> tuple[collections.Counter, collections.Counter]:
    """Microseconds and launches of each compute kernel's name, over all GPUs."""
    totals, counts = collections.Counter(), collections.Counter()
    for kernel in kernels:
        if _is_compute(kernel):
            totals[kernel.name] += kernel.microseconds
            counts[kernel.name] += 1
    return totals, counts


def largest_compute_kernels(kernels: list[Kernel], steps: int, top: int = 5) -> str:
    """One line: the compute kernels with the most time per GPU and step, by name.

    Args:
      kernels: a trace's kernels (``gpu_kernels``).
      steps: runs of the program the trace holds.
      top: names listed.

    Returns:
      ``"largest compute kernels per GPU and step: name 1.23 ms x 4, ..."`` (count: launches
      per GPU and step), or a line saying there were none.
    """
    totals, counts = _compute_totals(kernels)
    if not totals:
        return "no compute kernels in the trace"
    per_step = max(len(_by_device(kernels)), 1) * steps
    listed = ", ".join(
        f"{name} {total / per_step / 1e3:.2f} ms x {counts[name] / per_step:g}"
        for name, total in totals.most_common(top)
    )
    return f"largest compute kernels per GPU and step: {listed}"


def kernels_per_call(kernels: list[Kernel], calls: int, top: int = 8) -> str:
    """One line: every compute kernel's GPU time per call in microseconds, largest first.

    For a small program (one layer, one kernel) where ``largest_compute_kernels``'
    milliseconds are too coarse: the total first, with the span of the calls (first kernel
    start to last kernel end, over ``calls``: what the GPU took per call run back to back,
    idle gaps between kernels included), then ``top`` names, then the rest summed.

    Args:
      kernels: a trace's kernels (``gpu_kernels``), of one GPU.
      calls: runs of the program the trace holds.
      top: names listed.

    Returns:
      ``"kernels per call 123.4 us (span 150.0 us): name 100.0 us x 1, ..., 6 others 3.2
      us"``, or a line saying there were none.
    """
    totals, counts = _compute_totals(kernels)
    if not totals:
        return "no compute kernels in the trace"
    ranked = totals.most_common()
    listed = [
        f"{name} {total / calls:.1f} us x {counts[name] / calls:g}" for name, total in ranked[:top]
    ]
    rest = ranked[top:]
    if rest:
        listed.append(f"{len(rest)} others {sum(t for _, t in rest) / calls:.1f} us")
    span = max(k.start + k.microseconds for k in kernels) - min(k.start for k in kernels)
    return (
        f"kernels per call {sum(totals.values()) / calls:.1f} us (span {span / calls:.1f} us): "
        f"{', '.join(listed)}"
    )


def communication_summary(kernels: list[Kernel]) -> str:
    """One line: NCCL time hidden under compute among a trace's kernels
    (``hidden_communication``)."""
    hidden, total = hidden_communication(kernels)
    if total == 0:
        return "no NCCL kernels in the trace"
    return (
        f"communication {total:.1f} us, of it under compute {hidden:.1f} us ({hidden / total:.3f})"
    )


def collective_bytes(hlo_text: str) -> dict[str, list[int]]:
    """Bytes each collective of one step moves on one device, by kind.

    Peer-copy all-to-alls (a start and a wait custom call) count under
    ``hlo_schedule.PEER_COPY_KIND``.

    A collective's bytes are its larger buffer (the ``-done`` result or the start's operands,
    each summed over tuple elements): the "size" of NCCL's own tests, e.g. an all-to-all's
    whole send buffer (the device's own slice included), an all-gather's gathered result.

    Args:
      hlo_text: a compiled, scheduled HLO module (per-device shapes, as after SPMD
        partitioning: ``*after_optimizations.txt`` or ``compile().as_text()``).

    Returns:
      kind (``"all-to-all"``, ``"all-reduce"``, ...) -> bytes of each of its collectives in
      schedule order; every listed collective runs once per step.

    Raises:
      ValueError: no entry computation, or a collective outside it (in a loop body or a
        branch: how often it runs per step is not in the text).
    """
    computations = hlo_schedule.parse_module(hlo_text)
    by_kind = collections.defaultdict(list)
    for window in hlo_schedule.collective_windows(hlo_text):
        computation = computations[window.computation]
        if not computation.is_entry:
            raise ValueError(
                f"{window.kind} {window.start} runs in {window.computation}, not the entry: "
                "its count per step is unknown"
            )
        by_kind[window.kind].append(_buffer_bytes(computation, window.start, window.done))
    return dict(by_kind)


def _buffer_bytes(computation: hlo_schedule.Computation, start: str, done: str) -> int:
    """The larger of a collective's summed operands (at ``start``) and result (``done``)."""
    shapes = {instruction.name: instruction.shape for instruction in computation.instructions}
    operands = next(i.operands for i in computation.instructions if i.name == start)
    sent = sum(sum(hlo_schedule.shape_bytes(shapes[operand])) for operand in operands)
    return max(sent, sum(hlo_schedule.shape_bytes(shapes[done])))


def main(argv: list[str]) -> None:
    """``python -m jtbo.bench kernel_time --plain TRACE --tbo TRACE --hlo DIR [--steps N]``:
    prints ``compare_table`` of two profiled steps (e.g. from ``bench tbo --profile``)."""
    parser = argparse.ArgumentParser(prog="python -m jtbo.bench kernel_time")
    parser.add_argument("--plain", required=True, help="trace of the step without TBO")
    parser.add_argument("--tbo", required=True, help="trace of the TBO step")
    parser.add_argument("--hlo", required=True, help="--xla_dump_to folder of both compiles")
    parser.add_argument("--steps", type=int, default=1, help="steps each trace holds")
    args = parser.parse_args(argv)
    (plain, plain_lines), (tbo, tbo_lines) = (
        step_summary(path, args.hlo, args.steps) for path in (args.plain, args.tbo)
    )
    print(compare_table(plain, tbo))
    for label, lines in (("no TBO", plain_lines), ("TBO", tbo_lines)):
        for line in lines:
            print(f"{label}: {line}")
