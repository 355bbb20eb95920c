"""DeepSeek's multi-token-prediction (MTP) module as kernels, for speculative decoding's draft cost.

Each of a checkpoint's ``num_nextn_predict_layers`` modules (vLLM's ``DeepSeekMultiTokenPredictorLayer``) runs,
per draft token: the embedding of the previous token and the target's hidden state, each RMS-normed (``enorm``,
``hnorm``), concatenated and projected back to the hidden size (``eh_proj``, 2h → h), then one decoder layer of the
model's own kind (MLA attention and a MoE MLP for DeepSeek-V3/R1), the final norm and the shared LM head.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kernelsight.simcore.kernel_shapes import NORM, BatchShape, Kernel, elementwise_kernel, gemm_kernel
from kernelsight.simcore.kernels import FAMILIES, FAMILY_INDEX, attention_kernels, row_kernels, sampling_kernels
from kernelsight.simcore.model_spec import ModelSpec
from kernelsight.simcore.precision import Precision
from kernelsight.simcore.step_model import StepModel


def mtp_layer_model(model: ModelSpec) -> ModelSpec:
    """The model seen by one MTP module: one decoder layer, MoE when the model's layers are."""
    return dataclasses.replace(model, num_layers=1, num_moe_layers=1 if model.is_moe else 0,
                               num_sliding_layers=None, num_chunked_layers=0)


def mtp_step_kernels(model: ModelSpec, batch: BatchShape, tp: int, precision: Precision,
                     padded_tokens: int | None = None) -> list[Kernel]:
    """Every kernel of one MTP module's forward pass over ``batch`` (its rows are the draft positions)."""
    if not model.num_mtp_layers:
        raise ValueError(f"{model.name} has no MTP layers (num_nextn_predict_layers)")
    m = padded_tokens if padded_tokens is not None else batch.num_tokens
    one = mtp_layer_model(model)
    return (mtp_input_kernels(model, m, precision) + row_kernels(one, m, tp, precision)
            + attention_kernels(one, batch, tp, precision)
            + sampling_kernels(model, batch.num_sampling_rows, tp, precision))


def mtp_input_kernels(model: ModelSpec, m: int, precision: Precision) -> list[Kernel]:
    """What an MTP module runs over its ``m`` rows before its decoder layer, and a plain decoder layer does not:
    ``enorm`` and ``hnorm`` and the ``eh_proj`` projection of their concatenation (2h → h). vLLM builds ``eh_proj``
    as a plain ``nn.Linear`` (deepseek_mtp.py): replicated on every TP rank and never quantized, so it is a bf16 GEMM
    whatever the checkpoint's format (like the LM head)."""
    h, a = model.hidden_size, precision.act_bytes
    return [elementwise_kernel("mtp_enorm", NORM, 3.0 * m * h * a, precision.gemm_compute_dtype),
            elementwise_kernel("mtp_hnorm", NORM, 3.0 * m * h * a, precision.gemm_compute_dtype),
            gemm_kernel("mtp_eh_proj", m, h, 2 * h, "bf16", 2.0, a)]


class MTPStepModel(StepModel):
    """The drafter of method 'mtp': one MTP module's forward pass (:func:`mtp_step_kernels`). Its model is the module's
    one decoder layer with the target's embedding, final norm and LM head (``spec_decode_step.one_layer_draft``); the
    token-parallel part adds :func:`mtp_input_kernels` over the same padded rows, so every path that prices the draft
    (its first pass over the step's tokens, the sequential passes after it) prices the whole module."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._mtp_input_cache: dict[int, tuple[np.ndarray, float]] = {}

    def mtp_input_s(self, m_padded: int) -> tuple[np.ndarray, float]:
        """(seconds per family, their sum) of :func:`mtp_input_kernels` over ``m_padded`` rows."""
        got = self._mtp_input_cache.get(m_padded)
        if got is None:
            arr = np.zeros(len(FAMILIES))
            for k in mtp_input_kernels(self.model, m_padded, self.precision):
                arr[FAMILY_INDEX[k.family]] += self.kernel_time_s(k)
            got = self._mtp_input_cache[m_padded] = (arr, float(arr.sum()))
        return got

    def _token_part(self, m_padded: int, sampling_rows: int) -> tuple[np.ndarray, float]:
        out, total_s = super()._token_part(m_padded, sampling_rows)
        extra, extra_s = self.mtp_input_s(m_padded)
        return out + extra, total_s + extra_s
