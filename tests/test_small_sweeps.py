"""Target-tier fits of small or partial sweeps: complexity chosen on held-out rows, and the cross-generation prior
standing in for what the sweep did not measure (or measured too thinly to beat it)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from kernelsight.calibrate.evaluate import cross_generation_for, predict_table_s
from kernelsight.calibrate.fit import eta as fit_eta
from kernelsight.calibrate.measurements import read_measurements
from kernelsight.profiles import load_hardware
from kernelsight.simcore.eta import LogPolyEta, SwitchEta, switch_key
from kernelsight.simcore.kernels import GEMM_FORMAT_CODES


@pytest.fixture(scope="module")
def l40s():
    return load_hardware("l40s")


@pytest.fixture(scope="module")
def l40s_tables(shared_data):
    return read_measurements(shared_data / "kernels" / "l40s")


@pytest.fixture(scope="module")
def prior(l40s):
    return cross_generation_for(l40s)   # from the bundled A100 / H100 calibrations: never the L40S's own data


def _split(table, n: int, seed: int):
    train = np.zeros(len(table), dtype=bool)
    train[np.random.default_rng(seed).choice(len(table), n, replace=False)] = True
    return table.subset(train), table.subset(~train)


def _mape(table, hw, calib) -> float:
    meas = table["latency_us"] * 1e-6
    return float(np.mean(np.abs(predict_table_s(table, hw, calib) / meas - 1.0)))


@pytest.mark.slow   # a whole calibration fit: run in CI's slow step
def test_a_small_sample_picks_a_simpler_model_that_misses_unseen_shapes_less(l40s, l40s_tables, monkeypatch):
    """100 decode rows cannot pin the full model (quadratic η in 8 log-features, boosted trees, lattice): it
    reproduces its rows and misses unseen shapes by up to 100×. Cross-validation picks a simpler one."""
    train, test = _split(l40s_tables["attn_decode"], 100, seed=0)
    chosen, report = fit_eta.fit_calibration({"attn_decode": train.columns}, l40s)
    assert all(np.isfinite(e.get("train_mape", np.nan)) for e in report.entries.values())
    monkeypatch.setattr(fit_eta, "SELECT_MAX_ROWS", 0)   # every sub-model gets the full complexity
    full, _ = fit_eta.fit_calibration({"attn_decode": train.columns}, l40s)
    assert _mape(test, l40s, chosen) < 0.7 * _mape(test, l40s, full)
    models = [m for v in chosen.eta["attn_decode"].models.values()
              for m in (v.models.values() if hasattr(v, "rule") else [v]) if isinstance(m, LogPolyEta)]
    assert models and all(m.grid is None for m in models)   # no lattice below SELECT_MAX_ROWS rows


def test_a_thin_variant_takes_the_prior_when_it_predicts_better(l40s, l40s_tables, prior):
    """30 decode rows: the fit cannot beat the cross-generation model on held-out rows, so the variant takes the
    prior's model; the calibration then misses unseen rows less than the fit alone and no more than the prior."""
    train, test = _split(l40s_tables["attn_decode"], 30, seed=0)
    alone, _ = fit_eta.fit_calibration({"attn_decode": train.columns}, l40s)
    with_prior, report = fit_eta.fit_calibration({"attn_decode": train.columns}, l40s, prior=prior)
    assert any(e.get("uses_prior") for e in report.entries.values())
    taken = [v for v, m in with_prior.eta["attn_decode"].models.items() if m is prior.eta["attn_decode"].models[v]]
    assert taken
    err = _mape(test, l40s, with_prior)
    assert err < _mape(test, l40s, alone) and err <= 1.05 * _mape(test, l40s, prior)


@pytest.mark.slow   # a whole calibration fit: run in CI's slow step
def test_a_large_variant_never_consults_the_prior(l40s, l40s_tables, prior):
    train, _ = _split(l40s_tables["attn_decode"], 3000, seed=1)
    calib, report = fit_eta.fit_calibration({"attn_decode": train.columns}, l40s, prior=prior)
    assert not any(e.get("uses_prior") or "prior_mape" in e for e in report.entries.values())
    assert all(m is not prior.eta["attn_decode"].models.get(v) for v, m in calib.eta["attn_decode"].models.items())


