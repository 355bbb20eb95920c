"""Turn engine arguments into a ready engine: load the profiles named by the arguments, then resolve."""

from __future__ import annotations

from kernelsight import profiles
from kernelsight.simcore.engine import Engine
from kernelsight.simcore.engine_config import EngineArgs, EngineConfig, build_step_model, resolve_engine_config


def create_engine_config(args: EngineArgs) -> EngineConfig:
    """Load model, hardware and calibration profiles and resolve vLLM's defaults.

    Raises ValueError subclasses with a one-line explanation on any bad argument.
    """
    model = profiles.load_model(args.model)
    hw = profiles.load_hardware(args.hardware)
    calib = profiles.load_calibration(hw.name, args.calibration)
    return resolve_engine_config(args, model, hw, calib)


def create_engine(config: EngineConfig, per_token_events: bool = True) -> Engine:
    return Engine(config.scheduler, config.num_gpu_blocks, build_step_model(config), seed=config.args.seed,
                  per_token_events=per_token_events)
