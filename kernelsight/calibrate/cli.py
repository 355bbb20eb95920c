"""Argparse wiring for ``kernelsight calibrate {fit,eval,sweep}`` and ``kernelsight predict``.

The lead wires :func:`add_calibrate_parser` and :func:`add_predict_parser` into ``kernelsight/cli.py``;
each sets ``func`` on its parser to an ``args -> int`` handler.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from kernelsight.calibrate import evaluate as ev
from kernelsight.calibrate.measurements import (
    SWEEP_INFO_FILE,
    Table,
    describe_skipped,
    measurement_software,
    read_measurements,
    read_sweep_info,
    read_table,
    write_table,
)
from kernelsight.profiles import bundled_hardware_name, read_calibration_file
from kernelsight.simcore.calibration import Calibration
from kernelsight.simcore.hardware import HardwareSpec


def _estimate_sweep(args: argparse.Namespace, sweep: Any) -> int:
    from kernelsight.calibrate import sweep_shapes

    hw = _hardware(args.estimate)
    calib = resolve_calibration(hw)
    # the formats run_sweep would time on this GPU (its compute capability from the profile, not from torch)
    cc = tuple(int(x) for x in hw.compute_capability.split(".")) if hw.vendor == "nvidia" else (0,)
    grid = sweep_shapes.build_grid(
        gemm_dtypes=sweep_shapes.formats_for(hw.vendor, cc), num_gpus=args.num_gpus, points=args.points,
        seed=args.seed, windows=sweep_shapes.SWEEP_WINDOWS if args.windows else (0,),
        fp8_kv=args.windows and sweep_shapes.runs_fa3(hw.vendor, cc))
    seconds = sweep.estimate_seconds(grid, hw, calib)
    for fam, sec in seconds.items():
        print(f"{fam:<13} {len(getattr(grid, fam)):>6} points  {sec / 60:6.1f} min")
    print(f"{'total':<13} {sum(len(getattr(grid, f)) for f in seconds):>6} points  {sum(seconds.values()) / 60:6.1f} "
          f"min of GPU time on {hw.name} ({calib.tier} calibration; allocating each point's tensors adds a little)")
    return 0


def _hardware(name: str) -> HardwareSpec:
    from kernelsight.profiles import load_hardware

    return load_hardware(name)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _sweep_points(text: str) -> dict[str, int]:
    """``gemm=4000,attn_decode=3000`` → points per family (the families the sweep draws shapes for)."""
    from kernelsight.calibrate.sweep_shapes import SWEEP_POINTS

    out: dict[str, int] = {}
    for item in filter(None, text.split(",")):
        fam, sep, value = item.partition("=")
        if not sep or fam not in SWEEP_POINTS:
            raise argparse.ArgumentTypeError(f"expected FAMILY=N with FAMILY one of {', '.join(SWEEP_POINTS)}, "
                                             f"got {item!r}")
        out[fam] = _positive_int(value)
    return out


def _sweep_families(text: str) -> tuple[str, ...]:
    """``gemm,attn_decode`` → the families the sweep times (a misspelt one is an error, not a family skipped)."""
    from kernelsight.calibrate.sweep_shapes import SWEEP_FAMILIES

    out = tuple(filter(None, text.split(",")))
    unknown = [f for f in out if f not in SWEEP_FAMILIES]
    if unknown or not out:
        raise argparse.ArgumentTypeError(f"expected families among {', '.join(SWEEP_FAMILIES)}, got {text!r}")
    return out


def _add_workers(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--workers",
        type=_positive_int,
        default=ev.default_fit_workers(),
        help="worker processes fitting the kernel families in parallel (default: one per CPU, at most one per "
        "family; the calibration does not depend on it)",
    )


def add_calibrate_parser(subparsers: Any) -> argparse.ArgumentParser:
    from kernelsight.calibrate.sweep_shapes import KV_BLOCK_SIZE, SWEEP_FAMILIES

    p = subparsers.add_parser("calibrate", help="fit, evaluate or measure kernel calibrations")
    sub = p.add_subparsers(dest="calibrate_command", required=True)

    f = sub.add_parser("fit", help="fit a target-measured calibration from a measurement directory")
    f.add_argument("--measurements", required=True, help="directory (or file) in the measurement schema")
    f.add_argument(
        "--hardware", help="GPU name (kernelsight profiles) the data was measured on (default: the GPU a "
        "`calibrate sweep` directory names in its sweep.json, else the profile the directory is named for)"
    )
    f.add_argument("-o", "--output", required=True, help="calibration JSON to write")
    f.add_argument(
        "--no-residual-grid", action="store_true", help="smooth η form only (no per-shape lattice)"
    )
    f.add_argument(
        "--no-prior",
        action="store_true",
        help="do not fill in from the cross-generation tier (by default, kernel families and collective backends "
        "the measurements lack, and small variants it predicts better than their own fit, come from it)",
    )
    _add_workers(f)
    f.add_argument("--source", default="", help="provenance text recorded in the file")
    f.add_argument("--licence", default="", help="licence of the measurements, recorded in the file")
    f.set_defaults(func=cmd_fit)

    i = sub.add_parser("import-profile", help="fit a target-measured calibration from per-layer profiles (an "
                       "LLMServingSim profile bundle: meta.yaml, tpN/dense.csv, per_sequence.csv, attention.csv)")
    i.add_argument("directory", metavar="DIR", help="a bundle (the folder holding meta.yaml), or a folder above "
                   "several bundles of one GPU and one vLLM release (their rows are pooled)")
    i.add_argument("-o", "--output", required=True, help="calibration JSON to write")
    i.add_argument("--hardware", help="GPU profile (default: the bundle's meta.yaml gpu)")
    i.add_argument("--no-prior", action="store_true",
                   help="do not fill in from the GPU's cross-generation tier (by default what the profile does not "
                   "time — other formats, MoE, collectives — comes from it)")
    i.add_argument("--measurements-out", metavar="DIR",
                   help="also write the profile's GEMM and attention rows in the measurement schema here (for "
                   "`calibrate eval`)")
    _add_workers(i)
    i.add_argument("--licence", default="", help="licence of the profile, recorded in the file")
    i.set_defaults(func=cmd_import_profile)

    e = sub.add_parser("eval", help="MAPE per family for roofline / cross-generation / target tiers")
    e.add_argument("--measurements", required=True)
    e.add_argument("--hardware", help="GPU profile (default: the one a sweep directory's sweep.json names, else "
                   "the one the directory is named for)")
    e.add_argument(
        "--train-fraction",
        type=float,
        default=0.25,
        help="rows the target tier is fitted on; every tier is judged on the rest (default 0.25)",
    )
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--calibration", help="use this file as the target tier instead of fitting")
    _add_workers(e)
    e.add_argument("--json", help="also write the results as JSON here")
    e.set_defaults(func=cmd_eval)

    s = sub.add_parser("sweep", help="run the microbenchmark sweep on this machine's GPU (needs torch)")
    s.add_argument("-o", "--output", help="directory to write gemm/attn_*/comm CSVs into (required to run it)")
    s.add_argument("--device", default="cuda", help="torch device (default cuda; 'cpu' for a smoke run)")
    s.add_argument("--quick", action="store_true", help="tiny grid (smoke test, seconds)")
    s.add_argument("--families", type=_sweep_families, default=",".join(SWEEP_FAMILIES),
                   help="families to time, comma-separated (default: %(default)s)")
    s.add_argument("--points", type=_sweep_points, default={},
                   help="shapes drawn per family instead of the defaults (gemm=8000 per format, attn_prefill=6000, "
                   "attn_decode=6000), e.g. gemm=4000,attn_prefill=3000 for a shorter sweep on a slow GPU")
    s.add_argument("--seed", type=int, default=0, help="seed of the shape draw (default 0: the fixed sweep)")
    s.add_argument("--block-size", type=_positive_int, default=KV_BLOCK_SIZE,
                   help="tokens per KV-cache block of the paged cache vLLM's FlashAttention reads (default "
                   "%(default)s, vLLM's; pass the --block-size you serve with)")
    s.add_argument("--resume", action="store_true",
                   help="keep the rows a stopped sweep already wrote to -o (same GPU, draw and kernels) and time "
                   "only the rest")
    s.add_argument("--estimate", metavar="HARDWARE",
                   help="time nothing: print the points per family and the GPU minutes the sweep would take on this "
                   "GPU profile, predicted by its bundled calibration (no torch needed; -o is then ignored)")
    s.add_argument("--num-gpus", type=_positive_int, default=8, help="with --estimate: GPUs for the collectives")
    s.add_argument("--windows", action="store_true",
                   help="with --estimate: also the points a sweep with vLLM's FlashAttention importable times: "
                   "sliding windows, and on Hopper an fp8 KV cache")
    s.set_defaults(func=cmd_sweep)
    return p


def add_predict_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("predict", help="predict kernel latencies for rows of a measurement file")
    p.add_argument("--hardware", required=True)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--calibration", help="calibration JSON to use")
    g.add_argument(
        "--tier",
        choices=ev.TIERS,
        help="roofline | cross-generation (from bundled calibrations of other GPUs) | target "
        "(the bundled target-measured calibration of this GPU)",
    )
    p.add_argument("--input", required=True, help="file in the measurement schema (latency_us optional)")
    p.add_argument("-o", "--output", required=True,
                   help="CSV to write: the input rows plus predicted_us (- for standard output)")
    p.set_defaults(func=cmd_predict)
    return p


def resolve_calibration(
    hw: HardwareSpec, calibration: str | None = None, tier: str | None = None
) -> Calibration:
    """Calibration for predictions: a file, a tier, or by default the bundled one for the GPU."""
    if calibration:
        return read_calibration_file(calibration)
    if tier == "roofline":
        return ev.roofline_calibration(hw)
    if tier == "cross-generation":
        return ev.cross_generation_for(hw)
    bundled = {c.hardware: c for c in ev.bundled_calibrations(None)}
    c = bundled.get(hw.name)
    if tier == "target":
        if c is None or c.tier != "target-measured":
            raise SystemExit(
                f"no target-measured calibration bundled for {hw.name}; run `kernelsight calibrate "
                "sweep` and `calibrate fit`, then pass --calibration"
            )
        return c
    return c if c is not None else ev.cross_generation_for(hw)


def predict_file(
    input_path: str | Path, output_path: str | Path, hw: HardwareSpec, calib: Calibration
) -> int:
    """Library form of ``kernelsight predict``: writes the rows plus ``predicted_us`` (empty where nothing models
    the row: a collective outside all_reduce / all_gather / reduce_scatter / all_to_all); returns the row count."""
    return len(_predict_file(input_path, output_path, hw, calib)[0])


def _predict_file(input_path: str | Path, output_path: str | Path, hw: HardwareSpec, calib: Calibration
                  ) -> tuple[Table, np.ndarray]:
    table = read_table(input_path)
    pred_us = ev.predict_table_s(table, hw, calib) * 1e6
    write_table(table, output_path, {"predicted_us": pred_us})
    return table, pred_us


def cmd_predict(args: argparse.Namespace) -> int:
    hw = _hardware(args.hardware)
    calib = resolve_calibration(hw, args.calibration, args.tier)
    table, pred_us = _predict_file(args.input, args.output, hw, calib)
    empty = ~np.isfinite(pred_us)
    note = ""
    if empty.any():
        ops = sorted(set(table["op"][empty].tolist())) if "op" in table.columns else []
        note = f"; {int(empty.sum())} rows without a model" + (f" (op {', '.join(map(repr, ops))})" if ops else "")
        note += ": predicted_us left empty"
    where = "standard output" if args.output == "-" else args.output
    rows = f"{len(table)} row{'' if len(table) == 1 else 's'}"
    # with the rows on standard output, the summary goes to stderr so the CSV can be piped on
    print(f"wrote {rows} to {where} ({calib.tier} calibration of {calib.hardware}{note})",
          file=sys.stderr if args.output == "-" else sys.stdout)
    return 0


def _prior(hw: HardwareSpec) -> Calibration | None:
    """The GPU's cross-generation calibration from the bundled target-measured ones (None if none is usable)."""
    try:
        return ev.cross_generation_for(hw)
    except ValueError:
        return None


