"""Reading a compiled (scheduled) HLO module: collectives and what runs while they fly.

A compiled GPU module's text lists each computation's instructions in schedule order. XLA
issues a collective asynchronously as a ``<kind>-start`` / ``<kind>-done`` pair (or an
``async-start`` / ``async-done`` pair wrapping a computation that holds the collective);
whatever the schedule puts between the two runs while the collective is in flight. A
collective printed as a plain op (``all-to-all(...)``) is synchronous.

This module parses the text into computations and instructions, attributes every
instruction to a micro-batch from its ``op_name`` metadata (the ``tbo_a`` / ``tbo_b`` named
scopes of ``jtbo.overlap.operations``; an instruction without one is attributed through the
instructions of the computation it calls, e.g. a fusion's body; never guessed), and lists
for each collective the compute instructions scheduled inside its window. The scanned
computations are the entry and those reached from it through control flow (while bodies and
conditions, calls, conditional branches); fusion bodies and reduction regions are not
schedules.
"""

import dataclasses
import re

from jtbo.ffi import build as ffi_build
from jtbo.overlap import operations

COLLECTIVE_KINDS = frozenset(
    (
        "all-gather",
        "all-reduce",
        "reduce-scatter",
        "all-to-all",
        "ragged-all-to-all",
        "collective-permute",
        "collective-broadcast",
    )
)
PEER_COPY_KIND = "peer-all-to-all"
"""``CollectiveWindow.kind`` of a peer-copy all-to-all (``jtbo.collectives.peer_copy``): its
window runs from the start custom call to the wait custom call."""
PEER_COPY_START = f'custom_call_target="{ffi_build.START_TARGET}"'
"""The attribute text that marks a peer-copy start custom call."""
PEER_COPY_WAIT = f'custom_call_target="{ffi_build.WAIT_TARGET}"'
"""The attribute text that marks a peer-copy wait custom call."""
# Instructions that move no data through the GPU's compute units (or are bookkeeping).
NON_COMPUTE_OPCODES = frozenset(
    (
        "parameter",
        "constant",
        "bitcast",
        "tuple",
        "get-tuple-element",
        "after-all",
        "add-dependency",
        "opt-barrier",
        "partition-id",
        "replica-id",
        "copy-start",
        "copy-done",
        "async-start",
        "async-update",
        "async-done",
        "send",
        "send-done",
        "recv",
        "recv-done",
    )
)
_DTYPE_BYTES = {"pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2}
_DTYPE_BYTES |= {"bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_DTYPE_BYTES |= {"c64": 8, "c128": 16, "token": 0}
_ARRAY = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$")
_ASSIGN = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CALLEE = re.compile(
    r"\b(calls|body|condition|to_apply|true_computation|false_computation)=%([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One HLO instruction as printed."""

    name: str
    opcode: str
    shape: str  # the result shape text, e.g. "bf16[256,512]{1,0}" or a tuple
    operands: tuple[str, ...]  # operand instruction names
    op_name: str | None  # the op_name metadata (the JAX name stack), if any
    callees: tuple[tuple[str, str], ...]  # (attribute, computation) pairs, e.g. ("calls", "f")
    attributes: str = ""  # the text after the operand list (dims, configs, metadata)


@dataclasses.dataclass(frozen=True)
class Computation:
    """A computation's instructions in the printed (for scheduled modules: schedule) order."""

    name: str
    is_entry: bool
    instructions: tuple[Instruction, ...]


@dataclasses.dataclass(frozen=True)
class ComputeSlot:
    """A compute instruction scheduled inside a collective's window."""

    name: str
    opcode: str
    micro_batch: str | None  # "tbo_a", "tbo_b", "mixed" or None (no attribution)


@dataclasses.dataclass(frozen=True)
class CollectiveWindow:
    """One collective and the compute scheduled between its start and done."""

    computation: str
    kind: str  # e.g. "all-gather", "all-to-all"
    start: str  # start instruction name (the op itself when synchronous)
    done: str  # done instruction name (the op itself when synchronous)
    start_index: int  # position in the computation's schedule
    done_index: int
    num_bytes: int  # the larger of the collective's input and output buffers
    micro_batch: str | None  # issuing micro-batch
    is_async: bool
    between: tuple[ComputeSlot, ...]  # compute instructions between start and done

    def other_micro_batch_compute(self) -> tuple[ComputeSlot, ...]:
        """The compute in the window that belongs to the other micro-batch."""
        if self.micro_batch not in operations.MICRO_BATCH_SCOPES:
            return ()
        return tuple(
            slot
            for slot in self.between
            if slot.micro_batch in operations.MICRO_BATCH_SCOPES
            and slot.micro_batch != self.micro_batch
        )


def parse_module(text: str) -> dict[str, Computation]:
    """Parses compiled HLO text into its computations, by name.

    Raises:
      ValueError: the text holds no entry computation.
    """
    computations: dict[str, Computation] = {}
    header, body = None, []
    for line in text.splitlines():
        if header is None:
            header = _HEADER.match(line)
            body = []
        elif line.strip() == "}":
            name = header.group(2)
            computations[name] = Computation(name, bool(header.group(1)), tuple(body))
            header = None
        elif (instruction := _parse_instruction(line)) is not None:
            body.append(instruction)
    if not any(c.is_entry for c in computations.values()):
        raise ValueError("HLO text has no ENTRY computation")
    return computations


def _parse_instruction(line: str) -> Instruction | None:
    match = _ASSIGN.match(line)
    if match is None:
        return None
    name, rest = match.groups()
    shape, rest = _split_shape(rest)
    opcode, _, rest = rest.partition("(")
    operand_text = _balanced_prefix(rest)
    op_name = _OP_NAME.search(rest)
    callees = [(m.group(1), m.group(2)) for m in _CALLEE.finditer(rest)]
    for branches in _BRANCHES.finditer(rest):
        callees += [("branch", b.strip().lstrip("%")) for b in branches.group(1).split(",")]
    return Instruction(
        name=name,
        opcode=opcode.strip(),
        shape=shape,
        operands=tuple(re.findall(r"%([\w.\-]+)", operand_text)),
        op_name=op_name.group(1) if op_name else None,
        callees=tuple(callees),
        attributes=rest[len(operand_text) + 1 :],
    )


def _split_shape(text: str) -> tuple[str, str]:
    """Splits ``shape opcode(...)`` where the shape may be a parenthesised tuple."""
    if not text.startswith("("):
        shape, _, rest = text.partition(" ")
        return shape, rest
    shape = "(" + _balanced_prefix(text[1:]) + ")"
    return shape, text[len(shape) :].lstrip()


def _balanced_prefix(text: str) -> str:
    """Returns ``text`` up to the parenthesis closing an already opened one."""
    depth = 1
    for index, char in enumerate(text):
        depth += (char == "(") - (char == ")")
        if depth == 0:
            return text[:index]
    return text


def shape_bytes(shape: str) -> list[int]:
    """Bytes of every array in a shape text (one entry per tuple element)."""
    sizes = []
    for dtype, dims in _ARRAY.findall(shape):
        count = 1
        for dim in filter(None, dims.split(",")):
            count *= int(dim)
        sizes.append(count * _DTYPE_BYTES.get(dtype, 1))
    return sizes


def micro_batch_of(
    instruction: Instruction, computations: dict[str, Computation], _depth: int = 0
) -> str | None:
    """The micro-batch an instruction belongs to: "tbo_a", "tbo_b", "mixed" or None.

    From the instruction's own ``op_name``; without one, from the instructions of the
    computations it calls (a fusion's body), "mixed" when those name both micro-batches.
    """
    own = _scope_in(instruction.op_name)
    if own is not None or _depth > 4:
        return own
    found = set()
    for _, callee in instruction.callees:
        for inner in computations.get(callee, Computation(callee, False, ())).instructions:
            inner_batch = micro_batch_of(inner, computations, _depth + 1)
            if inner_batch is not None:
                found.add(inner_batch)
    if len(found) > 1:
        return "mixed"
    return found.pop() if found else None


def _scope_in(op_name: str | None) -> str | None:
    if not op_name:
        return None
    scopes = {part for part in op_name.split("/") if part in operations.MICRO_BATCH_SCOPES}
    if len(scopes) > 1:
        return "mixed"
    return scopes.pop() if scopes else None


def scheduled_computations(computations: dict[str, Computation]) -> list[Computation]:
    """The entry and the computations control flow reaches from it (schedules of their own)."""
    entry = next(c for c in computations.values() if c.is_entry)
    order, pending, seen = [], [entry.name], {entry.name}
    while pending:
        computation = computations[pending.pop(0)]
        order.append(computation)
        for instruction in computation.instructions:
            for _, callee in _control_flow_callees(instruction):
                if callee in computations and callee not in seen:
                    seen.add(callee)
                    pending.append(callee)
    return order


def _control_flow_callees(instruction: Instruction) -> list[tuple[str, str]]:
    if instruction.opcode == "while":
        return [c for c in instruction.callees if c[0] in ("body", "condition")]
    if instruction.opcode == "call":
        return [c for c in instruction.callees if c[0] in ("calls", "to_apply")]
    if instruction.opcode == "conditional":
        return [c for c in instruction.callees if c[0] != "calls"]
    return []


def collective_windows(text: str) -> list[CollectiveWindow]:
    """Every collective in the scheduled computations, with the compute inside its window.

    Args:
      text: a compiled module's text (``jax.jit(f).lower(...).compile().as_text()``).

    Returns:
      The collectives in schedule order (per computation).
    """
    computations = parse_module(text)
    windows = []
    for computation in scheduled_computations(computations):
        windows += _windows_in(computation, computations)
    return windows


def _windows_in(computation: Computation, computations) -> list[CollectiveWindow]:
    instructions = computation.instructions
    index_of = {instruction.name: i for i, instruction in enumerate(instructions)}
    shapes = {instruction.name: instruction.shape for instruction in instructions}
    windows = []
    by_name = {instruction.name: instruction for instruction in instructions}
    for done_index, done in enumerate(instructions):
        if done.opcode.endswith("-start") or done.opcode == "async-update":
            continue  # windows are found from their done
        if _is_peer_copy(done, PEER_COPY_START):
            continue  # found from its wait
        start_index = _start_index(done, index_of, by_name)
        kind = _collective_kind(instructions[start_index], computations)
        if kind is None:
            continue
        start = instructions[start_index]
        operand_sizes = [b for o in start.operands for b in shape_bytes(shapes.get(o, ""))]
        between = tuple(
            ComputeSlot(inner.name, inner.opcode, micro_batch_of(inner, computations))
            for inner in instructions[start_index + 1 : done_index]
            if is_compute(inner)
        )
        windows.append(
            CollectiveWindow(
                computation=computation.name,
                kind=kind,
                start=start.name,
                done=done.name,
                start_index=start_index,
                done_index=done_index,
                num_bytes=max(shape_bytes(start.shape) + operand_sizes, default=0),
                micro_batch=micro_batch_of(start, computations),
                is_async=start_index != done_index,
                between=between,
            )
        )
    return windows


def _start_index(done: Instruction, index_of: dict[str, int], by_name) -> int:
    """Where the collective that ``done`` completes started (itself when synchronous)."""
    if done.opcode.endswith("-done") and done.operands:
        return index_of.get(done.operands[0], index_of[done.name])
    if _is_peer_copy(done, PEER_COPY_WAIT):
        return index_of[_peer_copy_start(done, by_name)]
    return index_of[done.name]


def _is_peer_copy(instruction: Instruction, target: str) -> bool:
    return instruction.opcode == "custom-call" and target in instruction.attributes


_EXCHANGE_SCOPE = re.compile(rf"(?:^|/){re.escape(ffi_build.EXCHANGE_SCOPE)}(\d+)(?:/|$)")


def _exchange_number(instruction: Instruction) -> str | None:
    """The peer-copy exchange number in an instruction's name stack (``op_name``), if any."""
    match = _EXCHANGE_SCOPE.search(instruction.op_name or "")
    return match.group(1) if match else None


def _peer_copy_start(wait: Instruction, by_name: dict[str, Instruction]) -> str:
    """The start custom call of the exchange ``wait`` completes: the one start in the same
    computation under the same exchange scope (``jtbo.ffi.build.EXCHANGE_SCOPE``). The scope
    pairs them whatever XLA puts between them (tuples, barriers, copies, command-buffer calls).

    Raises:
      ValueError: the wait has no exchange scope, or not exactly one start shares it.
    """
    number = _exchange_number(wait)
    if number is None:
        raise ValueError(f"peer-copy wait {wait.name} has no {ffi_build.EXCHANGE_SCOPE}N scope")
    starts = [
        name
        for name, instruction in by_name.items()
        if _is_peer_copy(instruction, PEER_COPY_START) and _exchange_number(instruction) == number
    ]
    if len(starts) != 1:
        raise ValueError(f"peer-copy wait {wait.name}: {len(starts)} starts of exchange {number}")
    return starts[0]


def _collective_kind(start: Instruction, computations) -> str | None:
    if _is_peer_copy(start, PEER_COPY_START):
        return PEER_COPY_KIND
    opcode = start.opcode
    if opcode in COLLECTIVE_KINDS:
        return opcode
    if opcode.endswith("-start") and opcode.removesuffix("-start") in COLLECTIVE_KINDS:
        return opcode.removesuffix("-start")
    if opcode == "async-start":
        for _, callee in start.callees:
            for inner in computations.get(callee, Computation(callee, False, ())).instructions:
                if inner.opcode in COLLECTIVE_KINDS:
                    return inner.opcode
    return None


def is_compute(instruction: Instruction) -> bool:
    """Whether an instruction does device work (fusions, gemm custom-calls, loops, ...)."""
    opcode = instruction.opcode
    if opcode in NON_COMPUTE_OPCODES or opcode in COLLECTIVE_KINDS:
        return False
    if _is_peer_copy(instruction, PEER_COPY_START) or _is_peer_copy(instruction, PEER_COPY_WAIT):
        return False  # the peer-copy exchange's own calls
    return not (opcode.endswith("-start") or opcode.endswith("-done"))
