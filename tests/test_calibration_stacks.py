"""A calibration belongs to a GPU and a software stack: the bundled stacks, which one prices a vLLM release, and how
the reports say so."""

from __future__ import annotations

import dataclasses

import pytest

from kernelsight import profiles
from kernelsight.calibrate.evaluate import bundled_calibration_dir, bundled_calibrations, other_stack_dirs
from kernelsight.calibrate.measurements import measurement_software
from kernelsight.cli import main
from kernelsight.engine_args import create_engine_config
from kernelsight.simcore.calibration import stack_note, vllm_release
from kernelsight.simcore.engine_config import EngineArgs

PRO = "rtx-pro-6000"


def test_vllm_release_orders_releases_and_refuses_merged_records():
    assert vllm_release("0.19.0") == vllm_release("0.19") == vllm_release("v0.19.0") == (0, 19)
    assert vllm_release("0.11.0rc1") == (0, 11) and vllm_release("0.10.1+cu128") == (0, 10, 1)
    assert vllm_release("0.9.2") < vllm_release("0.19.0") < vllm_release("0.24.0")
    assert vllm_release("0.14.0 / 0.24.0") is None and vllm_release("") is None and vllm_release(None) is None


STACKS = [("0.24.0", "g.json"), ("0.19.0", "g@vllm-0.19.0.json"), ("0.12.1", "g@vllm-0.12.1.json")]


@pytest.mark.parametrize(("asked", "picked"), [
    (None, "g.json"),                    # the default: the GPU's default file
    ("0.19.0", "g@vllm-0.19.0.json"),    # timed under it
    ("0.19", "g@vllm-0.19.0.json"),      # the same release, written shorter
    ("0.21.3", "g@vllm-0.19.0.json"),    # the newest timed under an older release
    ("0.30.0", "g.json"),
    ("0.13.0", "g@vllm-0.12.1.json"),
    ("0.10.0", "g@vllm-0.12.1.json"),    # older than every stack: the oldest
    ("main", "g.json"),                  # names no release: the default
])
def test_pick_calibration_stack(asked, picked):
    assert profiles.pick_calibration_stack(STACKS, asked)[1] == picked


def test_a_cross_generation_calibration_prices_every_release_when_it_is_the_only_one():
    only = [("0.14.0 / 0.24.0", "g.json")]
    assert profiles.pick_calibration_stack(only, "0.19.0") == only[0]
    assert profiles.pick_calibration_stack([], "0.19.0") is None


def test_the_rtx_pro_6000_ships_both_stacks_and_the_newest_is_the_default():
    stacks = profiles.calibration_stacks(PRO)
    assert [v for v, _ in stacks] == ["0.24.0", "0.19.0"]
    assert profiles.load_calibration(PRO).software["vllm"] == "0.24.0"
    old = profiles.load_calibration("pro6000", vllm_version="0.19.0")
    assert old.software["vllm"] == "0.19.0" and old.tier == "target-measured" and old.hardware == PRO
    # the two stacks ran other kernels: the fits differ
    assert old.eta["attn_prefill"].to_dict() != profiles.load_calibration(PRO).eta["attn_prefill"].to_dict()
    # a GPU is listed once however many stacks it ships
    assert profiles.list_calibrations().count(PRO) == 1


def test_every_gpus_default_calibration_is_its_newest_stack():
    for name in profiles.list_calibrations():
        stacks = profiles.calibration_stacks(name)
        assert stacks[0][1] == profiles.calibration_file_name(name)
        releases = [r for v, _ in stacks if (r := vllm_release(v)) is not None]
        if releases:
            assert vllm_release(stacks[0][0]) == max(releases), name


def test_bundled_calibrations_hold_one_per_gpu():
    """The cross-generation transfer reads these: another stack of a source GPU must not count twice."""
    names = [c.hardware for c in bundled_calibrations(None)]
    assert len(names) == len(set(names))


def test_stack_note_says_when_the_kernels_were_timed_under_another_release():
    calib = profiles.load_calibration(PRO, vllm_version="0.19.0")
    assert stack_note(calib, None) is None and stack_note(calib, "0.19") is None
    note = stack_note(calib, "0.21.0")
    assert note is not None and "vLLM 0.21.0" in note and "vLLM 0.19.0" in note
    cross = profiles.load_calibration("h200-sxm")
    assert "other GPUs' kernels" in stack_note(cross, "0.19.0")
    assert "unrecorded" in stack_note(dataclasses.replace(calib, software={}), "0.19.0")


