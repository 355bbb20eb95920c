"""Error bands: what reports quote beside the tier, and that the bundled bands are what the shared runs give."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from kernelsight.cli import main
from kernelsight.profiles.accuracy import describe_expected_error, expected_error, load_accuracy

ROOT = Path(__file__).resolve().parents[1]
ACC = {"run_bands_pct": {"cross-generation": {"runs": 2, "ttft": 25.8, "tpot": 8.4, "e2el": 12.4}},
       "kernel_mape_pct": {"cross-generation": {"gemm": 29.1, "attn_decode": 24.0}}}


def test_the_line_names_tier_runs_bands_and_kernel_mape():
    line = describe_expected_error("cross-generation", ACC)
    assert line == ("expected error (cross-generation tier, largest over 2 validated runs): TTFT ±25.8%, TPOT ±8.4%, "
                    "E2E ±12.4%; per kernel (MAPE) up to decode attention 24%, GEMM 29.1%")
    assert expected_error("target-measured", ACC) is None
    assert describe_expected_error("default", ACC) == \
        "expected error: the default tier has not been validated on a measured run"


def test_simulate_prints_the_band_of_its_tier_and_writes_it_to_the_result(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["simulate", "--num-prompts", "5", "--hardware", "h200", "--max-model-len", "2048",
                 "--result-json", str(out)]) == 0
    printed = capsys.readouterr().out
    band = expected_error("cross-generation")
    assert band is not None and describe_expected_error("cross-generation") in printed
    assert json.loads(out.read_text())["expected_error_pct"] == band


def _bands_script():
    spec = importlib.util.spec_from_file_location("accuracy_bands", ROOT / "benchmarks" / "accuracy_bands.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["accuracy_bands"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_the_bundled_run_bands_are_what_the_shared_runs_give_today(shared_data, tmp_path, monkeypatch):
    """A change to the step model that moves the shared runs must rebuild accuracy.json (the README table too)."""
    mod = _bands_script()
    monkeypatch.setattr(mod, "write_result", lambda name, payload: tmp_path / name)
    monkeypatch.setattr(mod, "ACCURACY_FILE", tmp_path / "accuracy.json")
    assert mod.main(["--e2e", str(shared_data / "e2e"), "--hardware",
                     "llmservingsim_rtxpro6000_llama31_8b=rtx-pro-6000", "--write"]) == 0
    captured = json.loads((tmp_path / "accuracy.json").read_text())
    assert captured["run_bands_pct"] == load_accuracy()["run_bands_pct"]
    assert {r["tier"] for r in captured["runs"]} == {"target-measured", "cross-generation"}