def measured_hardware(measurements: str | Path, hardware: str | None) -> tuple[HardwareSpec, str]:
    """The GPU profile measurements belong to, and a provenance line: ``hardware`` when given (with a warning on
    stderr if the sweep that wrote them ran on another GPU), else the GPU the sweep's ``sweep.json`` names, else
    the profile the directory is named for (the shared layout: ``kernels/h100_sxm``)."""
    info = read_sweep_info(measurements)   # None for a single file or a directory no sweep wrote
    ran_on = str(info.get("device_name", "")) if info else ""
    what = f"measurements {measurements}"
    if info:
        what = (f"kernelsight calibrate sweep on {ran_on} (torch {info.get('torch')}, attention "
                f"{info.get('attention')}, seed {info.get('seed')}) in {measurements}")
    if hardware:
        hw = _hardware(hardware)
        if ran_on and not ran_on.startswith("cpu") and bundled_hardware_name(ran_on) not in (None, hw.name):
            print(f"note: {measurements} was measured on {ran_on}, fitted here as {hw.name}", file=sys.stderr)
        return hw, what
    if not ran_on:   # a folder of the shared layout is named for its GPU (kernels/h100_sxm)
        folder = Path(measurements)
        name = bundled_hardware_name(folder.name) if folder.is_dir() else None
        if name is None:
            raise ValueError(f"--hardware is required: {measurements} has no {SWEEP_INFO_FILE} naming the GPU, "
                             "and its name is no GPU profile's")
        return _hardware(name), what
    name = bundled_hardware_name(ran_on)
    if name is None:
        raise ValueError(f"{measurements} was measured on {ran_on!r}, which no bundled GPU profile names: pass "
                         "--hardware NAME or a profile JSON")
    return _hardware(name), what


