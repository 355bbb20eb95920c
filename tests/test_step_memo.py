"""The step model's memo tables, shared through the calibration: a StepModel priced after another one on the same
calibration must give exactly what it gives alone, whatever the other one's configuration was."""

from __future__ import annotations

import dataclasses

from conftest import make_config

from kernelsight.simcore.kernels import BatchShape, PrefillChunk
from kernelsight.simcore.step_model import StepConfig, StepModel

BATCHES = (
    BatchShape((), 61, 61 * 900),         # padded to 64 rows under CUDA graphs, 61 eagerly
    BatchShape((), 3, 3 * 500),           # small: launch time exposed
    BatchShape((PrefillChunk(700, 0, True),), 40, 40 * 1200),
    BatchShape((PrefillChunk(2048, 512, False), PrefillChunk(300, 0, True)), 0, 0),
)


def _steps(sm: StepModel) -> list[tuple[list[float], float]]:
    out = []
    for batch in BATCHES:
        breakdown, total = sm.step(batch)
        out.append((breakdown.tolist(), total))
    out.append((*sm.decode_window(61, 61 * 900, 9)[1].tolist(), sum(sm.decode_window(61, 61 * 900, 9)[0])))
    return out


def test_a_step_model_prices_alike_after_another_configuration_filled_the_shared_tables():
    cfg = make_config()
    calib, model, hw, precision = cfg.calibration, cfg.model, cfg.hardware, cfg.precision
    graphs = StepConfig(tp=1, cudagraph_capture_sizes=cfg.cudagraph_capture_sizes)
    eager = StepConfig(tp=1, cudagraph_capture_sizes=cfg.cudagraph_capture_sizes, enforce_eager=True)
    tp2 = StepConfig(tp=2, cudagraph_capture_sizes=cfg.cudagraph_capture_sizes)

    def alone(config: StepConfig) -> list:
        # a fresh copy of the calibration starts with empty memos (its fields are the same objects)
        return _steps(StepModel(model, hw, dataclasses.replace(calib), precision, config))

    shared = dataclasses.replace(calib)
    first = _steps(StepModel(model, hw, shared, precision, graphs))
    # eager mode and TP 2 change the token-parallel part (launch, all-reduce, per-GPU shapes): a table keyed by
    # less than the whole configuration would hand them the CUDA-graph TP 1 numbers
    assert _steps(StepModel(model, hw, shared, precision, eager)) == alone(eager) != first
    assert _steps(StepModel(model, hw, shared, precision, tp2)) == alone(tp2) != first
    again = StepModel(model, hw, shared, precision, graphs)
    assert again._row_cache, "the second engine on a calibration starts from the first one's tables"
    assert _steps(again) == first == alone(graphs)


def test_subclasses_keep_private_tables():
    cfg = make_config()
    graphs = StepConfig(tp=1, cudagraph_capture_sizes=cfg.cudagraph_capture_sizes)
    calib = dataclasses.replace(cfg.calibration)
    plain = StepModel(cfg.model, cfg.hardware, calib, cfg.precision, graphs)
    plain.step(BATCHES[0])

    class Priced(StepModel):      # a subclass may price a kernel its own way: it must not read the plain tables
        pass

    sub = Priced(cfg.model, cfg.hardware, calib, cfg.precision, graphs)
    assert not sub._row_cache and sub._row_cache is not plain._row_cache
