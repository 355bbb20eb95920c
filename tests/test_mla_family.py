"""The measured MLA families (``mla_prefill``, ``mla_decode``): their kernels, rows, fits, bundled files and use."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from conftest import needs_shared

from kernelsight.calibrate.fit.eta import fit_family
from kernelsight.calibrate.fit.transfer import cross_generation_calibration, mla_source_names
from kernelsight.calibrate.mla_tables import (
    MLA_TABLE_MODEL,
    OUTSIDE_MODULE,
    add_mla_families,
    fit_rows,
    module_other_kernels,
    read_mla_rows,
)
from kernelsight.calibrate.rows import MLA_FAMILIES, MLA_TABLE_SPEC, kernel_rows, roofline_rows_s, rows_time_s
from kernelsight.profiles import load_calibration, load_hardware, load_model
from kernelsight.simcore import kernels as K
from kernelsight.simcore.calibration import default_calibration
from kernelsight.simcore.mla import mla_decode_backend, mla_decode_kernels
from kernelsight.simcore.precision import resolve_precision
from kernelsight.simcore.roofline import kernel_roofline_s
from kernelsight.simcore.step_model import FULL_GRAPH, StepConfig, StepModel

MODULE_TABLES = Path(__file__).resolve().parents[2] / "shared" / "data" / "kernels" / "l40s"


def test_vllm_picks_the_mla_backend_by_compute_capability_and_kv_dtype():
    assert mla_decode_backend("9.0", "bf16") == "FLASH_ATTN_MLA"
    assert mla_decode_backend("9.0", "fp8") == "FLASHMLA"
    assert mla_decode_backend("10.0", "bf16") == "FLASHINFER_MLA"
    for cc in ("8.0", "8.9", "12.0"):
        assert mla_decode_backend(cc, "bf16") == mla_decode_backend(cc, "fp8") == "TRITON_MLA"


def test_the_decode_family_kernel_sums_the_ops_work():
    model = load_model(MLA_TABLE_MODEL)
    prec = resolve_precision("bfloat16", None, "auto", None, "9.0")
    (op,) = mla_decode_kernels(model, 8, 8 * 1000, 8, prec, 1, measured=True)
    parts = mla_decode_kernels(model, 8, 8 * 1000, 8, prec, 1)
    assert op.family == K.MLA_DECODE and [p.family for p in parts] == [K.GEMM, K.ATTN_DECODE, K.GEMM]
    assert op.flops == pytest.approx(sum(p.flops for p in parts))
    # the latent read once (576 wide), both bf16 per-head weights: what the three kernels move, give or take the
    # bmms' activations, which the op keeps on chip
    latent = 8000 * 576 * 2.0
    weights = 16 * 512 * 256 * 2.0
    assert latent + weights < op.bytes_moved < sum(p.bytes_moved for p in parts)
    assert op.features == (8.0, 1000.0, 16.0, 1.0, 288.0, 2.0, 0.0)   # attn_decode's layout


def _synthetic(family: str, eta: float, ovh_us: float) -> tuple[dict, object]:
    hw = load_hardware("h100")
    shapes = [(b, s, h, kv) for b in (1, 4, 16, 64) for s in (16, 128, 1024, 8192) for h in (8, 16, 128)
              for kv in ("bf16", "fp8")]
    key = "context_len" if family == "mla_decode" else "seq_len"
    cols = {"batch": np.array([x[0] for x in shapes], float), key: np.array([x[1] for x in shapes], float),
            "num_heads": np.array([x[2] for x in shapes], float), "kv_dtype": np.array([x[3] for x in shapes])}
    cols["latency_us"] = roofline_rows_s(kernel_rows(family, cols), hw) / eta * 1e6 + ovh_us
    return cols, hw


@pytest.mark.parametrize("family", MLA_FAMILIES)
def test_a_synthetic_op_table_is_fitted(family):
    cols, hw = _synthetic(family, eta=0.45, ovh_us=30.0)
    model, _, report = fit_family(family, cols, hw)
    calib = default_calibration(hw.name)
    add_mla_families(calib, {family: model})
    rows = kernel_rows(family, cols)
    pred = rows_time_s(calib, family, rows, roofline_rows_s(rows, hw), hw)
    assert np.median(np.abs(pred / (cols["latency_us"] * 1e-6) - 1.0)) < 0.03
    assert set(report) == {f"{family}[1]", f"{family}[2]"}          # one variant per KV-cache dtype
    assert calib.overhead_s[family] == pytest.approx(30e-6, rel=0.2)


def _module_table(tmp_path: Path, op_us: float) -> tuple[Path, object, object, object]:
    """An H100 generation table whose module rows are the bundled calibration's other kernels plus ``op_us``."""
    model, hw = load_model(MLA_TABLE_MODEL), load_hardware("h100")
    calib = load_calibration("h100")
    lines = ["model,dtype,kv_dtype,gemm_dtype,num_heads,tp_size,batch,isl,step,scope,kernel,latency_us"]
    for kernel in ("FLASH_ATTN_MLA", "TRITON_MLA"):
        for b in (1, 8):
            lines.append(f"{MLA_TABLE_MODEL},bf16,bf16,bf16,16,1,{b},1,511,module,{kernel},0")
    (tmp_path / "mla_generation.csv").write_text("\n".join(lines) + "\n")
    r = read_mla_rows(tmp_path, "generation", model, hw, calib)
    lat = (r.others_s * 1e6 + op_us).tolist()
    lines = lines[:1] + [line.rsplit(",", 1)[0] + f",{t:.4f}" for line, t in zip(lines[1:], lat, strict=True)]
    (tmp_path / "mla_generation.csv").write_text("\n".join(lines) + "\n")
    return tmp_path, model, hw, calib