def _read_priceable(measurements: str | Path) -> dict[str, Table]:
    """The measurements minus rows of formats the model cannot price yet (e.g. NVFP4), one stderr line per
    format left out: a real GPU's set often holds them, and they should not stop the rest being fitted."""
    skipped: dict[str, int] = {}
    tables = read_measurements(measurements, skipped=skipped)
    for line in describe_skipped(skipped):
        print(f"note: {line}", file=sys.stderr)
    return tables


def cmd_fit(args: argparse.Namespace) -> int:
    hw, what = measured_hardware(args.measurements, args.hardware)
    t0 = time.perf_counter()
    tables = _read_priceable(args.measurements)
    calib, report = ev.fit_target(
        tables,
        hw,
        source=args.source or what,
        licence=args.licence,
        residual_grid=not args.no_residual_grid,
        workers=args.workers,
        prior=None if args.no_prior else _prior(hw),
    )
    calib.software = measurement_software(args.measurements)
    mla_lines = _fit_mla_families(args.measurements, hw, calib)
    Path(args.output).write_text(json.dumps(calib.to_dict()))
    _print_fit_report(report)
    for line in mla_lines:
        print(line)
    print(f"wrote {args.output} in {time.perf_counter() - t0:.1f} s")
    return 0


def _fit_mla_families(measurements: str | Path, hw: HardwareSpec, calib: Calibration) -> list[str]:
    """The MLA families (``mla_prefill``, ``mla_decode``) from the folder's ``mla_context`` / ``mla_generation``
    module tables, when it has them: each row is the module less its other kernels priced by ``calib`` (fitted just
    before), as ``build_calibrations.py --mla-only`` fits the bundled files. Report lines, one per family."""
    from kernelsight.calibrate.mla_tables import (
        MLA_TABLE_MODEL,
        add_mla_families,
        fit_mla_family,
        fit_rows,
        read_folder_rows,
    )
    from kernelsight.profiles import load_model

    folder = Path(measurements)
    if not folder.is_dir():
        return []
    rows = read_folder_rows(folder, load_model(MLA_TABLE_MODEL), hw, calib)
    fits = {fam: fit_mla_family(r, hw)[0] for fam, r in rows.items() if fit_rows(r).any()}
    add_mla_families(calib, fits)
    return [f"{fam:<22} rows {int(fit_rows(rows[fam]).sum()):>7}  MLA op (module tables less their other kernels)"
            for fam in fits]


