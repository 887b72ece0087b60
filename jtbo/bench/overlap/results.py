"""What a measurement brings back: the run information, one result per collective, and a
variant's outcome; ``hidden_fraction`` reads the overlap off the three times."""

import dataclasses

from jtbo.bench.overlap import variants as variants_lib


def hidden_fraction(comm_s: float, compute_s: float, both_s: float) -> float:
    """How much of the shorter program ran beside the other (see the package docstring).

    Args:
      comm_s: seconds of the collective chain alone.
      compute_s: seconds of the matmul chain alone.
      both_s: seconds of the program running both.

    Returns:
      ``(comm + compute - both) / min(comm, compute)``: 1 fully hidden, 0 serial.

    Raises:
      ValueError: a time that is not positive.
    """
    if min(comm_s, compute_s, both_s) <= 0:
        raise ValueError(f"times must be positive, got {comm_s}, {compute_s}, {both_s}")
    return (comm_s + compute_s - both_s) / min(comm_s, compute_s)


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    """The timings of one collective under one variant."""

    variant: str
    collective: str
    windows: str  # --windows of the both program (WINDOW_MODES)
    bytes_per_exchange: int  # --bytes: the larger buffer of one exchange on one device
    chain: int  # collectives per program
    matmuls_per_window: int
    comm_s: float  # median seconds of the comm-alone program
    compute_s: float
    both_s: float

    @property
    def hidden(self) -> float:
        return hidden_fraction(self.comm_s, self.compute_s, self.both_s)

    @property
    def comm_gbps(self) -> float:
        return self.bytes_per_exchange * self.chain / self.comm_s / 1e9


@dataclasses.dataclass(frozen=True)
class RunInfo:
    """What one measurement ran on and with (the header line)."""

    devices: int
    device_kind: str
    platform: str
    processes: int
    jax_version: str
    bytes_per_exchange: int
    matmul: int
    chain: int
    iters: int
    dtype: str
    windows: str  # --windows of the both programs


@dataclasses.dataclass(frozen=True)
class VariantOutcome:
    """What a variant's run brought back."""

    variant: variants_lib.Variant
    info: RunInfo | None
    results: tuple[ProbeResult, ...]
    failure: str | None = None  # what went wrong, None if the run succeeded
    stderr_tail: str = ""
