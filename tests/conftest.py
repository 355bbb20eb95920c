from __future__ import annotations

from pathlib import Path

import pytest

from kernelsight import profiles
from kernelsight.runtime import create_engine
from kernelsight.simcore.engine import Engine
from kernelsight.simcore.engine_config import EngineArgs, EngineConfig, build_step_model

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.fail(f"shared data not found at {SHARED_DATA} (CI checks it out beside the project)")
    return SHARED_DATA


def make_config(**kw) -> EngineConfig:
    from kernelsight.runtime import create_engine_config

    args = EngineArgs(**{"model": "meta-llama/Llama-3.1-8B", "hardware": "h100", "max_model_len": 8192, **kw})
    return create_engine_config(args)


def make_engine(per_token_events: bool = True, use_decode_group: bool = True, **kw) -> Engine:
    cfg = make_config(**kw)
    if use_decode_group:
        return create_engine(cfg, per_token_events=per_token_events)
    return Engine(cfg.scheduler, cfg.num_gpu_blocks, build_step_model(cfg), seed=cfg.args.seed,
                  per_token_events=per_token_events, use_decode_group=False)


@pytest.fixture(scope="session")
def llama8b():
    return profiles.load_model("meta-llama/Llama-3.1-8B")


@pytest.fixture(scope="session")
def h100():
    return profiles.load_hardware("h100")
