"""Regenerate the bundled calibrations in ``kernelsight/profiles/calibration/`` from ``../shared/data``.

* target-measured: a100-sxm, h100-sxm, l40s — fitted on every row of their shared kernel measurements.
* cross-generation: every other bundled GPU — transferred from those three (``CROSS_GENERATION_SOURCES``) by the
  spec-driven rule (:mod:`kernelsight.calibrate.fit.transfer`).
* target-measured from a GPU's own tables on top of its cross-generation prior: rtx-pro-6000
  (``rtx_pro_6000_server``), as ``kernelsight calibrate fit`` does, NVFP4 GEMM rows included; rows of formats the
  model cannot price yet would be left out and counted in the file's notes.
* the same GPU timed under another vLLM release (a folder ``<GPU folder>@vllm-<version>``, e.g. the RTX PRO 6000
  under vLLM 0.19.0): fitted as its plain folder is, into ``<gpu>@vllm-<version>.json`` (a calibration belongs to a GPU
  and a software stack; ``--vllm-version`` picks it).
* target-measured from per-layer profiles (``--layers``, default ``../shared/data/layers``: LLMServingSim profile
  bundles, one folder per GPU) for a GPU with no kernel tables, as ``kernelsight calibrate import-profile`` does (the
  RTX 4090); a GPU with kernel tables keeps those (its profile is a check, not a source).
* the cross-generation files of GPUs with FP4 tensor cores (B200, B300, GB200, GB300) get their NVFP4 GEMM η from
  the RTX PRO 6000's fit (``FP4_TRANSFER_SOURCES``, rule 9 of :mod:`kernelsight.calibrate.fit.transfer`).

Each file records its tier, source data and licence. The shipped package reads only these JSON files.

    python benchmarks/build_calibrations.py [--data ../shared/data/kernels] [--only GPU ...] [--comm-only]
        [--fp4-only] [--moe-only] [--software-only] [--layers DIR] [--layers-only] [--encoder-only] [--mla-only]

``--moe-only`` refits only the FusedMoE family (``moe_gemm``: one η model per expert format, per vLLM kernel where
several ran) of every measured GPU (and of every other software stack of one) on all its MoE rows (``moe.csv.gz``) and
transfers it to every other file from the cross-generation sources' fits, as a full build does; everything else
stays as stored.

``--fp4-only`` refits only the NVFP4 GEMM variant of the FP4-measured GPUs (the RTX PRO 6000: on all its NVFP4 rows,
as a full build does — a fit's variants are fitted independently of each other) into their bundled files, then adds
the transferred variant to the bundled cross-generation files; everything else stays as stored.

``--encoder-only`` fits only the ViT attention family (``attn_encoder``) of the GPUs whose folders time it (H100, L40S,
the RTX PRO 6000 under 0.24) into their bundled files and transfers it to every other file (from the cross-generation
sources that have it), as a full build would; everything else stays as stored.

``--mla-only`` fits only the MLA families (``mla_prefill``, ``mla_decode``: vLLM's MLA attention op) of every file
whose folder times DeepSeek-V3's MLA module (``mla_context`` / ``mla_generation``, scope ``module``: H100, L40S, both
RTX PRO 6000 stacks) on the serving rows, less the module's other kernels priced by that file's calibration
(``calibrate.mla_tables``), and transfers them by kernel to every other file (``transfer.mla_sources``); a full build
ends with the same pass. Everything else stays as stored.

``--comm-only`` rewrites only the collective models of every bundled file (what a full build would write there:
the comm fit reads nothing but the comm table and, for a GPU fitted on a prior, the prior's collective models) and
keeps everything else as stored — seconds instead of minutes, and a diff that shows only what changed.
``--software-only`` likewise rewrites only each file's ``software`` record (the versions its kernels were timed
under: a measured GPU's from its folder's SOURCE file, a cross-generation file's merged from its sources').
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kernelsight.calibrate.evaluate import (  # noqa: E402
    CROSS_GENERATION_SOURCES,
    SHARED_DATA_LICENCE,
    SHARED_LAYERS_LICENCE,
    bundled_calibration_dir,
    default_fit_workers,
    fit_target,
    measured_gpu_dirs,
    other_stack_dirs,
)
from kernelsight.calibrate.fit.comm import fit_comm  # noqa: E402
from kernelsight.calibrate.fit.eta import family_overheads, fit_family  # noqa: E402
from kernelsight.calibrate.fit.transfer import (  # noqa: E402
    FP4_TRANSFER_SOURCES,
    NVFP4_KEY,
    cross_generation_calibration,
    merged_software,
    mla_source_names,
    transfer_comm,
    transfer_fp4_variant,
)
from kernelsight.calibrate.layer_profile import BUNDLE_FORMAT as BUNDLE_PREFIX  # noqa: E402
from kernelsight.calibrate.measurements import (  # noqa: E402
    describe_skipped,
    measurement_software,
    read_measurements,
    read_table,
)
from kernelsight.calibrate.mla_tables import (  # noqa: E402
    MLA_TABLE_MODEL,
    add_mla_families,
    fit_mla_family,
    fit_rows,
    read_folder_rows,
)
from kernelsight.calibrate.rows import MLA_FAMILIES  # noqa: E402
from kernelsight.profiles import (  # noqa: E402
    calibration_file_name,
    list_hardware,
    load_hardware,
    load_model,
    read_calibration_file,
)
from kernelsight.simcore.calibration import Calibration, default_calibration  # noqa: E402
from kernelsight.simcore.eta import SwitchEta  # noqa: E402
from kernelsight.simcore.hardware import HardwareSpec  # noqa: E402

_TARGET_NOTES = (
    "target-measured tier: η per family/variant (and per vLLM kernel where several ran, picked by a "
    "dispatch rule learned from the shapes) = bounded sigmoid of a quadratic in "
    "spec-normalized log shape features, corrected by boosted residual trees (raw shape axes and "
    "launch-grid work counts) and a residual lattice (raw shape axes); fitted by kernelsight "
    "benchmarks/build_calibrations.py"
)


def _source_line(data_dir: Path) -> str:
    src = (
        (data_dir / "SOURCE").read_text().strip().replace("\n", "; ")
        if (data_dir / "SOURCE").exists()
        else ""
    )
    return f"kernel measurements shared/data/kernels/{data_dir.name} ({src})"


def _fit_own_tables(name: str, folder: Path, sources: list[tuple[Calibration, HardwareSpec]]) -> Calibration:
    """Target-measured fit of one GPU on its own tables, on its cross-generation calibration as prior (fills in
    what the tables do not measure); rows of unmodelled formats are left out and the count recorded."""
    hw = load_hardware(name)
    skipped: dict[str, int] = {}
    tables = read_measurements(folder, skipped=skipped)
    prior = cross_generation_calibration(hw, sources)
    left_out = describe_skipped(skipped)
    source = _source_line(folder)
    if skipped:
        counts = ", ".join(f"{n} {key}" for key, n in sorted(skipped.items()))
        source += f"; {sum(skipped.values())} rows left out ({counts}: format not modelled yet)"
    calib, _ = fit_target(tables, hw, source=source, licence=SHARED_DATA_LICENCE,
                          workers=default_fit_workers(), prior=prior)
    calib.notes = (
        _TARGET_NOTES + f", on the cross-generation tier from {', '.join(c.hardware for c, _ in sources)} as prior"
        + "".join(f"; {line}" for line in left_out)
    )
    calib.software = measurement_software(folder)
    for line in left_out:
        print(f"{name}: {line}")
    return calib


def _rebuild_comm(data: Path, out_dir: Path) -> int:
    """Collective models of every bundled file, as a full build writes them; the rest of each file unchanged."""
    all_measured = {name: folder for folder, name in measured_gpu_dirs(data).items()}
    measured: list[tuple[Calibration, HardwareSpec]] = []

    def rewrite(name: str, comm: dict, keep_unmeasured: dict | None = None, file: str | None = None) -> Calibration:
        file = file or calibration_file_name(name)
        calib = read_calibration_file(out_dir / file)
        calib.comm = {**default_calibration(name).comm, **comm}   # a fit or transfer starts from the defaults
        for backend, model in (keep_unmeasured or {}).items():   # as fit_calibration's prior fill does
            if backend not in comm:
                calib.comm[backend] = model
        (out_dir / file).write_text(json.dumps(calib.to_dict()))
        print(f"{file}: collective models rewritten ({', '.join(sorted(calib.comm))})")
        return calib

    for name in CROSS_GENERATION_SOURCES:
        hw = load_hardware(name)
        table = read_table(data / all_measured[name] / "comm.csv.gz", "comm")
        measured.append((rewrite(name, fit_comm(table.columns, hw)), hw))
    for name, folder in all_measured.items():
        if name in CROSS_GENERATION_SOURCES:
            continue
        hw = load_hardware(name)
        prior = {**default_calibration(name).comm, **transfer_comm(measured, hw)}   # the cross-generation tier's
        table = read_table(data / folder / "comm.csv.gz", "comm")
        rewrite(name, fit_comm(table.columns, hw, prior), prior)
    for folder, (name, version) in other_stack_dirs(data).items():
        prior = {**default_calibration(name).comm, **transfer_comm(measured, load_hardware(name))}
        table = read_table(data / folder / "comm.csv.gz", "comm")
        rewrite(name, fit_comm(table.columns, load_hardware(name), prior), prior, calibration_file_name(name, version))
    for name in list_hardware():
        if name not in all_measured:
            rewrite(name, transfer_comm(measured, load_hardware(name)))
    return 0


def _refit_nvfp4(name: str, folder: Path, path: Path) -> Calibration:
    """The bundled file of an FP4-measured GPU with its ``nvfp4`` GEMM variant fitted on every NVFP4 row."""
    hw = load_hardware(name)
    calib = read_calibration_file(path)
    table = read_table(folder / "gemm.csv.gz", "gemm")
    rows = table.subset(table["dtype"] == "nvfp4")
    model, eta_max, _ = fit_family("gemm", rows.columns, hw, residual_grid=True)
    gemm = calib.eta["gemm"]
    assert isinstance(gemm, SwitchEta) and isinstance(model, SwitchEta)
    calib.eta["gemm"] = SwitchEta(gemm.index, {**gemm.models, NVFP4_KEY: model.models[NVFP4_KEY]}, gemm.default)
    calib.eta_max = max(calib.eta_max, eta_max)
    calib.source = _source_line(folder)
    calib.notes = calib.notes.split("; skipped ")[0]   # no rows are left out any more
    path.write_text(json.dumps(calib.to_dict()))
    print(f"{name}: nvfp4 GEMM variant fitted on {len(rows)} rows")
    return calib


def _add_fp4_variants(data: Path, out_dir: Path) -> int:
    """The NVFP4 GEMM variant of the FP4-measured GPUs' bundled files (refitted) and of every bundled
    cross-generation file (transferred from them); the rest of each file unchanged."""
    folders = {name: folder for folder, name in measured_gpu_dirs(data).items()}
    fp4 = [(_refit_nvfp4(n, data / folders[n], out_dir / f"{n}.json"), load_hardware(n)) for n in FP4_TRANSFER_SOURCES]
    for folder, (name, version) in other_stack_dirs(data).items():   # the same GPU's other stacks: their own rows
        if name in FP4_TRANSFER_SOURCES:
            _refit_nvfp4(name, data / folder, out_dir / calibration_file_name(name, version))
    for name in list_hardware():
        path = out_dir / f"{name}.json"
        calib = read_calibration_file(path)
        if calib.tier != "cross-generation":
            continue
        if transfer_fp4_variant(calib, load_hardware(name), fp4):
            path.write_text(json.dumps(calib.to_dict()))
            print(f"{name}: nvfp4 GEMM variant added")
    return 0


def _rewrite_software(data: Path, out_dir: Path) -> int:
    """The ``software`` record of every bundled file, as a full build writes it (a measured GPU's from its folder's
    SOURCE file; a cross-generation file's merged from its sources', the FP4 source's too where its NVFP4 variant
    came from there); the rest of each file unchanged."""
    measured = {name: folder for folder, name in measured_gpu_dirs(data).items()}
    software = {name: measurement_software(data / folder) for name, folder in measured.items()}
    sources = [software[n] for n in CROSS_GENERATION_SOURCES]
    fp4 = [{k: v for k, v in software[n].items() if k != "nccl"} for n in FP4_TRANSFER_SOURCES]   # GEMMs only
    for name in list_hardware():
        path = out_dir / f"{name}.json"
        calib = read_calibration_file(path)
        if name in measured:
            calib.software = software[name]
        else:
            gemm = calib.eta.get("gemm")
            transferred_fp4 = isinstance(gemm, SwitchEta) and NVFP4_KEY in gemm.models and any(
                h.name != name for h in map(load_hardware, FP4_TRANSFER_SOURCES))
            calib.software = merged_software(sources + (fp4 if transferred_fp4 else []))
        path.write_text(json.dumps(calib.to_dict()))
        print(f"{name}: software {calib.software}")
    for folder, (name, version) in other_stack_dirs(data).items():
        path = out_dir / calibration_file_name(name, version)
        calib = read_calibration_file(path)
        calib.software = measurement_software(data / folder)
        path.write_text(json.dumps(calib.to_dict()))
        print(f"{path.name}: software {calib.software}")
    return 0


def _fill_family_by_transfer(family: str, calib: Calibration, hw: HardwareSpec,
                             sources: list[tuple[Calibration, HardwareSpec]]) -> bool:
    """Give ``calib`` the ``family`` it lacks, transferred from the sources that have it (rules 1–5); False if none
    has it. A measured GPU whose tables lack a family (the A100 times no ViT attention) gets it this way."""
    having = [(c, h) for c, h in sources if family in c.eta and h.name != hw.name]
    if family in calib.eta or not having:
        return False
    x = cross_generation_calibration(hw, having)
    calib.eta[family] = x.eta[family]
    calib.overhead_s[family] = x.overhead_s[family]
    return True


def _add_encoder(data: Path, out_dir: Path) -> int:
    """The ViT attention family (``attn_encoder``) of every bundled file: fitted on the GPU's own ``attn_encoder``
    table where its folder has one (all rows, as a full build fits), else transferred from the cross-generation
    sources that have it; the rest of each file unchanged."""
    folders = {calibration_file_name(n): data / f for f, n in measured_gpu_dirs(data).items()}
    folders.update({calibration_file_name(n, v): data / f for f, (n, v) in other_stack_dirs(data).items()})
    calibs = {p.name: read_calibration_file(p) for p in sorted(out_dir.glob("*.json"))}
    for file, folder in folders.items():
        table = folder / "attn_encoder.csv.gz"
        if file not in calibs or not table.is_file():
            continue
        calib, hw = calibs[file], load_hardware(calibs[file].hardware)
        model, eta_max, _ = fit_family("attn_encoder", read_table(table, "attn_encoder").columns, hw,
                                       residual_grid=True)
        calib.eta["attn_encoder"] = model
        calib.eta_max = max(calib.eta_max, eta_max)
        calib.overhead_s["attn_encoder"] = family_overheads(calib)["attn_encoder"]
        print(f"{file}: attn_encoder fitted on {folder.name}")
    sources = [(calibs[calibration_file_name(n)], load_hardware(n)) for n in CROSS_GENERATION_SOURCES]
    for file, calib in calibs.items():
        if _fill_family_by_transfer("attn_encoder", calib, load_hardware(calib.hardware), sources):
            print(f"{file}: attn_encoder transferred")
        (out_dir / file).write_text(json.dumps(calib.to_dict()))
    return 0


def _profiled_gpus(layers: Path, measured: set[str]) -> dict[str, Path]:
    """GPU profile name → its folder of layer-profile bundles, for the GPUs without kernel tables."""
    from kernelsight.calibrate.layer_profile import find_bundles, read_profile

    out: dict[str, Path] = {}
    for folder in sorted(d for d in layers.iterdir() if d.is_dir()) if layers.is_dir() else []:
        bundles = find_bundles(folder)
        if bundles:
            name = read_profile(bundles[0]).hardware
            if name not in measured:
                out[name] = folder
    return out


def _import_layers(name: str, folder: Path, out_dir: Path) -> Calibration:
    from kernelsight.calibrate.layer_profile import import_profiles

    t0 = time.perf_counter()
    calib = import_profiles(folder, name, workers=default_fit_workers(), licence=SHARED_LAYERS_LICENCE).calibration
    calib.source = calib.source.replace(f"{BUNDLE_PREFIX}: ", f"{BUNDLE_PREFIX}: shared/data/layers/")
    (out_dir / calibration_file_name(name)).write_text(json.dumps(calib.to_dict()))
    print(f"{name}: target-measured from the layer profiles in {folder} in {time.perf_counter() - t0:.1f} s")
    return calib


def _rebuild_moe(data: Path, out_dir: Path) -> int:
    """The FusedMoE family (``moe_gemm``) of every bundled file, as a full build writes it: a measured GPU's (and each
    of its other software stacks') fitted on all its MoE rows, every other file's transferred from the
    cross-generation sources' fits; the rest of each file unchanged."""
    folders = {calibration_file_name(n): (n, data / f) for f, n in measured_gpu_dirs(data).items()}
    folders.update({calibration_file_name(n, v): (n, data / f) for f, (n, v) in other_stack_dirs(data).items()})
    sources: list[tuple[Calibration, HardwareSpec]] = []
    fitted: set[str] = set()
    for file, (name, folder) in folders.items():
        path = out_dir / file
        if not (folder / "moe.csv.gz").is_file() or not path.is_file():
            continue
        calib, hw = read_calibration_file(path), load_hardware(name)
        t0 = time.perf_counter()
        table = read_measurements(folder)["moe_gemm"]   # token scope as the folder's release timed it
        model, eta_max, _ = fit_family("moe_gemm", table.columns, hw, residual_grid=True)
        calib.eta["moe_gemm"] = model
        calib.overhead_s.update({k: v for k, v in family_overheads(calib).items() if k == "moe_gemm"})
        calib.eta_max = max(calib.eta_max, eta_max)
        path.write_text(json.dumps(calib.to_dict()))
        fitted.add(file)
        print(f"{file}: moe_gemm fitted on {len(table)} rows in {time.perf_counter() - t0:.0f} s")
        if name in CROSS_GENERATION_SOURCES and file == calibration_file_name(name):
            sources.append((calib, hw))
    for path in sorted(out_dir.glob("*.json")):
        if path.name in fitted:
            continue
        calib = read_calibration_file(path)
        hw = load_hardware(calib.hardware)
        moved = cross_generation_calibration(hw, sources)
        calib.eta["moe_gemm"] = moved.eta["moe_gemm"]
        calib.overhead_s["moe_gemm"] = moved.overhead_s["moe_gemm"]
        calib.eta_max = max(calib.eta_max, moved.eta_max)
        path.write_text(json.dumps(calib.to_dict()))
        print(f"{path.name}: moe_gemm transferred")
    return 0


