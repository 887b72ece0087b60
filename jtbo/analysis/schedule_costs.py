"""Estimated run times of a compiled GPU module's instructions, and how full each window is.

XLA's latency-hiding scheduler decides how much compute to place between a collective's
``-start`` and ``-done`` from two estimates: how long the collective takes, and how long each
instruction runs. Whatever it decides, the GPU then runs the schedule in order on one compute
stream: an exchange hides only under the compute placed inside its window. The coverage of
``jtbo.analysis.report`` counts a window as covered when any other-micro-batch compute is
inside, so one small fusion beside a large all-to-all passes it.

This module prices every instruction from its shapes - a roofline: matmul FLOPs over the
matmul rate, bytes read and written over the memory bandwidth, plus a launch cost; a loop as
its body times its trip count (``CostModel.unknown_trip_count`` when the count is data-
dependent, as the attention loops' are) - and every collective from its bytes over the link's
bandwidth. ``window_fill`` then gives, for each collective, the estimated compute of the other
micro-batch inside its window against the exchange's estimated time: below 1.0 the exchange
outlasts the compute beside it. The figures are estimates for comparing schedules, not
predictions of step times (docs/benchmarks/, "Run-time overlap on two H200s", compares
them with the GPU profiles).
"""

import dataclasses
import math
import re

from jtbo.analysis import hlo_schedule