@pytest.mark.slow   # a whole calibration fit: run in CI's slow step
def test_unmeasured_families_and_backends_come_from_the_prior(l40s, l40s_tables, prior):
    """A GEMM-and-NCCL-only sweep: attention, the decode floor and vLLM's custom all-reduce are the prior's;
    without a prior they stay at the uncalibrated defaults, which miss the measured attention rows by more."""
    gemm, _ = _split(l40s_tables["gemm"], 600, seed=2)
    comm = l40s_tables["comm"]
    nccl = comm.subset(np.asarray(comm["backend"]) == "nccl")
    tables = {"gemm": gemm.columns, "comm": nccl.columns}
    calib, _ = fit_eta.fit_calibration(tables, l40s, prior=prior)
    bare, _ = fit_eta.fit_calibration(tables, l40s)
    for fam in ("attn_prefill", "attn_decode"):
        assert calib.eta[fam] is prior.eta[fam]
        assert calib.overhead_s[fam] == prior.overhead_s[fam]
        rows = l40s_tables[fam].subset(np.arange(0, len(l40s_tables[fam]), 50))
        # the prior's own numbers under the prior's calibration-wide η cap (the calibration's may be higher: it
        # also caps the fitted GEMMs)
        same_cap = replace(calib, eta_max=prior.eta_max)
        np.testing.assert_allclose(predict_table_s(rows, l40s, same_cap), predict_table_s(rows, l40s, prior),
                                   rtol=1e-9)
        assert _mape(rows, l40s, calib) < 0.75 * _mape(rows, l40s, bare)
    assert calib.decode_cta_bytes_per_s == prior.decode_cta_bytes_per_s
    assert isinstance(calib.eta["gemm"], SwitchEta) and calib.eta["gemm"] is not prior.eta["gemm"]
    assert calib.eta["lm_head"] is not prior.eta["lm_head"]   # follows the measured GEMM family
    assert calib.comm["custom"] is prior.comm["custom"] and calib.comm["nccl"] is not prior.comm["nccl"]


def test_unmeasured_variants_within_a_measured_family_come_from_the_prior(l40s, l40s_tables, prior):
    """A sweep that timed bf16 and fp8 GEMMs but not vLLM's block-scaled fp8 kernel: the fp8_block format is the
    prior's model (built for it), not the GPU's own fp8 model, and misses the measured fp8_block rows by less."""
    gemm = l40s_tables["gemm"]
    fmt = np.asarray(gemm["dtype"])
    train, _ = _split(gemm.subset(fmt != "fp8_block"), 3000, seed=3)
    calib, report = fit_eta.fit_calibration({"gemm": train.columns}, l40s, prior=prior)
    bare, _ = fit_eta.fit_calibration({"gemm": train.columns}, l40s)
    block = switch_key(GEMM_FORMAT_CODES["fp8_block"])
    assert calib.eta["gemm"].models[block] is prior.eta["gemm"].models[block]
    assert block not in bare.eta["gemm"].models   # without a prior the switch falls back to a measured format
    assert report.entries[f"gemm[{block}]"] == {"rows": 0.0, "train_mape": pytest.approx(np.nan, nan_ok=True),
                                                "overhead_us": pytest.approx(np.nan, nan_ok=True), "uses_prior": 1.0}
    rows = gemm.subset(np.flatnonzero(fmt == "fp8_block")[::20])
    assert _mape(rows, l40s, calib) < 0.95 * _mape(rows, l40s, bare)
    # the measured formats are the sweep's own fits
    for key in (switch_key(GEMM_FORMAT_CODES["bf16"]), switch_key(GEMM_FORMAT_CODES["fp8"])):
        assert calib.eta["gemm"].models[key] is not prior.eta["gemm"].models[key]