def test_engine_config_reports_the_stack():
    cfg = create_engine_config(EngineArgs(hardware=PRO, vllm_version="0.19.0", max_model_len=4096))
    s = cfg.summary()
    assert s["calibration_vllm"] == "0.19.0" and s["vllm_version"] == "0.19.0" and "calibration_note" not in s
    assert cfg.calibration_label(s) == "target-measured, vLLM 0.19.0"
    s = create_engine_config(EngineArgs(hardware=PRO, vllm_version="0.22.1", max_model_len=4096)).summary()
    assert s["calibration_vllm"] == "0.19.0" and "0.22.1" in s["calibration_note"]
    s = create_engine_config(EngineArgs(hardware=PRO, max_model_len=4096)).summary()
    assert s["calibration_vllm"] == "0.24.0" and "vllm_version" not in s


def test_the_two_stacks_price_the_same_step_differently():
    """The 0.19 stack ran other attention kernels (FlashInfer / FlashAttention) than 0.24's: the price moves."""
    from kernelsight.simcore.engine_config import build_step_model
    from kernelsight.simcore.kernel_shapes import BatchShape, PrefillChunk

    batch = BatchShape(prefills=(PrefillChunk(512, 0, True),), num_decodes=32, decode_context_tokens=32 * 1024)

    def step_s(version: str) -> float:
        cfg = create_engine_config(EngineArgs(hardware=PRO, vllm_version=version, max_model_len=4096))
        return build_step_model(cfg).step_time_s(batch)

    assert step_s("0.19.0") != step_s("0.24.0")


def test_simulate_and_profiles_name_the_stack(capsys):
    assert main(["simulate", "--hardware", PRO, "--vllm-version", "0.21", "--num-prompts", "4",
                 "--max-model-len", "4096", "--random-input-len", "64", "--random-output-len", "8"]) == 0
    out = capsys.readouterr().out
    assert "calibration: target-measured, vLLM 0.19.0" in out
    assert "no calibration of rtx-pro-6000 was timed under vLLM 0.21" in out
    assert main(["profiles"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.strip().startswith(PRO))
    assert "target-measured (vLLM 0.24.0, default); target-measured (vLLM 0.19.0)" in line


def test_plan_passes_the_release_to_every_engine():
    from kernelsight.plan.prune import create_engine_config as plan_config

    cfg = plan_config(EngineArgs(hardware=PRO, vllm_version="0.19.0", max_model_len=4096))
    assert cfg.calibration.software["vllm"] == "0.19.0"
    assert plan_config(EngineArgs(hardware=PRO, max_model_len=4096)).calibration.software["vllm"] == "0.24.0"


def test_each_other_stack_folder_has_its_bundled_calibration(shared_data):
    stacks = other_stack_dirs(shared_data / "kernels")
    assert stacks, "the shared data holds the RTX PRO 6000 under vLLM 0.19.0"
    for folder, (name, version) in stacks.items():
        path = bundled_calibration_dir() / profiles.calibration_file_name(name, version)
        calib = profiles.read_calibration_file(path)
        assert calib.software == measurement_software(shared_data / "kernels" / folder)
        assert calib.software["vllm"] == version and calib.tier == "target-measured"


def test_validate_prices_a_run_with_its_own_release(shared_data):
    """The run's meta.json names vLLM 0.19.0: its GPU's 0.19 calibration prices it, without a flag."""
    from kernelsight.loadgen.validate import validate_run

    run = shared_data / "e2e" / "llmservingsim_rtxpro6000_llama31_8b"
    v = validate_run(run, hardware=PRO)
    assert v.result["config"]["calibration_vllm"] == "0.19.0" and v.result["software"]["differs"] == []
    tpot = next(r for r in v.result["latency"] if r["metric"] == "tpot" and r["stat"] == "mean")
    assert abs(tpot["error_pct"]) < 2.0
    other = validate_run(run, hardware=PRO, vllm_version="0.24.0")
    assert other.result["config"]["calibration_vllm"] == "0.24.0" and other.result["software"]["differs"] == ["vllm"]
