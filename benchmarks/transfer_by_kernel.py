"""Cross-generation by kernel: does weighting the transfer sources that run the target's own kernels help?

Leave-one-GPU-out over the cross-generation sources (A100 / H100 / L40S, their bundled calibrations, fitted on all
their rows) and the RTX PRO 6000 (only ever held out): each held-out GPU's tables priced by its cross-generation
calibration with rule 5's similarity weights (×1), with the sources that run the same attention kernel and GEMM
generation (``simcore.attention_dispatch``) weighted ×2 and ×4, and with only those. Per-family MAPE over every row.
Prints a table and writes ``benchmarks/results/transfer_by_kernel.json``.

    python benchmarks/transfer_by_kernel.py [--data ../shared/data/kernels]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import SHARED_DATA, write_result  # noqa: E402

from kernelsight.calibrate.evaluate import CROSS_GENERATION_SOURCES, mape_table, measured_gpu_dirs  # noqa: E402
from kernelsight.calibrate.fit.transfer import cross_generation_calibration, similarity_weights  # noqa: E402
from kernelsight.calibrate.measurements import read_measurements  # noqa: E402
from kernelsight.loadgen.report import format_table  # noqa: E402
from kernelsight.profiles import load_calibration, load_hardware  # noqa: E402
from kernelsight.simcore.attention_dispatch import kernel_lineage  # noqa: E402

FACTORS = (1.0, 2.0, 4.0, float("inf"))   # inf: only the sources of the same kernels (all when none)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=SHARED_DATA / "kernels")
    args = ap.parse_args(argv)
    rows = []
    for folder, name in measured_gpu_dirs(args.data).items():
        target = load_hardware(name)
        tables = read_measurements(args.data / folder, skipped={})
        sources = [(load_calibration(s), load_hardware(s)) for s in CROSS_GENERATION_SOURCES if s != name]
        base = similarity_weights(target, [h for _, h in sources])
        same = [kernel_lineage(h) == kernel_lineage(target) for _, h in sources]
        for k in FACTORS:
            if k == float("inf"):
                raw = [w if s else 0.0 for w, s in zip(base, same, strict=True)] if any(same) else base
            else:
                raw = [w * (k if s else 1.0) for w, s in zip(base, same, strict=True)]
            weights = [w / sum(raw) for w in raw]
            calib = cross_generation_calibration(target, sources, source_weights=weights)
            mape = mape_table({f: t for f, t in tables.items() if f != "comm"}, target, calib)
            rows.append({"gpu": name, "same_kernel_weight": "only" if k == float("inf") else f"x{k:g}",
                         "sources": ", ".join(f"{h.name} {w:.2f}" for (_, h), w in zip(sources, weights, strict=True)),
                         **{f: round(100 * r["mape"], 1) for f, r in sorted(mape.items())}})
            print(rows[-1], flush=True)
    cols = ["gpu", "same_kernel_weight", "sources"] + sorted({k for r in rows for k in r} - {"gpu",
                                                             "same_kernel_weight", "sources"})
    print(format_table(rows, cols))
    print(f"wrote {write_result('transfer_by_kernel', {'rows': rows})}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
