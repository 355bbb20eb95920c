"""How many tokens a request generates when it is allowed to stop at EOS.

The simulator does not run a model, so EOS is drawn from a length distribution: a log-normal with
median ``median_tokens`` and log-space spread ``sigma`` (defaults shaped like chat answers in ShareGPT:
median ≈ 180 tokens, long tail), then clamped to ``[min_tokens, max_tokens]``. Draws come from one
``random.Random(seed)`` consumed in request order, so a fixed seed and request sequence give the
same lengths. With ``ignore_eos`` the length is exactly ``max_tokens``.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class OutputLengthModel:
    median_tokens: float = 180.0
    sigma: float = 1.0

    def sampler(self, seed: int) -> OutputLengthSampler:
        return OutputLengthSampler(self, seed)


class OutputLengthSampler:
    def __init__(self, model: OutputLengthModel, seed: int) -> None:
        self._mu = math.log(model.median_tokens)
        self._sigma = model.sigma
        self._rng = random.Random(seed)

    def draw(self, max_tokens: int, min_tokens: int = 0, ignore_eos: bool = False) -> tuple[int, bool]:
        """(length, stopped_at_eos). The draw is consumed even under ignore_eos, keeping streams aligned."""
        eos_at = max(1, int(round(self._rng.lognormvariate(self._mu, self._sigma))))
        if ignore_eos:
            return max_tokens, False
        length = max(eos_at, min_tokens, 1)
        if length >= max_tokens:
            return max_tokens, False
        return length, True
