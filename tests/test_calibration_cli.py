"""Measurement reading, predict/eval/fit CLIs, and the sweep's grid and CSV writing."""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import needs_shared

from kernelsight.calibrate import sweep, sweep_shapes, sweep_timing
from kernelsight.calibrate.cli import add_calibrate_parser, add_predict_parser
from kernelsight.calibrate.evaluate import predict_table_s, roofline_calibration
from kernelsight.calibrate.measurements import measurement_software, read_measurements, read_table
from kernelsight.cli import main
from kernelsight.profiles import load_hardware
from kernelsight.simcore.calibration import calibration_from_dict

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "kernels"
needs_data = needs_shared(DATA)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kernelsight")
    sub = p.add_subparsers(dest="command", required=True)
    add_calibrate_parser(sub)
    add_predict_parser(sub)
    return p


def _run(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    return args.func(args)


def _write_subset(src: Path, dst: Path, every: int) -> None:
    with gzip.open(src, "rt") as fh:
        rows = list(csv.reader(fh))
    with open(dst, "w", newline="") as fh:
        csv.writer(fh).writerows([rows[0]] + rows[1::every])


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("h100_small")
    for fam, every in (("gemm", 60), ("attn_prefill", 40), ("attn_decode", 50), ("comm", 1),
                       ("mla_context", 4), ("mla_generation", 6)):
        _write_subset(DATA / "h100_sxm" / f"{fam}.csv.gz", d / f"{fam}.csv", every)
    return d


def test_reader_plain_gzip_and_missing_latency(tmp_path):
    plain = tmp_path / "gemm.csv"
    plain.write_text("dtype,m,n,k\nbf16,1,4096,4096\nbf16,1,4096,4096\nfp8,64,1024,512\n")
    t = read_table(plain)
    assert len(t) == 3 and not t.has_latency  # duplicates kept as samples
    assert t["m"].dtype == float and t["dtype"][2] == "fp8"
    gz = tmp_path / "attn_decode.csv.gz"
    with gzip.open(gz, "wt") as fh:
        fh.write(
            "batch,cached_len,num_heads,num_kv_heads,head_dim,kv_dtype,window,latency_us\n"
            "8,1023,32,8,128,bf16,0,20.5\n"
        )
    m = read_measurements(tmp_path)
    assert set(m) == {"gemm", "attn_decode"} and m["attn_decode"]["latency_us"][0] == 20.5
    bad = tmp_path / "x" / "gemm.csv"
    bad.parent.mkdir()
    bad.write_text("dtype,m,n\nbf16,1,2\n")
    with pytest.raises(ValueError, match="missing columns"):
        read_table(bad)


@needs_data
def test_predict_cli_writes_rows_plus_prediction(tmp_path):
    inp = tmp_path / "gemm.csv"
    inp.write_text("dtype,m,n,k\nbf16,1,4096,4096\nfp8,512,8192,8192\nfp8_block,16,1024,7168\n")
    for tier in ("roofline", "cross-generation", "target"):
        out = tmp_path / f"out_{tier}.csv"
        assert (
            _run(["predict", "--hardware", "h100-sxm", "--tier", tier, "--input", str(inp), "-o", str(out)])
            == 0
        )
        rows = list(csv.DictReader(out.open()))
        assert list(rows[0]) == ["dtype", "m", "n", "k", "predicted_us"]
        assert [r["dtype"] for r in rows] == ["bf16", "fp8", "fp8_block"]
        pred = [float(r["predicted_us"]) for r in rows]
        assert all(p > 0 for p in pred)
        if tier != "roofline":  # fixed latency: even a GEMV costs microseconds
            assert pred[0] > 2.0


@pytest.mark.slow   # a whole calibration fit: run in CI's slow step
@needs_data
def test_fit_then_eval_cli(small_dir, tmp_path, capsys):
    out = tmp_path / "calib.json"
    assert (
        _run(["calibrate", "fit", "--measurements", str(small_dir), "--hardware", "h100-sxm", "-o", str(out)])
        == 0
    )
    calib = calibration_from_dict(json.loads(out.read_text()))
    assert calib.tier == "target-measured" and calib.hardware == "h100-sxm"
    # the folder's MLA module tables give the MLA op's families, as the bundled H100 file has them
    assert {"mla_prefill", "mla_decode"} <= set(calib.eta) and {"mla_prefill", "mla_decode"} <= set(calib.overhead_s)
    assert "mla_decode" in capsys.readouterr().out
    res = tmp_path / "eval.json"
    assert (
        _run(
            [
                "calibrate",
                "eval",
                "--measurements",
                str(small_dir),
                "--hardware",
                "h100-sxm",
                "--json",
                str(res),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    for fam in ("gemm", "attn_prefill", "attn_decode", "comm"):
        assert fam in text
    for tier in ("roofline", "cross-generation", "target"):
        assert tier in text
    results = json.loads(res.read_text())
    assert results["target"]["gemm"]["mape"] < results["roofline"]["gemm"]["mape"]
    assert "the target fit did not see" in text
    # a given file was fitted on rows of its own choosing: the header must not claim they were held out
    assert _run(["calibrate", "eval", "--measurements", str(small_dir), "--hardware", "h100-sxm",
                 "--calibration", str(out)]) == 0
    text = capsys.readouterr().out
    assert "did not see" not in text and "may have seen them" in text


def test_sweep_grid_is_fixed_and_schema_complete(tmp_path):
    g1, g2 = sweep_shapes.build_grid(), sweep_shapes.build_grid()
    assert g1 == g2
    assert len(g1.gemm) > 1000 and len(g1.attn_prefill) > 50 and len(g1.attn_decode) > 100
    assert g1.comm == ()  # one GPU: no collectives
    assert len(sweep_shapes.build_grid(num_gpus=8).comm) == len(sweep_shapes.COMM_OPS) * 3 * 21
    q = sweep_shapes.build_grid(quick=True)
    assert len(q.gemm) < 20
    p = sweep.write_csv(tmp_path / "gemm.csv", "gemm", [(*row, 12.5) for row in q.gemm], kernel="x")
    t = read_table(p)
    assert len(t) == len(q.gemm) and np.all(t["latency_us"] == 12.5)
    p = sweep.write_csv(tmp_path / "attn_decode.csv", "attn_decode", [(*r, 3.0) for r in q.attn_decode])
    assert set(read_measurements(tmp_path)) == {"gemm", "attn_decode"}


def test_sweep_runs_on_cpu_end_to_end(tmp_path, capsys):
    pytest.importorskip("torch")
    assert _run(["calibrate", "sweep", "-o", str(tmp_path), "--device", "cpu", "--quick"]) == 0
    m = read_measurements(tmp_path)
    assert {"gemm", "attn_prefill", "attn_decode"} <= set(m)
    for t in m.values():
        assert len(t) > 0 and np.all(t["latency_us"] > 0)
    info = json.loads((tmp_path / "sweep.json").read_text())   # what ran, beside what it measured
    grid = sweep_shapes.build_grid(quick=True, gemm_dtypes=("bf16",))   # no fp8 on a CPU
    assert info["device_name"] == "cpu" and info["attention"] == "torch_sdpa" and info["timed_calls"] == 3
    assert info["points"] == {f: len(getattr(grid, f)) for f in ("gemm", "attn_prefill", "attn_decode", "comm")}
    assert info["gemm_kernels"] == {"bf16": "torch.nn.functional.linear"} and info["families"][-1] == "attn_decode"
    import torch
    # the software its kernels ran under, which a fit carries into the calibration
    assert info["torch"] == torch.__version__ and info["vllm"] == sweep.installed_version("vllm")
    assert measurement_software(tmp_path)["torch"] == torch.__version__
    capsys.readouterr()
    # a CPU sweep names no GPU profile: fitting it needs --hardware, and says so
    assert main(["calibrate", "fit", "--measurements", str(tmp_path), "-o", str(tmp_path / "c.json")]) == 2
    assert "measured on 'cpu', which no bundled GPU profile names: pass --hardware" in capsys.readouterr().err


def test_a_stopped_sweep_resumes_with_only_the_points_it_had_not_written(tmp_path, capsys, monkeypatch):
    pytest.importorskip("torch")
    argv = ["calibrate", "sweep", "-o", str(tmp_path), "--device", "cpu", "--quick", "--families", "gemm,attn_decode"]
    assert _run(argv) == 0
    full = {f: (tmp_path / f"{f}.csv").read_text().splitlines() for f in ("gemm", "attn_decode")}
    # stopped during the GEMMs: two rows written, a third cut off mid-line, no attention file yet
    (tmp_path / "gemm.csv").write_text("\n".join(full["gemm"][:3]) + "\n" + full["gemm"][3][:6])
    (tmp_path / "attn_decode.csv").unlink()
    timed = []
    time_point = sweep_timing.time_point
    monkeypatch.setattr(sweep, "time_point",
                        lambda make, device, reps: timed.append(1) or time_point(make, device, reps))
    monkeypatch.setattr(sweep, "PROGRESS_EVERY_S", 0.0)
    capsys.readouterr()
    assert _run([*argv, "--resume"]) == 0
    err = capsys.readouterr().err
    grid = sweep_shapes.build_grid(quick=True, gemm_dtypes=("bf16",))
    assert len(timed) == len(grid.gemm) - 2 + len(grid.attn_decode)   # the two complete rows were kept
    gemm = (tmp_path / "gemm.csv").read_text().splitlines()
    assert gemm[:3] == full["gemm"][:3] and len(gemm) == len(full["gemm"])   # kept rows as measured, cut row redone
    assert [r.split(",")[:4] for r in gemm] == [r.split(",")[:4] for r in full["gemm"]]
    assert len(read_measurements(tmp_path)["attn_decode"]) == len(grid.attn_decode)
    assert f"gemm: {len(grid.gemm)} of {len(grid.gemm)} points (2 kept from the earlier run, {len(grid.gemm) - 2} " \
        "timed now, 0 left out or failed)" in err
    assert re.search(r"gemm: \d+ of \d+ points, \d+ s", err)   # progress while a family runs
    # another draw into the same directory: refused, the rows stay
    assert main([*argv, "--resume", "--seed", "1"]) == 2
    assert "holds another sweep (seed 0; this one: 1)" in capsys.readouterr().err
    assert (tmp_path / "gemm.csv").read_text().splitlines() == gemm


def test_resume_keeps_complete_collectives_and_reruns_incomplete_ones(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    grid = sweep_shapes.Grid(gemm=(), attn_prefill=(), attn_decode=(),
                             comm=(("all_reduce", "nccl", "bf16", 2, 512), ("all_reduce", "nccl", "bf16", 2, 1024)))
    monkeypatch.setattr(sweep, "build_grid", lambda **kw: grid)
    runs = []

    def fake_comm(out, g, reps):
        runs.append(1)
        return sweep.write_csv(out / "comm.csv", "comm", [(*row, 9.0) for row in g.comm[: 1 if len(runs) == 1 else 2]])

    monkeypatch.setattr(sweep, "_run_comm", fake_comm)
    argv = dict(device="cpu", families=("comm",), resume=True)
    sweep.run_sweep(tmp_path, **argv)          # stopped after one collective: one row
    sweep.run_sweep(tmp_path, **argv)          # incomplete: all of them again
    assert len(runs) == 2 and len(read_measurements(tmp_path)["comm"]) == 2
    sweep.run_sweep(tmp_path, **argv)          # complete: kept
    assert len(runs) == 2


@pytest.mark.slow   # a whole calibration fit: run in CI's slow step
@needs_data
def test_fit_finds_the_gpu_a_sweep_ran_on_and_records_the_sweep(tmp_path, capsys):
    d = tmp_path / "sweep"
    d.mkdir()
    _write_subset(DATA / "h100_sxm" / "gemm.csv.gz", d / "gemm.csv", 400)
    out = tmp_path / "c.json"
    # no sweep.json, and a directory named for no GPU: nothing names the GPU
    assert main(["calibrate", "fit", "--measurements", str(d), "-o", str(out)]) == 2
    assert "--hardware is required" in capsys.readouterr().err
    named = tmp_path / "h200_sxm"   # the shared layout: a folder named for its GPU
    named.mkdir()
    (named / "gemm.csv").write_text((d / "gemm.csv").read_text())
    assert main(["calibrate", "fit", "--measurements", str(named), "-o", str(out)]) == 0
    assert json.loads(out.read_text())["hardware"] == "h200-sxm"
    (d / "sweep.json").write_text(json.dumps({"device_name": "NVIDIA H100 80GB HBM3", "torch": "2.9.0",
                                              "attention": "vllm_flash_attn", "seed": 0}))
    assert main(["calibrate", "fit", "--measurements", str(d), "-o", str(out)]) == 0
    calib = json.loads(out.read_text())
    assert calib["hardware"] == "h100-sxm"
    assert calib["source"].startswith("kernelsight calibrate sweep on NVIDIA H100 80GB HBM3 (torch 2.9.0")
    assert calib["software"] == {"torch": "2.9.0"}     # what it records of the software, and nothing more
    assert "measured on" not in capsys.readouterr().err
    # told another GPU: fitted as told, with a note
    assert main(["calibrate", "fit", "--measurements", str(d), "--hardware", "a100", "-o", str(out)]) == 0
    assert json.loads(out.read_text())["hardware"] == "a100-sxm"
    assert "was measured on NVIDIA H100 80GB HBM3, fitted here as a100-sxm" in capsys.readouterr().err


@pytest.mark.parametrize("value, message", [("0", "must be at least 1, got 0"), ("two", "expected a whole number")])
def test_workers_must_be_a_positive_whole_number(value, message, capsys):
    for cmd in ("fit", "eval"):
        argv = ["calibrate", cmd, "--measurements", "d", "--hardware", "h100-sxm", "--workers", value]
        if cmd == "fit":
            argv += ["-o", "x.json"]
        with pytest.raises(SystemExit) as exc:
            _parser().parse_args(argv)
        assert exc.value.code == 2
        assert message in capsys.readouterr().err


def test_sweep_families_are_checked_when_parsed(capsys):
    args = _parser().parse_args(["calibrate", "sweep", "-o", "d", "--families", "gemm,attn_decode"])
    assert args.families == ("gemm", "attn_decode")
    assert _parser().parse_args(["calibrate", "sweep", "-o", "d"]).families == (
        "gemm", "attn_prefill", "attn_decode", "comm")
    with pytest.raises(SystemExit) as exc:
        _parser().parse_args(["calibrate", "sweep", "-o", "d", "--families", "gemm,atn_decode"])
    assert exc.value.code == 2
    assert "expected families among gemm, attn_prefill, attn_decode, comm, got 'gemm,atn_decode'" in \
        capsys.readouterr().err


@pytest.mark.slow   # a whole calibration fit: run in CI's slow step
@needs_data
def test_fit_fills_unmeasured_families_from_the_cross_generation_tier_unless_told_not_to(tmp_path, capsys):
    """A GEMM-only sweep: by default attention comes from the cross-generation tier (bundled calibrations of the
    other GPUs); ``--no-prior`` leaves it at the uncalibrated default."""
    d = tmp_path / "gemm_only"
    d.mkdir()
    _write_subset(DATA / "h100_sxm" / "gemm.csv.gz", d / "gemm.csv", 200)
    files = {}
    for flag in ([], ["--no-prior"]):
        out = tmp_path / f"calib{len(flag)}.json"
        argv = ["calibrate", "fit", "--measurements", str(d), "--hardware", "h100-sxm", "-o", str(out), *flag]
        assert _run(argv) == 0
        files[bool(flag)] = json.loads(out.read_text())
    capsys.readouterr()
    with_prior, bare = files[False], files[True]
    assert with_prior["eta"]["attn_decode"]["form"] == "switch"
    assert with_prior["eta"]["attn_decode"]["models"]["2"]["form"] == "ensemble"   # transferred from other GPUs
    assert "attn_decode" not in bare["eta"] or bare["eta"]["attn_decode"]["form"] != "switch"
    assert with_prior["eta"]["gemm"] == bare["eta"]["gemm"]   # ~180 rows a format, each fit beats the prior


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("gemm.csv", "dtype,m,n,k\nbf16,1,64,64\nnvfp4,1,64,64\nmxfp8,2,64,64\n",
         "dtype 'mxfp8' not supported (one of bf16, fp16, fp8, fp8_block, int8, nvfp4)"),
        ("gemm.csv", "dtype,m,n,k\nbf16,1,64\n", "line 2 has 3 cells, the header 4"),
        ("gemm.csv", "dtype,m,n,k\nbf16,1,64,64\nbf16,0,64,64\n", "line 3: m must be > 0, got 0"),
        ("attn_decode.csv", "batch,cached_len,num_heads,num_kv_heads,head_dim,kv_dtype,window\n1,-1,8,8,64,bf16,0\n",
         "line 2: cached_len must be ≥ 0, got -1"),
        ("attn_prefill.csv", "batch,seq_len,num_heads,num_kv_heads,head_dim,kv_dtype,window\n1,16,8,8,64,fp4,0\n",
         "kv_dtype 'fp4' not supported"),
    ],
)
def test_rows_outside_the_schema_are_a_one_line_error_naming_them(tmp_path, capsys, name, text, message):
    src = tmp_path / name
    src.write_text(text)
    with pytest.raises(ValueError, match=re.escape(message)):
        read_table(src)
    assert main(["predict", "--hardware", "h100", "--input", str(src), "-o", str(tmp_path / "out.csv")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err


def test_vllm_auto_kv_dtype_is_the_models_16_bit_cache(tmp_path):
    rows = "batch,cached_len,num_heads,num_kv_heads,head_dim,kv_dtype,window\n4,1023,32,8,128,{}\n"
    preds = []
    for dt in ("auto,0", "bf16,0"):
        (tmp_path / "attn_decode.csv").write_text(rows.format(dt))
        t = read_table(tmp_path / "attn_decode.csv")
        hw = load_hardware("h100")
        preds.append(float(predict_table_s(t, hw, roofline_calibration(hw))[0]))
    assert preds[0] == preds[1] > 0


def test_predict_says_which_rows_it_could_not_price(tmp_path, capsys):
    src = tmp_path / "comm.csv"
    src.write_text("op,backend,dtype,num_gpus,message_bytes\nall_reduce,nccl,bf16,2,4096\n"
                   "broadcast,nccl,bf16,2,4096\nbroadcast,nccl,bf16,4,4096\n")
    out = tmp_path / "out.csv"
    assert main(["predict", "--hardware", "h100", "--input", str(src), "-o", str(out)]) == 0
    assert "2 rows without a model (op 'broadcast'): predicted_us left empty" in capsys.readouterr().out
    with open(out) as fh:
        rows = list(csv.DictReader(fh))
    assert float(rows[0]["predicted_us"]) > 0 and rows[1]["predicted_us"] == rows[2]["predicted_us"] == ""


def test_predict_to_standard_output_keeps_the_csv_clean(tmp_path, capsys):
    """``-o -`` writes the CSV to stdout and the summary line to stderr, so the rows can be piped on."""
    src = tmp_path / "gemm.csv"
    src.write_text("dtype,m,n,k\nbf16,1,4096,4096\n")
    assert main(["predict", "--hardware", "l4", "--input", str(src), "-o", "-"]) == 0
    out, err = capsys.readouterr()
    rows = list(csv.DictReader(out.splitlines()))
    assert len(rows) == 1 and float(rows[0]["predicted_us"]) > 0 and rows[0]["m"] == "1"
    assert "wrote 1 row to standard output (cross-generation calibration of l4)" in err
    assert not (tmp_path / "-").exists() and not Path("-").exists()


def test_measured_gpu_folders_are_found_by_profile_name(tmp_path):
    """The benchmarks take every GPU folder of a kernels directory whose name is a bundled profile, so a GPU
    added to the data (e.g. ``h200_sxm``) is fitted and held out without code changes."""
    from kernelsight.calibrate.evaluate import measured_gpu_dirs

    for name in ("h200_sxm", "l40s", "mystery_gpu", "empty"):
        (tmp_path / name).mkdir()
    for name in ("h200_sxm", "l40s", "mystery_gpu"):
        (tmp_path / name / "gemm.csv").write_text("dtype,m,n,k,latency_us\nbf16,1,64,64,3.0\n")
    assert measured_gpu_dirs(tmp_path) == {"h200_sxm": "h200-sxm", "l40s": "l40s"}


@needs_data
def test_fit_says_which_variants_the_sweep_did_not_measure(tmp_path, capsys):
    """A bf16-only GEMM sweep: the fp8 formats are the cross-generation tier's, and the fit report says so."""
    with gzip.open(DATA / "h100_sxm" / "gemm.csv.gz", "rt") as fh:
        rows = list(csv.reader(fh))
    d = tmp_path / "bf16_only"
    d.mkdir()
    with open(d / "gemm.csv", "w", newline="") as fh:
        csv.writer(fh).writerows([rows[0]] + [r for r in rows[1::20] if r[0] == "bf16"])
    out = tmp_path / "c.json"
    assert _run(["calibrate", "fit", "--measurements", str(d), "--hardware", "h100-sxm", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert re.search(r"gemm\[1\]\s+rows\s+0\s+not measured → cross-generation model", text)
    assert re.search(r"gemm\[2\]\s+rows\s+0\s+not measured", text)
    assert not re.search(r"gemm\[0\][^\n]*not measured", text)
    calib = calibration_from_dict(json.loads(out.read_text()))
    assert set(calib.eta["gemm"].models) == {"0", "1", "2"}


def test_sweep_points_and_seed_choose_the_draw(capsys):
    args = _parser().parse_args(["calibrate", "sweep", "-o", "d", "--points", "gemm=40,attn_decode=7", "--seed", "3"])
    assert args.points == {"gemm": 40, "attn_decode": 7} and args.seed == 3
    grid = sweep_shapes.build_grid(points=args.points, seed=args.seed)
    assert len(grid.gemm) == 2 * 40 and len(grid.attn_decode) == 7
    assert len(grid.attn_prefill) == sweep_shapes.SWEEP_POINTS["attn_prefill"]
    for bad, message in (("comm=5", "FAMILY=N with FAMILY one of gemm, attn_prefill, attn_decode"),
                         ("gemm", "got 'gemm'"), ("gemm=0", "must be at least 1")):
        with pytest.raises(SystemExit) as exc:
            _parser().parse_args(["calibrate", "sweep", "-o", "d", "--points", bad])
        assert exc.value.code == 2
        assert message in capsys.readouterr().err


def test_sweep_estimate_needs_no_torch_and_adds_up(capsys):
    assert _run(["calibrate", "sweep", "--estimate", "h100", "--points", "gemm=100,attn_prefill=50,attn_decode=50",
                 "--num-gpus", "2"]) == 0
    out = capsys.readouterr().out
    lines = {f: n for f, n, _ in re.findall(r"^(\w+)\s+(\d+) points\s+([\d.]+) min", out, flags=re.M)}
    assert int(lines["gemm"]) == 2 * 100 and int(lines["attn_prefill"]) == 50
    assert int(lines["comm"]) == len(sweep_shapes.COMM_OPS) * 21            # 2 GPUs: one GPU count
    assert "h100-sxm (target-measured calibration" in out
    parts = [float(re.search(rf"^{f}\s+\d+ points\s+([\d.]+) min", out, flags=re.M).group(1))
             for f in ("gemm", "attn_prefill", "attn_decode", "comm")]
    assert float(re.search(r"^total\s+\d+ points\s+([\d.]+) min", out, flags=re.M).group(1)) == pytest.approx(
        sum(parts), abs=0.25)
    assert _run(["calibrate", "sweep", "--estimate", "h100", "--points", "attn_prefill=50,attn_decode=50",
                 "--windows"]) == 0
    out = capsys.readouterr().out
    # Hopper: vLLM's FA3 also runs an fp8 KV cache, so a FlashAttention sweep times those points too
    assert re.search(rf"^attn_prefill\s+"
                     rf"{50 + int(50 * sweep_shapes.WINDOW_SHARE) + int(50 * sweep_shapes.FP8_KV_SHARE)} points",
                     out, flags=re.M)
    assert _run(["calibrate", "sweep", "--estimate", "a100", "--points", "attn_prefill=50,attn_decode=50",
                 "--windows"]) == 0   # FA2: no fp8 KV cache
    assert re.search(rf"^attn_decode\s+{50 + int(50 * sweep_shapes.WINDOW_SHARE)} points", capsys.readouterr().out,
                     flags=re.M)
    assert _run(["calibrate", "sweep"]) == 2
    assert "-o/--output DIR is required" in capsys.readouterr().err


def test_the_sweep_pages_attention_by_the_block_size_one_serves_with(tmp_path, monkeypatch):
    """``--block-size`` reaches the sweep (default vLLM's 16), and a directory swept with another block size is
    not resumed into: its attention rows timed another cache layout."""
    seen = []
    monkeypatch.setattr(sweep, "run_sweep", lambda out, **kw: seen.append(kw["block_size"]) or [])
    assert _run(["calibrate", "sweep", "-o", str(tmp_path)]) == 0
    assert _run(["calibrate", "sweep", "-o", str(tmp_path), "--block-size", "32"]) == 0
    assert seen == [16, 32]
    with pytest.raises(SystemExit):   # argparse: a usage error
        _run(["calibrate", "sweep", "-o", str(tmp_path), "--block-size", "0"])
    assert seen == [16, 32]
    monkeypatch.undo()
    with pytest.raises(ValueError, match="block_size must be >= 1"):   # before torch is even needed
        sweep.run_sweep(tmp_path / "never", device="cpu", block_size=0)
    assert not (tmp_path / "never").exists()
    info = {"device_name": "NVIDIA H100 80GB HBM3", "seed": 0, "kv_block_size": 16}
    (tmp_path / "sweep.json").write_text(json.dumps(info))
    sweep._check_same_sweep(tmp_path / "sweep.json", dict(info))
    with pytest.raises(ValueError, match="kv_block_size 16; this one: 32"):
        sweep._check_same_sweep(tmp_path / "sweep.json", {**info, "kv_block_size": 32})


def test_the_software_measurements_were_timed_under_is_read_from_the_sweep_or_the_source_file(tmp_path):
    """A kernel library picks its kernels per release: a calibration keeps the versions its rows were timed under,
    from the sweep's record, else from a shared folder's SOURCE lines; unknown keys and other text are ignored."""
    shared = tmp_path / "rtx_pro_6000_server"
    shared.mkdir()
    (shared / "SOURCE").write_text("device: NVIDIA RTX PRO 6000\nnccl: 2.29.2\nvLLM: 0.24.0\nsource: x (a: b)\n"
                                   "torch:\n")
    assert measurement_software(shared) == {"vllm": "0.24.0", "nccl": "2.29.2"}   # in SOFTWARE_KEYS order
    assert measurement_software(tmp_path / "nowhere") == {}
    (shared / "gemm.csv").write_text("m,n,k\n")
    assert measurement_software(shared / "gemm.csv") == {}       # a single file records nothing
    # a sweep's record wins over a SOURCE file, and nulls (no HIP on CUDA) are left out
    (shared / "sweep.json").write_text(json.dumps({"torch": "2.10.0+cu128", "cuda": "12.8", "hip": None,
                                                   "vllm": "0.19.0", "nccl": "2.27.3", "seed": 0}))
    assert measurement_software(shared) == {"vllm": "0.19.0", "torch": "2.10.0+cu128", "cuda": "12.8",
                                            "nccl": "2.27.3"}


def test_the_installed_version_of_a_distribution_is_what_its_metadata_says():
    assert sweep.installed_version("numpy") == np.__version__     # vLLM's the same way, where installed
    assert sweep.installed_version("no-such-distribution-kernelsight") is None


def test_resume_refuses_a_directory_swept_under_other_software(tmp_path):
    info = {"device_name": "NVIDIA H100 80GB HBM3", "seed": 0, "kv_block_size": 16, "torch": "2.9.0",
            "vllm": "0.19.0"}
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(info))
    sweep._check_same_sweep(path, dict(info))
    with pytest.raises(ValueError, match="vllm '0.19.0'; this one: '0.24.0'.*same GPU, software"):
        sweep._check_same_sweep(path, {**info, "vllm": "0.24.0"})
    # a directory from before the software was recorded resumes under any
    path.write_text(json.dumps({k: v for k, v in info.items() if k not in ("torch", "vllm")}))
    sweep._check_same_sweep(path, {**info, "torch": "2.10.0", "vllm": "0.24.0"})
