"""Choosing the next token from a row of logits: greedy, or temperature + top-p sampling.

Greedy (``temperature == 0``, the default) takes the argmax. Sampling divides the logits by
the temperature, takes the softmax (float64, on the host: a row is one vocabulary), keeps the
*nucleus* - the most likely tokens, in order, up to the first whose cumulative probability
reaches ``top_p`` (at least one token) - renormalises it and draws one token by inverting the
cumulative distribution at a uniform number.

Every request draws from its own generator, seeded by ``(seed, request index)``: a request's
tokens depend only on its own logits and the seed, not on which DP rank serves it, what it is
batched with, or whether the step ran two-batch overlap.
"""

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How ``generate`` picks tokens.

    Attributes:
      temperature: 0 for greedy (argmax); > 0 divides the logits before the softmax.
      top_p: nucleus size as cumulative probability, in (0, 1]; 1 keeps every token.
      seed: seeds each request's generator together with the request's index.
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


def nucleus_probs(logits: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
    """The distribution a token is drawn from.

    Args:
      logits: ``[V]`` one row of logits.
      temperature: > 0.
      top_p: in (0, 1].

    Returns:
      ``[V]`` float64 probabilities, zero outside the nucleus, summing to 1.
    """
    scaled = np.asarray(logits, np.float64) / temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    before = np.cumsum(probs[order]) - probs[order]  # mass of the more likely tokens
    keep = order[before < top_p]  # the first token always stays (before == 0)
    nucleus = np.zeros_like(probs)
    nucleus[keep] = probs[keep]
    return nucleus / nucleus.sum()


def request_generator(params: SamplingParams, request_index: int) -> np.random.Generator:
    """The generator of one request (see the module docstring)."""
    return np.random.default_rng([params.seed, request_index])


def next_token(
    logits: np.ndarray, params: SamplingParams, generator: np.random.Generator | None
) -> int:
    """Picks one token from ``logits [V]``.

    Args:
      logits: one row of logits.
      params: greedy or sampling settings.
      generator: the request's generator (unused, and may be None, when greedy).

    Returns:
      The token id.
    """
    if params.greedy:
        return int(np.argmax(logits))
    probs = nucleus_probs(logits, params.temperature, params.top_p)
    cumulative = np.cumsum(probs)
    token = int(np.searchsorted(cumulative, generator.random() * cumulative[-1], side="right"))
    return min(token, len(probs) - 1)
