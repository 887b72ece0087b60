"""How ``generate`` picks tokens: greedy, or temperature + top-p sampling with a seed.

Greedy (``temperature == 0``, the default) takes the argmax. Sampling divides the logits by
the temperature, takes the softmax, keeps the *nucleus* - the most likely tokens, in order, up
to the first whose cumulative probability reaches ``top_p`` (at least one token) - and draws
one token from it. The step does this on the devices (``jtbo.models.sampler``), with one
uniform number per token keyed by ``(seed, request, token index)``: a request's tokens depend
only on its own logits and the seed, not on which DP rank serves it, what it is batched with,
whether the step ran two-batch overlap or whether the loop was pipelined.
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How ``generate`` picks tokens.

    Attributes:
      temperature: 0 for greedy (argmax); > 0 divides the logits before the softmax.
      top_p: nucleus size as cumulative probability, in (0, 1]; 1 keeps every token.
      seed: keys each request's draws together with its index and the token's index.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0: greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")

    @property
    def greedy(self) -> bool:
        """Whether tokens are the argmax (no randomness)."""
        return self.temperature == 0


GREEDY = SamplingParams()
