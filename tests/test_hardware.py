"""Bundled hardware profiles and the hardware loader."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from kernelsight.profiles import UnknownHardwareError, bundled_hardware_name, list_hardware, load_hardware
from kernelsight.simcore.hardware import HardwareSpec, hardware_spec_from_dict

NUMERIC_FIELDS = (
    "bf16_flops_per_s", "fp16_flops_per_s", "fp8_flops_per_s", "int8_ops_per_s", "fp4_flops_per_s",
    "mem_bytes_per_s", "mem_capacity_bytes", "num_sms", "l2_bytes", "boost_clock_hz",
    "intra_node_bytes_per_s", "pcie_bytes_per_s", "gpus_per_node",
)
REQUIRED_GPUS = ("a100-sxm", "h100-sxm", "h200-sxm", "b200-sxm", "l40s", "l4", "rtx-4090", "rtx-pro-6000",
                 "mi300x", "h100-pcie", "a100-pcie", "a30", "gb200", "b300-sxm", "gb300")


def test_required_gpus_are_bundled_and_sorted() -> None:
    names = list_hardware()
    assert set(REQUIRED_GPUS) <= set(names)
    assert names == sorted(names)


@pytest.mark.parametrize("name", list_hardware())
def test_every_bundled_profile_is_complete(name: str) -> None:
    hw = load_hardware(name)
    assert isinstance(hw, HardwareSpec) and hw.name == name
    assert hw.vendor in ("nvidia", "amd")
    for dtype in ("bf16", "fp16", "fp8", "int8", "fp4"):
        assert hw.peak_flops_per_s(dtype) > 1e12
    assert 1e11 < hw.mem_bytes_per_s < 2e13
    assert 16 * 2**30 < hw.mem_capacity_bytes < 300 * 2**30
    assert hw.num_sms > 0 and hw.l2_bytes > 0 and hw.gpus_per_node > 0
    assert 1e9 < hw.boost_clock_hz < 3e9
    assert hw.intra_node_bytes_per_s >= hw.pcie_bytes_per_s > 0
    # Dense, not sparse: low precision may be faster than bf16 but never by more than the 2x/4x steps.
    assert hw.fp16_flops_per_s == pytest.approx(hw.bf16_flops_per_s)
    assert hw.peak_flops_per_s("fp8") <= 2.05 * hw.bf16_flops_per_s  # L40S datasheet: 733 vs 362.05
    # Blackwell Ultra (sm 10.3) has ~1.5x Blackwell's NVFP4 rate: 6-6.2x its bf16 one (shared b300 / gb300 yaml)
    assert hw.peak_flops_per_s("fp4") <= (6.25 if hw.compute_capability == "10.3" else 4.05) * hw.bf16_flops_per_s
    for field in NUMERIC_FIELDS:   # every number (or its absence) must say where it came from
        assert hw.sources.get(field, "").strip(), f"{name}: no source for {field}"


@pytest.mark.parametrize(("name", "shared_yaml"), [
    ("a100-sxm", "a100_sxm"), ("a100-pcie", "a100_pcie"), ("a30", "a30"), ("h100-sxm", "h100_sxm"),
    ("h100-pcie", "h100_pcie"), ("h200-sxm", "h200_sxm"), ("b200-sxm", "b200_sxm"), ("l40s", "l40s"),
    ("l4", "l4"), ("rtx-pro-6000", "rtx_pro_6000_server"), ("gb200", "gb200"), ("b300-sxm", "b300_sxm"),
    ("gb300", "gb300"),
])
def test_matches_shared_yaml_datasheet_fields(name: str, shared_yaml: str, shared_data) -> None:
    """Bandwidth, capacity and bf16 peak come from shared/data/hardware (not its empirical factors)."""
    path = shared_data / "hardware" / f"{shared_yaml}.yaml"
    values = {}
    for line in path.read_text().splitlines():   # flat "key: number # comment" lines; no yaml dependency
        key, _, rest = line.strip().partition(":")
        token = rest.split("#")[0].strip()
        if token.replace(".", "").isdigit():
            values[key] = float(token)
    hw = load_hardware(name)
    assert hw.mem_bytes_per_s == values["mem_bw"]
    assert hw.mem_capacity_bytes == values["mem_capacity"]
    assert hw.bf16_flops_per_s == pytest.approx(values["bfloat16_tc_flops"])
    assert hw.intra_node_bytes_per_s == values["intra_node_bw"]
    assert hw.compute_capability == f"{int(values['sm_version']) // 10}.{int(values['sm_version']) % 10}"
    assert "aiconfigurator" in hw.sources["mem_bytes_per_s"]


def test_every_system_of_the_shared_hardware_list_has_a_profile(shared_data) -> None:
    """Kernel folders and --hardware names spelt like the shared yamls (b300_sxm, rtx_pro_6000_server) resolve."""
    stems = sorted(p.stem for p in (shared_data / "hardware").glob("*.yaml"))
    assert len(stems) >= 13
    resolved = {stem: load_hardware(stem).name for stem in stems}
    assert resolved["b300_sxm"] == "b300-sxm" and resolved["rtx_pro_6000_server"] == "rtx-pro-6000"
    assert len(set(resolved.values())) == len(stems)   # one profile per system
    assert {stem: bundled_hardware_name(stem) for stem in stems} == resolved
    assert bundled_hardware_name("NVIDIA H100 80GB HBM3") == "h100-sxm" and bundled_hardware_name("h20") is None


@pytest.mark.parametrize(("alias", "canonical"), [
    ("h100", "h100-sxm"), ("H100", "h100-sxm"), ("h100_sxm", "h100-sxm"), ("H100-SXM", "h100-sxm"),
    ("a100", "a100-sxm"), ("A100_SXM", "a100-sxm"), ("a100_pcie", "a100-pcie"),
    ("h200", "h200-sxm"), ("b200", "b200-sxm"), ("L40S", "l40s"), ("l4", "l4"),
    ("4090", "rtx-4090"), ("rtx4090", "rtx-4090"), ("RTX_4090", "rtx-4090"),
    ("NVIDIA GeForce RTX 4090", "rtx-4090"), ("NVIDIA H100 80GB HBM3", "h100-sxm"),
    ("mi300x", "mi300x"), ("MI300X", "mi300x"),
    ("rtx-pro-6000", "rtx-pro-6000"), ("rtxpro6000", "rtx-pro-6000"), ("pro6000", "rtx-pro-6000"),
])
def test_aliases_are_case_and_separator_insensitive(alias: str, canonical: str) -> None:
    assert load_hardware(alias).name == canonical


def test_l4_and_l40s_do_not_collide() -> None:
    assert load_hardware("l4").num_sms != load_hardware("l40s").num_sms


@pytest.mark.parametrize(("name", "bf16_flops_per_s"),
                         [("a100-sxm", 312e12), ("a100-pcie", 312e12), ("a30", 165e12)])
def test_fp8_falls_back_to_bf16_on_ampere(name: str, bf16_flops_per_s: float) -> None:
    hw = load_hardware(name)
    assert hw.fp8_flops_per_s is None and hw.fp4_flops_per_s is None
    assert hw.peak_flops_per_s("fp8") == hw.peak_flops_per_s("fp4") == bf16_flops_per_s


def test_specific_numbers() -> None:
    h100 = load_hardware("h100")
    assert (h100.bf16_flops_per_s, h100.fp8_flops_per_s, h100.num_sms) == (989e12, 1978e12, 132)
    assert h100.mem_capacity_bytes == 85899345920 and h100.compute_capability == "9.0"
    rtx = load_hardware("rtx-4090")
    assert rtx.mem_capacity_bytes == 25250627584 and "meta.json" in rtx.sources["mem_capacity_bytes"]
    assert rtx.compute_capability == "8.9"
    assert load_hardware("b200").fp4_flops_per_s == 9000e12
    mi = load_hardware("mi300x")
    assert mi.vendor == "amd" and mi.compute_capability == "gfx942" and mi.num_sms == 304


@pytest.mark.parametrize("bad", ["h900", "", "a100-sxm-pro", "missing.json"])
def test_unknown_hardware_lists_bundled_names(bad: str) -> None:
    with pytest.raises(UnknownHardwareError) as err:
        load_hardware(bad)
    assert isinstance(err.value, ValueError)
    for name in list_hardware():
        assert name in str(err.value)


def test_load_from_json_path_roundtrips(tmp_path: Path) -> None:
    spec = asdict(load_hardware("l40s"))
    spec.update(name="my-l40s", mem_bytes_per_s=900e9, aliases=["x"])
    path = tmp_path / "custom.json"
    path.write_text(json.dumps(spec))
    hw = load_hardware(str(path))
    assert hw.name == "my-l40s" and hw.mem_bytes_per_s == 900e9 and hw.aliases == ("x",)
    assert hw.num_sms == 142


def test_from_dict_rejects_missing_unknown_and_nonpositive_fields() -> None:
    base = asdict(load_hardware("h100"))
    with pytest.raises(ValueError, match="missing required"):
        hardware_spec_from_dict({k: v for k, v in base.items() if k != "num_sms"})
    with pytest.raises(ValueError, match="unknown fields"):
        hardware_spec_from_dict({**base, "bf16_flops": 1.0})
    with pytest.raises(ValueError, match="positive"):
        hardware_spec_from_dict({**base, "mem_bytes_per_s": 0})
    with pytest.raises(ValueError, match="integer"):
        hardware_spec_from_dict({**base, "num_sms": 131.5})
    spec = hardware_spec_from_dict({**base, "fp8_flops_per_s": None, "_comment": "ignored"})
    assert spec.peak_flops_per_s("fp8") == spec.bf16_flops_per_s


def test_inline_ecc_takes_its_share_of_dram_bandwidth() -> None:
    """The L40S's GDDR6 runs inline ECC (the driver reports 15/16 of 48 GiB): kernels see 15/16 of the datasheet
    bandwidth, the profile keeps the datasheet figure; HBM parts and the ECC-off RTX 4090 lose nothing."""
    from kernelsight.simcore.roofline import kernel_roofline_s

    l40s = load_hardware("l40s")
    assert l40s.mem_capacity_bytes / 2**20 == pytest.approx(48 * 1024 * (1 - l40s.ecc_dram_fraction), abs=16)
    assert l40s.mem_bytes_per_s == 864e9 and l40s.usable_mem_bytes_per_s == pytest.approx(864e9 * 15 / 16)
    for name in ("h100-sxm", "a100-sxm", "rtx-4090"):
        hw = load_hardware(name)
        assert hw.usable_mem_bytes_per_s == hw.mem_bytes_per_s
    # a memory-bound kernel's roofline moves with it
    assert kernel_roofline_s(1.0, 1e9, 1, "bf16", l40s) == pytest.approx(1e9 / (864e9 * 15 / 16))
    base = asdict(l40s)
    for bad in (-0.1, 0.5, True, "1/16"):
        with pytest.raises(ValueError, match="ecc_dram_fraction"):
            hardware_spec_from_dict({**base, "ecc_dram_fraction": bad})