def _print_fit_report(report: Any) -> None:
    for key, r in report.entries.items():
        if not r["rows"]:
            print(f"{key:<22} rows       0  not measured → cross-generation model")
            continue
        note = f"  → cross-generation model (MAPE {100 * r['prior_mape']:.1f}% on these rows)" \
            if r.get("uses_prior") else ""
        print(
            f"{key:<22} rows {int(r['rows']):>7}  train MAPE {100 * r['train_mape']:5.1f}%  "
            f"overhead {r['overhead_us']:.1f} µs{note}"
        )


def cmd_import_profile(args: argparse.Namespace) -> int:
    from kernelsight.calibrate.layer_profile import import_profiles

    t0 = time.perf_counter()
    result = import_profiles(args.directory, args.hardware, workers=args.workers, use_prior=not args.no_prior,
                             licence=args.licence)
    calib = result.calibration
    Path(args.output).write_text(json.dumps(calib.to_dict()))
    if args.measurements_out:
        out = Path(args.measurements_out)
        out.mkdir(parents=True, exist_ok=True)
        for fam, table in result.tables.items():
            write_table(table, out / f"{fam}.csv")
        (out / "SOURCE").write_text("".join(f"{k}: {v}\n" for k, v in calib.software.items())
                                    + f"source: {calib.source}\n", encoding="utf-8")
    for p in result.profiles:
        print(f"{p.path}: {p.meta.get('model')} {p.meta.get('variant', '')} on {p.hardware}, TP "
              f"{', '.join(map(str, p.tp_dirs))}, vLLM {p.vllm_version}")
    _print_fit_report(result.report)
    for fam, (eta, ovh_s) in sorted(result.elementwise.items()):
        cap = f" (capped at {calib.eta_max:.2f})" if eta > calib.eta_max else ""
        print(f"{fam:<22} η {eta:.2f} of DRAM bandwidth{cap}, fixed {ovh_s * 1e6:.1f} µs")
    for where, c in result.mixed_checks.items():
        if c.get("rows"):
            print(f"mixed prefill+decode attention ({where}): {c['rows']} rows, the step model prices them at"
                  f" {c['median_ratio']:.2f} of measured (median; p10 {c['p10_ratio']:.2f}, p90 "
                  f"{c['p90_ratio']:.2f}; MAPE {c['mape_pct']:.1f}%)")
    for where, regimes in result.skew_checks.items():
        for regime, c in regimes.items():
            print(f"unequal decode contexts, {regime} ({where}): {c['rows']} rows; alpha (0: priced as the mean "
                  f"length, 1: as the longest) measured {c['median_measured_alpha']:.2f}, step model "
                  f"{c['median_predicted_alpha']:.2f} (medians; median |difference| {c['median_abs_diff']:.2f})")
    print(f"wrote {args.output} ({calib.tier}, {calib.hardware}, vLLM {calib.software.get('vllm', '?')}) in "
          f"{time.perf_counter() - t0:.1f} s")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    hw, _ = measured_hardware(args.measurements, args.hardware)
    tables = _read_priceable(args.measurements)
    target = read_calibration_file(args.calibration) if args.calibration else None
    results = ev.evaluate_tiers(
        tables, hw, train_fraction=args.train_fraction, seed=args.seed, target_calibration=target,
        workers=args.workers,
    )
    held_out = f"{100 * (1 - args.train_fraction):.0f}% of rows"
    # a given calibration file may have been fitted on any of these rows (a bundled one saw all of them)
    judged = (f"judged on {held_out} (target tier: {args.calibration}, which may have seen them)" if args.calibration
              else f"judged on {held_out} the target fit did not see")
    print(f"MAPE on {hw.name} ({args.measurements}); {judged}; "
          f"small = roofline < {ev.SMALL_ROOFLINE_S * 1e6:.0f} µs (comm: < 1 MiB)")
    print(ev.format_results(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from kernelsight.calibrate import sweep
    from kernelsight.calibrate.sweep_timing import TorchUnavailableError

    if args.estimate:
        return _estimate_sweep(args, sweep)
    if not args.output:
        print("kernelsight calibrate sweep: -o/--output DIR is required (or --estimate HARDWARE)", file=sys.stderr)
        return 2
    try:
        paths = sweep.run_sweep(
            args.output, device=args.device, quick=args.quick, families=args.families,
            points=args.points, seed=args.seed, resume=args.resume, block_size=args.block_size,
            progress=lambda line: print(line, file=sys.stderr, flush=True),
        )
    except TorchUnavailableError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    for p in paths:
        print(f"wrote {p}")
    return 0
