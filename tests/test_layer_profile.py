"""`kernelsight calibrate import-profile`: per-layer profile bundles (LLMServingSim's format) as target-tier rows.

A synthetic bundle is written with latencies planted from known η and fixed latencies on the GPU's roofline, so
what the import recovers can be checked exactly; the shared bundles check the bundled RTX 4090 calibration."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kernelsight.calibrate.layer_profile import (
    ProfileError,
    elementwise_rows,
    fit_elementwise,
    import_profiles,
    profile_tables,
    read_profile,
)
from kernelsight.calibrate.measurements import read_measurements
from kernelsight.calibrate.rows import kernel_rows, predict_rows_s, roofline_rows_s
from kernelsight.cli import main
from kernelsight.profiles import load_calibration, load_hardware

HW = load_hardware("rtx-4090")
GEMM_ETA, GEMM_OVH_US = 0.6, 8.0
EW_ETA, EW_OVH_US = 0.8, 2.0
ATTN_ETA, ATTN_OVH_US = 0.5, 6.0
TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048]


def _planted_us(family: str, cols: dict) -> np.ndarray:
    rows = kernel_rows(family, {k: np.asarray(v) for k, v in cols.items()})
    eta, ovh = (GEMM_ETA, GEMM_OVH_US) if family == "gemm" else (ATTN_ETA, ATTN_OVH_US)
    return roofline_rows_s(rows, HW) / eta * 1e6 + ovh


def _write_bundle(root: Path, vllm: str = "0.19.0", gpu: str = "NVIDIA GeForce RTX 4090", tps=(1, 2)) -> Path:
    from kernelsight.profiles import load_model

    model = load_model("meta-llama/Llama-3.1-8B")
    bundle = root / "meta-llama" / "Llama-3.1-8B" / "bf16"
    bundle.mkdir(parents=True)
    (bundle / "meta.yaml").write_text(
        f"vllm_version: {vllm}\ncuda_version: '12.8'\ngpu: {gpu}\nhardware: RTX4090\n"
        f"model: meta-llama/Llama-3.1-8B\nvariant: bf16\ntp_degrees: {list(tps)}\n"
        "engine_effective:\n  enforce_eager: true\n  hf_overrides:\n    num_hidden_layers: 1\n"
        "    intermediate_size: 7168\n")   # the last TP degree's emulation: not the model's shapes
    h, d = model.hidden_size, model.head_dim
    bw = HW.usable_mem_bytes_per_s
    for tp in tps:
        folder = bundle / f"tp{tp}"
        folder.mkdir()
        qh, kvh, inter = model.num_attention_heads // tp, model.num_kv_heads // tp, model.intermediate_size // tp
        shapes = {"qkv_proj": ((qh + 2 * kvh) * d, h), "o_proj": (h, qh * d), "gate_up_proj": (2 * inter, h),
                  "down_proj": (h, inter)}
        dense = ["layer,tokens,time_us"]
        for op, (n, k) in shapes.items():
            t = _planted_us("gemm", {"dtype": ["bf16"] * len(TOKENS), "m": TOKENS, "n": [n] * len(TOKENS),
                                     "k": [k] * len(TOKENS)})
            dense += [f"{op},{m},{x:.4f}" for m, x in zip(TOKENS, t, strict=True)]
        for op, bytes_per_token in (("layernorm", 3 * h * 2), ("act_fn", 3 * inter * 2),
                                    ("rotary_emb", 2 * (qh + kvh) * d * 2), ("embedding", 2 * h * 2)):
            dense += [f"{op},{m},{m * bytes_per_token / (EW_ETA * bw) * 1e6 + EW_OVH_US:.6f}" for m in TOKENS]
        (folder / "dense.csv").write_text("\n".join(dense) + "\n")
        vocab = -(-model.vocab_size // tp)
        seqs = [1, 2, 4, 8, 16, 32, 64, 128, 256]
        lm = _planted_us("gemm", {"dtype": ["bf16"] * 9, "m": seqs, "n": [vocab] * 9, "k": [h] * 9})
        per_seq = ["layer,sequences,time_us", *[f"lm_head,{s},{x:.4f}" for s, x in zip(seqs, lm, strict=True)]]
        per_seq += [f"sampler,{s},{3 * s * model.vocab_size * 4 / (EW_ETA * bw) * 1e6 + EW_OVH_US:.6f}"
                    for s in seqs]
        (folder / "per_sequence.csv").write_text("\n".join(per_seq) + "\n")
        att = ["prefill_chunk,kv_prefill,n_decode,kv_decode,time_us"]
        common = {"num_heads": [qh], "num_kv_heads": [kvh], "head_dim": [d], "kv_dtype": ["bf16"], "window": [0]}
        for chunk in (16, 64, 256, 1024, 2048):
            for kv in (0, 512, 4096):
                t = _planted_us("attn_prefill", {"batch": [1], "seq_len": [chunk], "cached_len": [kv], **common})[0]
                att.append(f"{chunk},{kv},0,0,{t:.4f}")
        mixed_prefill = _planted_us("attn_prefill", {"batch": [1], "seq_len": [256], "cached_len": [512], **common})[0]
        for n_dec in (1, 4, 16, 64, 256):
            for kv in (16, 256, 2048, 16384):
                t = _planted_us("attn_decode", {"batch": [n_dec], "cached_len": [kv], **common})[0]
                att.append(f"0,0,{n_dec},{kv},{t:.4f}")
                att.append(f"256,512,{n_dec},{kv},{t + mixed_prefill:.4f}")   # mixed: the two kernels' sum
        (folder / "attention.csv").write_text("\n".join(att) + "\n")
        (folder / "skew.csv").write_text(
            "regime,n,nb,ratio,skew,pc,kp,kvs,kv_big,kv_mean,t_mean_us,t_max_us,t_skew_us,alpha\n"
            "pure,4,1,0.25,16.0,0,0,128,2048,608,80.0,160.0,84.0,0.05\n"
            "pure,8,2,0.25,16.0,0,0,256,4096,1216,90.0,190.0,100.0,0.1\n"
            "mixed,2,1,0.5,4.0,64,2048,2048,8192,5120,517.1,810.2,807.9,0.9921\n"
            "mixed,2,1,0.5,4.0,64,2048,2048,8192,5120,517.1,810.2,807.9,\n")   # a row left without a result
    return bundle


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    return _write_bundle(tmp_path_factory.mktemp("layers") / "RTX4090")


def test_read_profile_takes_each_tp_folders_shapes_from_the_model(bundle):
    p = read_profile(bundle)
    assert p.hardware == "rtx-4090" and p.vllm_version == "0.19.0" and sorted(p.tp_dirs) == [1, 2]
    assert p.model.intermediate_size == 14336          # meta.yaml's hf_overrides are one TP degree's emulation
    gemm = profile_tables(p)["gemm"]
    nk = set(zip(gemm["n"].astype(int), gemm["k"].astype(int), strict=True))
    assert (6144, 4096) in nk and (3072, 4096) in nk      # QKV at TP 1 and TP 2 (one rank's heads)
    assert (4096, 14336) in nk and (4096, 7168) in nk      # down projection
    assert (128256, 4096) in nk and (64128, 4096) in nk    # the LM head, vocab-parallel
    pre = profile_tables(p)["attn_prefill"]
    assert set(pre["cached_len"].astype(int)) == {0, 512, 4096}


def test_prefill_rows_with_a_cached_prefix_attend_it():
    cols = {"batch": np.array([1.0, 1.0]), "seq_len": np.array([256.0, 256.0]), "num_heads": np.array([32.0] * 2),
            "num_kv_heads": np.array([8.0] * 2), "head_dim": np.array([128.0] * 2), "kv_dtype": np.array(["bf16"] * 2),
            "window": np.zeros(2), "cached_len": np.array([0.0, 4096.0])}
    rows = kernel_rows("attn_prefill", cols)
    assert rows.flops[1] > 10 * rows.flops[0] and rows.bytes_moved[1] > rows.bytes_moved[0]
    assert rows.features[1][2] == 4096 + 256 and rows.features[0][2] == 256   # mean context: cached + new


def test_fit_elementwise_recovers_the_planted_bandwidth_and_latency(bundle):
    fitted = fit_elementwise(elementwise_rows(read_profile(bundle)), HW)
    assert set(fitted) == {"norm", "activation", "rope", "embedding", "sampler"}
    for fam, (eta, ovh_s) in fitted.items():
        assert eta == pytest.approx(EW_ETA, rel=1e-3), fam
        assert ovh_s == pytest.approx(EW_OVH_US * 1e-6, rel=1e-2), fam


def test_import_fits_a_target_tier_that_predicts_the_profile(bundle):
    r = import_profiles(bundle.parent.parent.parent)     # the GPU's folder above the bundle
    calib = r.calibration
    assert calib.tier == "target-measured" and calib.hardware == "rtx-4090"
    assert calib.software == {"vllm": "0.19.0", "cuda": "12.8"}
    assert "meta-llama/Llama-3.1-8B/bf16" in calib.source and "RTX4090/" in calib.source
    for fam, table in r.tables.items():
        pred = predict_rows_s(fam, table.columns, HW, calib)
        err = np.abs(pred / (table["latency_us"] * 1e-6) - 1.0)
        assert np.median(err) < 0.03, fam
    assert calib.eta["norm"].value == pytest.approx(EW_ETA, rel=1e-3)
    # the mixed rows were planted as the sum of the two kernels, which is what the step model prices
    check = next(iter(r.mixed_checks.values()))
    assert check["rows"] == 2 * 20 and check["median_ratio"] == pytest.approx(1.0, abs=0.03)


def test_skew_check_places_the_step_models_price_as_the_profile_does(bundle):
    from kernelsight.calibrate.layer_profile import skew_check

    checks = skew_check(read_profile(bundle), load_calibration("rtx-4090"))
    assert checks["pure"]["rows"] == 2 * 2 and checks["pure"]["median_measured_alpha"] == pytest.approx(0.075)
    assert checks["mixed"]["rows"] == 2    # per TP folder: the row without a result is left out
    for c in checks.values():
        assert -1.0 <= c["median_predicted_alpha"] <= 2.0


def test_import_refuses_bundles_of_two_releases(tmp_path):
    _write_bundle(tmp_path / "a", vllm="0.19.0", tps=(1,))
    _write_bundle(tmp_path / "b", vllm="0.24.0", tps=(1,))
    with pytest.raises(ProfileError, match="one software stack"):
        import_profiles(tmp_path)
    with pytest.raises(ProfileError, match="no profile bundle"):
        import_profiles(tmp_path / "a" / "meta-llama" / "Llama-3.1-8B" / "bf16" / "tp1")


def test_read_profile_names_what_is_wrong(tmp_path):
    with pytest.raises(ProfileError, match="no meta.yaml"):
        read_profile(tmp_path)
    bundle = _write_bundle(tmp_path / "x", gpu="Some Unknown GPU", tps=(1,))
    (bundle / "meta.yaml").write_text((bundle / "meta.yaml").read_text().replace("hardware: RTX4090", "hardware: x"))
    with pytest.raises(ProfileError, match="pass --hardware"):
        read_profile(bundle)
    assert read_profile(bundle, hardware="4090").hardware == "rtx-4090"


def test_cli_writes_the_calibration_and_the_rows(bundle, tmp_path, capsys):
    out, rows = tmp_path / "c.json", tmp_path / "rows"
    assert main(["calibrate", "import-profile", str(bundle), "-o", str(out), "--measurements-out", str(rows),
                 "--workers", "1"]) == 0
    printed = capsys.readouterr().out
    assert "target-measured, rtx-4090, vLLM 0.19.0" in printed and "mixed prefill+decode attention" in printed
    assert json.loads(out.read_text())["software"]["vllm"] == "0.19.0"
    tables = read_measurements(rows)
    assert set(tables) == {"gemm", "attn_prefill", "attn_decode"} and "cached_len" in tables["attn_prefill"].columns
    assert main(["calibrate", "import-profile", str(tmp_path / "nothing"), "-o", str(out)]) != 0
    assert "no profile bundle" in capsys.readouterr().err


def test_the_bundled_rtx_4090_calibration_comes_from_its_layer_profile(shared_data):
    calib = load_calibration("rtx-4090")
    assert calib.tier == "target-measured" and calib.software["vllm"] == "0.19.0"
    assert "shared/data/layers/RTX4090/" in calib.source and "MIT" in calib.licence
    r = import_profiles(shared_data / "layers" / "RTX4090", workers=0)
    for fam, table in r.tables.items():   # the bundled file prices the rows as a fresh import does
        bundled = predict_rows_s(fam, table.columns, HW, calib)
        fresh = predict_rows_s(fam, table.columns, HW, r.calibration)
        assert np.allclose(bundled, fresh, rtol=2e-3), fam   # the build fits in worker processes (BLAS bits)
