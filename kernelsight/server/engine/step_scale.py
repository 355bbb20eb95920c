"""``ScaledStepModel``: a step model whose every step takes ``factor`` times as long (fault injection's "slow"
replica: a throttled or degraded GPU), put in front of the engine's own so that the virtual clock, the token
release times and every /metrics histogram slow down together."""

from __future__ import annotations

from typing import Any

import numpy as np


class ScaledStepModel:
    """Delegates to ``inner`` and multiplies the step times (and their breakdown) by ``factor``."""

    def __init__(self, inner: Any, factor: float = 1.0) -> None:
        self.inner = inner
        self.factor = factor

    def step(self, batch: Any) -> tuple[np.ndarray, float]:
        breakdown, total_s = self.inner.step(batch)
        f = self.factor
        return (breakdown, total_s) if f == 1.0 else (breakdown * f, total_s * f)

    def decode_window(self, num_decodes: int, context_tokens_start: int, num_steps: int,
                      top: tuple[int, ...] = ()) -> tuple[list[float], Any]:
        durations, breakdown = self.inner.decode_window(num_decodes, context_tokens_start, num_steps, top)
        f = self.factor
        if f == 1.0:
            return durations, breakdown
        return [d * f for d in durations], breakdown * f

    def __getattr__(self, name: str) -> Any:       # everything else is the inner model's
        return getattr(self.inner, name)