def _rebuild_mla(data: Path, out_dir: Path) -> int:
    """The MLA families (``mla_prefill``, ``mla_decode``) of every bundled file: fitted on the serving rows of the
    folder's own MLA module tables where it has module rows (``calibrate.mla_tables``: the module less its other
    kernels, priced by the file's own calibration), else transferred by kernel (``transfer.mla_sources``) from the
    0.24 fits of the GPUs that have them, or left out (the composed pricing stays) where no measured GPU runs the
    kernel; the rest of each file unchanged. ``eta_max`` stays as stored (the MLA families are never priced below
    their roofline)."""
    model = load_model(MLA_TABLE_MODEL)
    folders = {calibration_file_name(n): (n, data / f) for f, n in measured_gpu_dirs(data).items()}
    folders.update({calibration_file_name(n, v): (n, data / f) for f, (n, v) in other_stack_dirs(data).items()})
    sources: list[tuple[Calibration, HardwareSpec]] = []
    fitted: set[str] = set()
    for file, (name, folder) in sorted(folders.items()):
        path = out_dir / file
        if not path.is_file():
            continue
        calib, hw = read_calibration_file(path), load_hardware(name)
        for fam in MLA_FAMILIES:   # the neighbours are priced without them; a refit starts from nothing
            calib.eta.pop(fam, None)
            calib.overhead_s.pop(fam, None)
        rows = read_folder_rows(folder, model, hw, calib)
        if not rows:
            continue
        t0 = time.perf_counter()
        fits = {fam: fit_mla_family(r, hw)[0] for fam, r in rows.items()}
        add_mla_families(calib, fits)
        path.write_text(json.dumps(calib.to_dict()))
        fitted.add(file)
        counts = ", ".join(f"{fam} {int(fit_rows(r).sum())} rows" for fam, r in rows.items())
        print(f"{file}: {counts} fitted in {time.perf_counter() - t0:.0f} s")
        if file == calibration_file_name(name):
            sources.append((calib, hw))
    for path in sorted(out_dir.glob("*.json")):
        if path.name in fitted:
            continue
        calib = read_calibration_file(path)
        hw = load_hardware(calib.hardware)
        moved = cross_generation_calibration(hw, sources)
        got = []
        for fam in MLA_FAMILIES:
            calib.eta.pop(fam, None)
            calib.overhead_s.pop(fam, None)
            if fam in moved.eta:
                calib.eta[fam] = moved.eta[fam]
                calib.overhead_s[fam] = moved.overhead_s[fam]
                got.append(f"{fam} from {', '.join(mla_source_names(hw, [h for _, h in sources], fam))}")
        path.write_text(json.dumps(calib.to_dict()))
        print(f"{path.name}: {'; '.join(got) or 'no MLA source runs its kernels: composed pricing'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data" / "kernels")
    ap.add_argument("-o", "--output-dir", type=Path, default=bundled_calibration_dir())
    ap.add_argument("--only", action="append", metavar="GPU", default=None,
                    help="write only this bundled GPU's file (repeatable); the cross-generation sources are then "
                         "read from the bundled files instead of refitted")
    ap.add_argument("--comm-only", action="store_true",
                    help="refit only the collective models of the bundled files and keep the rest as stored")
    ap.add_argument("--fp4-only", action="store_true",
                    help="add only the transferred NVFP4 GEMM variant to the bundled cross-generation files")
    ap.add_argument("--moe-only", action="store_true",
                    help="refit only the FusedMoE family (moe_gemm) of the bundled files and keep the rest as stored")
    ap.add_argument("--layers", type=Path, default=ROOT.parent / "shared" / "data" / "layers",
                    help="per-layer profile bundles, one folder per GPU (a GPU without kernel tables is fitted "
                         "from its profile)")
    ap.add_argument("--mla-only", action="store_true",
                    help="fit (or transfer) only the MLA families (mla_prefill, mla_decode) into the bundled files")
    ap.add_argument("--encoder-only", action="store_true",
                    help="fit (or transfer) only the ViT attention family (attn_encoder) into the bundled files")
    ap.add_argument("--layers-only", action="store_true",
                    help="write only the files of the GPUs fitted from layer profiles")
    ap.add_argument("--software-only", action="store_true",
                    help="rewrite only the record of the software each bundled file's kernels were timed under")
    args = ap.parse_args(argv)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    if args.software_only:
        return _rewrite_software(args.data, args.output_dir)
    if args.comm_only:
        return _rebuild_comm(args.data, args.output_dir)
    if args.fp4_only:
        return _add_fp4_variants(args.data, args.output_dir)
    if args.moe_only:
        return _rebuild_moe(args.data, args.output_dir)
    if args.encoder_only:
        return _add_encoder(args.data, args.output_dir)
    if args.mla_only:
        return _rebuild_mla(args.data, args.output_dir)
    profiled = _profiled_gpus(args.layers, set(measured_gpu_dirs(args.data).values()))
    if args.layers_only:
        for name, folder in profiled.items():
            _import_layers(name, folder, args.output_dir)
        return 0
    only = None if args.only is None else {load_hardware(g).name for g in args.only}

    # every GPU folder of the schema whose name is a bundled profile: the cross-generation sources (A100, H100,
    # L40S) are fitted alone; the rest (RTX PRO 6000) on their cross-generation prior from those sources
    all_measured = {name: folder for folder, name in measured_gpu_dirs(args.data).items()}
    by_profile = {n: f for n, f in all_measured.items() if n in CROSS_GENERATION_SOURCES}
    on_prior = {n: f for n, f in all_measured.items() if n not in CROSS_GENERATION_SOURCES}
    missing = set(CROSS_GENERATION_SOURCES) - set(by_profile)
    if missing:
        raise SystemExit(f"{args.data}: no tables of the cross-generation sources {sorted(missing)}")
    measured: list[tuple[Calibration, HardwareSpec]] = []
    for name, folder in by_profile.items():
        hw = load_hardware(name)
        if only is not None and name not in only:   # the bundled file stands in for the fit it was written from
            measured.append((read_calibration_file(args.output_dir / f"{name}.json"), hw))
            continue
        t0 = time.perf_counter()
        tables = read_measurements(args.data / folder)
        calib, _ = fit_target(
            tables, hw, source=_source_line(args.data / folder), licence=SHARED_DATA_LICENCE,
            workers=default_fit_workers(),   # as `kernelsight calibrate fit` does: the same file
        )
        calib.notes = _TARGET_NOTES
        calib.software = measurement_software(args.data / folder)
        (args.output_dir / f"{name}.json").write_text(json.dumps(calib.to_dict()))
        measured.append((calib, hw))
        print(f"{name}: target-measured from {folder} in {time.perf_counter() - t0:.1f} s")
    for calib, hw in measured:   # a source whose tables lack a family the others time (the A100: ViT attention)
        if (only is None or hw.name in only) and _fill_family_by_transfer("attn_encoder", calib, hw, measured):
            (args.output_dir / calibration_file_name(hw.name)).write_text(json.dumps(calib.to_dict()))
    fp4: list[tuple[Calibration, HardwareSpec]] = []
    for name, folder in on_prior.items():
        if only is not None and name not in only:
            if name in FP4_TRANSFER_SOURCES:
                fp4.append((read_calibration_file(args.output_dir / f"{name}.json"), load_hardware(name)))
            continue
        t0 = time.perf_counter()
        calib = _fit_own_tables(name, args.data / folder, measured)
        (args.output_dir / f"{name}.json").write_text(json.dumps(calib.to_dict()))
        if name in FP4_TRANSFER_SOURCES:
            fp4.append((calib, load_hardware(name)))
        print(f"{name}: target-measured from {folder} in {time.perf_counter() - t0:.1f} s")
    for folder, (name, version) in other_stack_dirs(args.data).items():   # the same GPU under another vLLM release
        if only is not None and name not in only:
            continue
        t0 = time.perf_counter()
        calib = _fit_own_tables(name, args.data / folder, measured)
        (args.output_dir / calibration_file_name(name, version)).write_text(json.dumps(calib.to_dict()))
        print(f"{name}: target-measured under vLLM {version} from {folder} in {time.perf_counter() - t0:.1f} s")
    for name, folder in profiled.items():
        if only is None or name in only:
            _import_layers(name, folder, args.output_dir)
    for name in list_hardware():
        if name in all_measured or name in profiled or (only is not None and name not in only):
            continue
        hw = load_hardware(name)
        calib = cross_generation_calibration(hw, measured, fp4_sources=fp4)
        (args.output_dir / f"{name}.json").write_text(json.dumps(calib.to_dict()))
        print(f"{name}: cross-generation ({calib.source})")
    if only is None:   # the MLA families need every file's neighbours first: the --mla-only pass over the build
        _rebuild_mla(args.data, args.output_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