_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_CUBLAS_CONTRACTING = re.compile(r'"lhs_contracting_dimensions":\[([^\]]*)\]')
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_SHAPE_DIMS = re.compile(r"\[([\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class CostModel:
    """The device and link figures the estimates are made from.

    Defaults: one H200 and NCCL over NVLink between two H200s, rounded from the measured
    figures in docs/benchmarks/ ("Kernels: the copy kernels", "Run-time overlap on two H200s").
    """

    matmul_flops_per_s: float = 700e12  # dense bf16 matmul rate
    memory_bytes_per_s: float = 2.5e12  # bytes read + written per second by a fusion
    launch_us: float = 3.0  # fixed cost of every kernel
    link_bytes_per_s: float = 600e9  # collective buffer bytes per second through NCCL
    collective_launch_us: float = 20.0  # fixed cost of every collective
    unknown_trip_count: int = 8  # trips assumed for a loop whose count is data-dependent


@dataclasses.dataclass(frozen=True)
class WindowFill:
    """One collective window priced: what runs beside the exchange against its time."""

    start: str  # the collective's start instruction
    kind: str  # e.g. "all-to-all"
    micro_batch: str | None  # the issuing micro-batch
    num_bytes: int  # the collective's buffer
    exchange_us: float  # estimated collective time
    compute_us: float  # estimated time of all compute inside the window
    other_micro_batch_us: float  # of it, the other micro-batch's

    @property
    def fill(self) -> float:
        """Other-micro-batch compute over exchange time (1.0: the exchange can hide)."""
        return self.other_micro_batch_us / self.exchange_us if self.exchange_us else 0.0


def _elements(shape: str) -> int:
    total = 0
    for dims in _SHAPE_DIMS.findall(shape):
        total += math.prod(int(d) for d in dims.split(",") if d)
    return total


def _dims(shape: str) -> list[int]:
    found = _SHAPE_DIMS.search(shape)
    return [int(d) for d in found.group(1).split(",") if d] if found else []


def _contracted(lhs_shape: str, dims_text: str) -> int:
    """Product of the lhs dimensions listed in ``dims_text`` (``"1,2"`` or ``'"1","2"'``)."""
    lhs = _dims(lhs_shape)
    picked = [int(d.strip('" ')) for d in dims_text.split(",") if d.strip('" ')]
    return math.prod(lhs[d] for d in picked if d < len(lhs))


def _matmul_flops(instruction, shapes: dict[str, str]) -> float:
    """FLOPs of a ``dot`` or a cuBLAS / cuDNN gemm custom-call (0 for anything else)."""
    if instruction.opcode == "dot":
        found = _CONTRACTING.search(instruction.attributes)
    elif instruction.opcode == "custom-call":
        found = _CUBLAS_CONTRACTING.search(instruction.attributes)
    else:
        return 0.0
    if found is None or not instruction.operands:
        return 0.0
    depth = _contracted(shapes.get(instruction.operands[0], ""), found.group(1))
    output = instruction.shape
    if output.startswith("("):  # cuBLAS returns (result, workspace)
        output = output[1:].split(" ")[0]
    return 2.0 * _elements(output) * depth


class _Pricer:
    """Prices the instructions of one parsed module (memoised per computation)."""

    def __init__(self, computations: dict[str, hlo_schedule.Computation], model: CostModel):
        self.computations = computations
        self.model = model
        self._flops: dict[str, float] = {}
        self._sums: dict[str, float] = {}

    def flops_in(self, name: str) -> float:
        """Matmul FLOPs of a computation and of every computation it calls."""
        if name not in self._flops:
            computation = self.computations.get(name)
            total = 0.0
            if computation is not None:
                shapes = {i.name: i.shape for i in computation.instructions}
                for instruction in computation.instructions:
                    total += _matmul_flops(instruction, shapes)
                    total += sum(self.flops_in(callee) for _, callee in instruction.callees)
            self._flops[name] = total
        return self._flops[name]

    def sequence_us(self, name: str) -> float:
        """Estimated time of running a computation's instructions one after another."""
        if name not in self._sums:
            computation = self.computations.get(name)
            instructions = computation.instructions if computation else ()
            shapes = {i.name: i.shape for i in instructions}
            self._sums[name] = sum(self.cost_us(i, shapes) for i in instructions)
        return self._sums[name]

    def cost_us(self, instruction, shapes: dict[str, str]) -> float:
        """Estimated run time of one scheduled instruction (0 for bookkeeping)."""
        if not hlo_schedule.is_compute(instruction):
            return 0.0
        if instruction.opcode == "while":
            return self._loop_us(instruction)
        if instruction.opcode == "conditional":
            branches = [c for a, c in instruction.callees if a != "calls"]
            return max((self.sequence_us(c) for c in branches), default=0.0)
        if instruction.opcode == "call":
            return sum(self.sequence_us(c) for a, c in instruction.callees if a == "to_apply")
        return self._kernel_us(instruction, shapes)

    def _loop_us(self, instruction) -> float:
        found = _TRIP_COUNT.search(instruction.attributes)
        trips = int(found.group(1)) if found else self.model.unknown_trip_count
        parts = [c for a, c in instruction.callees if a in ("body", "condition")]
        return trips * sum(self.sequence_us(c) for c in parts)

    def _kernel_us(self, instruction, shapes: dict[str, str]) -> float:
        flops = _matmul_flops(instruction, shapes)
        flops += sum(self.flops_in(c) for a, c in instruction.callees if a == "calls")
        moved = sum(hlo_schedule.shape_bytes(instruction.shape))
        moved += sum(sum(hlo_schedule.shape_bytes(shapes.get(o, ""))) for o in instruction.operands)
        seconds = max(flops / self.model.matmul_flops_per_s, moved / self.model.memory_bytes_per_s)
        return self.model.launch_us + seconds * 1e6


def collective_us(num_bytes: int, model: CostModel) -> float:
    """Estimated time of a collective over ``num_bytes`` (its larger buffer)."""
    return model.collective_launch_us + num_bytes / model.link_bytes_per_s * 1e6


def window_fill(text: str, model: CostModel = CostModel()) -> list[WindowFill]:
    """Every async collective of a compiled module, priced (see ``WindowFill``).

    Args:
      text: the compiled module's text.
      model: device and link figures.

    Returns:
      One ``WindowFill`` per async collective, in schedule order.
    """
    computations = hlo_schedule.parse_module(text)
    pricer = _Pricer(computations, model)
    fills = []
    for window in hlo_schedule.collective_windows(text):
        if not window.is_async:
            continue
        computation = computations[window.computation]
        shapes = {i.name: i.shape for i in computation.instructions}
        inside = computation.instructions[window.start_index + 1 : window.done_index]
        other = {slot.name for slot in window.other_micro_batch_compute()}
        priced = [(i.name, pricer.cost_us(i, shapes)) for i in inside]
        fills.append(
            WindowFill(
                start=window.start, kind=window.kind, micro_batch=window.micro_batch,
                num_bytes=window.num_bytes, exchange_us=collective_us(window.num_bytes, model),
                compute_us=sum(us for _, us in priced),
                other_micro_batch_us=sum(us for name, us in priced if name in other),
            )
        )  # fmt: skip
    return fills