def test_module_rows_become_the_ops_residual_and_only_the_serving_backend_is_fitted(tmp_path):
    folder, model, hw, calib = _module_table(tmp_path, op_us=40.0)
    r = read_mla_rows(folder, "generation", model, hw, calib)
    assert r.family == "mla_decode"
    assert np.allclose(r.residual_s * 1e6, 40.0, atol=1e-3)
    assert r.columns["serving"].tolist() == [True, True, False, False]   # H100, bf16 KV: FLASH_ATTN_MLA
    assert fit_rows(r).tolist() == [True, True, False, False]
    assert r.columns["context_len"].tolist() == [512.0] * 4              # 511 cached + the new token


def test_the_module_leaves_the_decoder_layers_norms_out():
    model, hw, calib = load_model(MLA_TABLE_MODEL), load_hardware("h100"), load_calibration("h100")
    prec = resolve_precision("bfloat16", None, "auto", None, hw.compute_capability)
    names = [k.name for k in module_other_kernels(model, "context", 4, 512, 8, prec)]
    assert "kv_b_proj" in names and "o_proj" in names and not OUTSIDE_MODULE & set(names)
    assert len(names) == len(K.mla_row_kernels(model, 1, 8, prec, 1)) - len(OUTSIDE_MODULE) + 1
    assert [k.name for k in module_other_kernels(model, "generation", 4, 1, 8, prec)] == names[:-1]
    assert calib is not None


def test_bundled_calibrations_carry_the_families_where_measured_or_transferable():
    for gpu, version in (("h100-sxm", None), ("l40s", None), ("rtx-pro-6000", None), ("rtx-pro-6000", "0.19.0"),
                         ("h200-sxm", None), ("a100-sxm", None), ("rtx-4090", None)):
        calib = load_calibration(gpu, vllm_version=version)
        assert set(MLA_FAMILIES) <= set(calib.eta) and set(MLA_FAMILIES) <= set(calib.overhead_s), (gpu, version)
    for gpu in ("b200-sxm", "gb200"):   # FlashInfer-MLA: no measured GPU runs it
        assert not set(MLA_FAMILIES) & set(load_calibration(gpu).eta)


def test_decode_is_transferred_only_from_gpus_running_the_same_kernel():
    sources = [load_hardware(g) for g in ("h100-sxm", "l40s", "rtx-pro-6000")]
    assert mla_source_names(load_hardware("h200"), sources, "mla_decode") == ["h100-sxm"]
    assert mla_source_names(load_hardware("a100-sxm"), sources, "mla_decode") == ["l40s", "rtx-pro-6000"]
    assert mla_source_names(load_hardware("a100-sxm"), sources, "mla_prefill") == ["h100-sxm", "l40s",
                                                                                     "rtx-pro-6000"]
    assert mla_source_names(load_hardware("b200"), sources, "mla_prefill") == []
    cross = cross_generation_calibration(load_hardware("b200"), [(load_calibration(h.name), h) for h in sources])
    assert not set(MLA_FAMILIES) & set(cross.eta)


def _deepseek(gpu: str, eager: bool, calib=None) -> StepModel:
    model, hw = load_model(MLA_TABLE_MODEL), load_hardware(gpu)
    prec = resolve_precision("bfloat16", "fp8", "auto", None, hw.compute_capability)
    config = StepConfig(tp=8, enforce_eager=eager, cudagraph_capture_sizes=(1, 2, 4, 8, 16, 32, 64))
    return StepModel(model, hw, calib or load_calibration(gpu), prec, config)


