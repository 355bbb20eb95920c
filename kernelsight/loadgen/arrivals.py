"""Request send schedule of ``vllm bench serve`` (spec §7.3), without ramp-up."""

from __future__ import annotations

import math

import numpy as np

__all__ = ["arrival_times_s"]


def arrival_times_s(
    num_requests: int, request_rate: float, burstiness: float = 1.0, seed: int = 0
) -> np.ndarray:
    """Send offsets (seconds from the benchmark start) for ``num_requests`` requests.

    * ``request_rate == inf``: everything is sent at once (all zeros).
    * Otherwise gaps ~ gamma(shape=burstiness, scale=1/(rate*burstiness)) (mean 1/rate; burstiness 1
      is Poisson, < 1 burstier, > 1 more regular). The first request waits its own gap, the gaps are
      accumulated, and the schedule is rescaled so the last send time is exactly
      ``num_requests / rate`` -- so the achieved mean rate equals the requested one for any seed.

    Deterministic for a ``seed`` (numpy ``default_rng``; vLLM uses the global numpy RNG, so the exact
    draws differ from vLLM's, but the distribution is the same).
    """
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if not request_rate > 0:  # also rejects NaN
        raise ValueError(f"request_rate must be > 0 (or inf), got {request_rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"burstiness must be a finite number > 0, got {burstiness}")
    if num_requests == 0:
        return np.zeros(0, dtype=np.float64)
    if math.isinf(request_rate):
        return np.zeros(num_requests, dtype=np.float64)

    rng = np.random.default_rng(seed)
    gaps_s = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests)
    times_s = np.cumsum(gaps_s)
    target_last_s = num_requests / request_rate
    last_s = times_s[-1]
    if last_s > 0:
        times_s = times_s * (target_last_s / last_s)
        times_s[-1] = target_last_s  # pin exactly: the product can be off by one ulp
    return times_s
