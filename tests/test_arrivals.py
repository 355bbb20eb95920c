"""Tests for kernelsight.loadgen.arrivals (gamma arrivals rescaled to N/rate)."""

from __future__ import annotations

import numpy as np
import pytest

from kernelsight.loadgen.arrivals import arrival_times_s


def test_inf_rate_all_zeros():
    t = arrival_times_s(10, float("inf"))
    assert t.shape == (10,) and np.all(t == 0.0)


def test_last_send_time_is_exactly_n_over_rate():
    for n, rate, b, seed in [(100, 10.0, 1.0, 0), (7, 3.0, 0.25, 5), (1000, 2.5, 4.0, 9), (1, 0.5, 1.0, 1)]:
        t = arrival_times_s(n, rate, burstiness=b, seed=seed)
        assert t.shape == (n,)
        assert t[-1] == n / rate
        assert np.all(np.diff(t) >= 0)
        assert t[0] > 0  # the first request waits its own gap


def test_deterministic_for_seed():
    a = arrival_times_s(200, 5.0, burstiness=0.5, seed=3)
    b = arrival_times_s(200, 5.0, burstiness=0.5, seed=3)
    c = arrival_times_s(200, 5.0, burstiness=0.5, seed=4)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def _gap_cv(t: np.ndarray) -> float:
    gaps = np.diff(np.concatenate(([0.0], t)))
    return float(gaps.std() / gaps.mean())


def test_burstiness_controls_gap_variability():
    # Gamma(k) gaps have CV = 1/sqrt(k): 2.0 for k=0.25, 1.0 for Poisson, 0.5 for k=4.
    cv_bursty = _gap_cv(arrival_times_s(20000, 10.0, burstiness=0.25, seed=1))
    cv_poisson = _gap_cv(arrival_times_s(20000, 10.0, burstiness=1.0, seed=1))
    cv_regular = _gap_cv(arrival_times_s(20000, 10.0, burstiness=4.0, seed=1))
    assert cv_regular < cv_poisson < cv_bursty
    assert cv_regular == pytest.approx(0.5, rel=0.05)
    assert cv_poisson == pytest.approx(1.0, rel=0.05)
    assert cv_bursty == pytest.approx(2.0, rel=0.1)


def test_zero_requests():
    assert arrival_times_s(0, 1.0).shape == (0,)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(request_rate=0.0), "request_rate"),
        (dict(request_rate=-1.0), "request_rate"),
        (dict(request_rate=float("nan")), "request_rate"),
        (dict(burstiness=0.0), "burstiness"),
        (dict(burstiness=-2.0), "burstiness"),
        (dict(num_requests=-1), "num_requests"),
    ],
)
def test_validation(kwargs, match):
    args = dict(num_requests=5, request_rate=1.0, burstiness=1.0)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        arrival_times_s(**args)