def test_a_deepseek_step_prices_attention_with_the_measured_families():
    sm = _deepseek("h100", eager=False)
    bare = dataclasses.replace(sm.calib, eta={k: v for k, v in sm.calib.eta.items() if k not in MLA_FAMILIES})
    composed = _deepseek("h100", eager=False, calib=bare)
    batch = K.BatchShape((K.PrefillChunk(300, 0, True),), 16, 16 * 2000)
    fams = {k.family for k in K.attention_kernels(sm.model, batch, 8, sm.precision, sm.mla_families)}
    assert {K.MLA_PREFILL, K.MLA_DECODE} <= fams and not {K.ATTN_PREFILL, K.ATTN_DECODE} & fams
    i_p, i_d = K.FAMILY_INDEX[K.ATTN_PREFILL], K.FAMILY_INDEX[K.ATTN_DECODE]
    with_families, without = sm.breakdown_s(batch), composed.breakdown_s(batch)
    assert with_families[i_p] != without[i_p] and with_families[i_d] != without[i_d]
    # the composed pricing under-predicted the module tables' decode op (by ~30 %): the measured one is slower
    assert with_families[i_d] > without[i_d]


def test_the_ops_host_work_is_in_the_launch_term_and_a_full_graph_drops_it():
    graph, eager = _deepseek("h100", eager=False), _deepseek("h100", eager=True)
    decode = K.BatchShape((), 2, 2 * 64)
    assert graph.graph_mode(decode)[0] == FULL_GRAPH
    # the op's GPU time is the same in both modes; only the launch term differs
    i_d, i_l = K.FAMILY_INDEX[K.ATTN_DECODE], K.FAMILY_INDEX[K.LAUNCH]
    g, e = graph.breakdown_s(decode), eager.breakdown_s(decode)
    assert g[i_d] == pytest.approx(e[i_d])
    host = eager.mla_host_s((), 2, 2 * 64)
    assert host > 20e-6 * 61                                    # tens of µs a layer on H100 (see _mla_excess_s)
    assert g[i_l] == pytest.approx(graph.calib.launch.full_graph_step_s)
    assert e[i_l] > 0.0
    cpu = eager.calib.launch.eager_per_kernel_s * 61 * 14
    gpu = float(e.sum() - e[i_l] - e[K.FAMILY_INDEX[K.HOST]])
    assert e[i_l] == pytest.approx(max(cpu + host - gpu, 0.0) + eager.calib.launch.full_graph_step_s)


@pytest.mark.parametrize("gpu", ["h100", "l40s", "rtx-pro-6000", "h200", "a100-sxm"])
def test_every_mla_op_is_priced_at_or_above_its_roofline(gpu):
    sm = _deepseek(gpu, eager=False)
    for b in (1, 8, 64, 256):
        for ctx in (1, 100, 4000, 60000):
            (k,) = K.mla_decode_kernels(sm.model, b, b * ctx, 8, sm.precision, 1, measured=True)
            roof = kernel_roofline_s(k.flops, k.bytes_moved, k.tiles, k.dtype, sm.hw)
            t = sm._decode_attention_s(b, b * ctx) / sm.model.num_layers
            assert t >= roof * (1 - 1e-9), (gpu, b, ctx)
    for n, q in ((1, 16), (4, 512), (2, 8192)):
        prefills = (K.PrefillChunk(q, 0, True),) * n
        k = K.attention_kernels(sm.model, K.BatchShape(prefills), 8, sm.precision, sm.mla_families)[-1]
        roof = kernel_roofline_s(k.flops, k.bytes_moved, k.tiles, k.dtype, sm.hw) * k.count
        assert sm._prefill_attention_s(prefills) - sm.kernel_time_s(
            K.attention_kernels(sm.model, K.BatchShape(prefills), 8, sm.precision, sm.mla_families)[0]
        ) >= roof * (1 - 1e-9), (gpu, n, q)


@needs_shared(MODULE_TABLES)
def test_the_bundled_fit_prices_the_shared_module_rows():
    model, hw = load_model(MLA_TABLE_MODEL), load_hardware("l40s")
    calib = load_calibration("l40s")
    bare = dataclasses.replace(calib, eta={k: v for k, v in calib.eta.items() if k not in MLA_FAMILIES})
    r = read_mla_rows(MODULE_TABLES, "generation", model, hw, bare)
    sel = fit_rows(r)
    assert sel.sum() > 1000 and not r.columns["serving"][r.columns["kernel"] != "TRITON_MLA"].any()
    rows = kernel_rows("mla_decode", r.fit_columns(sel))
    roof = roofline_rows_s(rows, hw)
    op = np.maximum(rows_time_s(calib, "mla_decode", rows, roof, hw), roof)
    err = (r.others_s[sel] + op) / r.module_s[sel] - 1.0
    assert np.mean(np.abs(err)) < 0.06                       # fitted on every one of these rows
    assert MLA_TABLE_SPEC == model.mla
