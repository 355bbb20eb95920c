"""What a GPU-hour costs: a small bundled table of *example* prices, overridable by a JSON file.

The bundled numbers are examples to make the planner's output concrete, not quotes: typical on-demand prices per
GPU-hour that GPU clouds listed publicly in 2025 (single-GPU share of an 8-GPU instance where that is how it is
sold). They were written down on 2026-11-25 from the authors' notes of those public price pages (Lambda, RunPod,
CoreWeave list prices), without re-checking them; prices move by 2× between providers and months. Pass your own
with ``--prices FILE.json`` (``{"h100-sxm": 2.10, ...}``, USD per GPU-hour, keys are profile names or aliases).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PriceTable", "DEFAULT_PRICES_USD_PER_GPU_HOUR", "PRICES_AS_OF", "PRICES_SOURCE", "load_prices"]

PRICES_AS_OF = "2025 (examples written down 2026-11-25, not re-checked)"
PRICES_SOURCE = "public on-demand list prices of GPU clouds (Lambda, RunPod, CoreWeave), per GPU-hour"
DEFAULT_PRICES_USD_PER_GPU_HOUR: dict[str, float] = {
    "h100-sxm": 2.99,
    "h100-pcie": 2.49,
    "h200-sxm": 3.79,
    "a100-sxm": 1.79,
    "a100-pcie": 1.64,
    "l40s": 1.29,
    "l4": 0.80,
    "b200-sxm": 4.99,
    "mi300x": 2.49,
    "rtx-pro-6000": 1.79,
    "rtx-4090": 0.69,
}


@dataclass(frozen=True, slots=True)
class PriceTable:
    usd_per_gpu_hour: dict[str, float]
    as_of: str
    source: str

    def price(self, hardware: str) -> float | None:
        return self.usd_per_gpu_hour.get(hardware)


def load_prices(path: str | None, canonical: dict[str, str] | None = None) -> PriceTable:
    """The bundled table, with the entries of ``path`` (a JSON object of GPU → USD per GPU-hour) over it.

    ``canonical`` maps aliases to profile names so a user may write ``h100`` for ``h100-sxm``."""
    table = dict(DEFAULT_PRICES_USD_PER_GPU_HOUR)
    if path is None:
        return PriceTable(table, PRICES_AS_OF, PRICES_SOURCE)
    try:
        user = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"--prices {path}: no such file") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"--prices {path}: not JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(user, dict):
        raise ValueError(f"--prices {path}: expected an object of GPU name → USD per GPU-hour")
    for name, value in user.items():
        if not isinstance(value, int | float) or isinstance(value, bool) or not value >= 0:
            raise ValueError(f"--prices {path}: price of {name!r} must be a number ≥ 0, got {value!r}")
        table[(canonical or {}).get(name, name)] = float(value)
    return PriceTable(table, f"{path} over the bundled examples", f"user file {path}")
