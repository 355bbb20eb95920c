"""How far to trust a prediction: the error bands measured on validated runs, quoted beside the calibration tier.

``accuracy.json`` (bundled; rebuilt by ``benchmarks/accuracy_bands.py --write``) holds, per calibration tier, the
largest |error| of mean and median TTFT / TPOT / E2E over the measured runs replayed with that tier, and the largest
per-family kernel MAPE of ``benchmarks/kernel_accuracy.py``. A band from one or two runs is a floor, not a bound:
the line says how many runs it rests on.
"""

from __future__ import annotations

import functools
import json
from importlib import resources
from typing import Any

__all__ = ["load_accuracy", "expected_error", "describe_expected_error"]

_FAMILY_LABELS = {"gemm": "GEMM", "attn_prefill": "prefill attention", "attn_decode": "decode attention",
                  "attn_encoder": "ViT attention",
                  "comm": "collectives"}


@functools.cache
def load_accuracy() -> dict[str, Any]:
    """The bundled bands (empty when the file is absent)."""
    path = resources.files("kernelsight.profiles").joinpath("accuracy.json")
    if not path.is_file():
        return {}
    return json.loads(path.read_text())


def expected_error(tier: str, accuracy: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """``{"runs": n, "ttft": %, "tpot": %, "e2el": %, "kernel_mape_pct": {family: %}}`` for a tier, or None when no
    run was validated with it."""
    acc = load_accuracy() if accuracy is None else accuracy
    band = (acc.get("run_bands_pct") or {}).get(tier)
    if not band:
        return None
    return {**band, "kernel_mape_pct": (acc.get("kernel_mape_pct") or {}).get(tier, {})}


def describe_expected_error(tier: str, accuracy: dict[str, Any] | None = None) -> str:
    """One line for a report, e.g. ``expected error (cross-generation tier, largest over 2 validated runs): TTFT
    ±25.8%, TPOT ±8.4%, E2E ±12.4%; per kernel up to GEMM 29.1%, ...``."""
    e = expected_error(tier, accuracy)
    if e is None:
        return f"expected error: the {tier} tier has not been validated on a measured run"
    runs = f"{e['runs']} validated run" + ("s" if e["runs"] != 1 else "")
    line = (f"expected error ({tier} tier, largest over {runs}): TTFT ±{e['ttft']:g}%, TPOT ±{e['tpot']:g}%, "
            f"E2E ±{e['e2el']:g}%")
    if e["kernel_mape_pct"]:
        fams = [f"{_FAMILY_LABELS.get(f, f)} {v:g}%" for f, v in sorted(e["kernel_mape_pct"].items())]
        line += "; per kernel (MAPE) up to " + ", ".join(fams)
    return line
