"""DeepSeek's multi-token-prediction (MTP) module as kernels, for speculative decoding's draft cost.

Each of a checkpoint's ``num_nextn_predict_layers`` modules (vLLM's ``DeepSeekMultiTokenPredictorLayer``) runs,
per draft token: the embedding of the previous token and the target's hidden state, each RMS-normed (``enorm``,
``hnorm``), concatenated and projected back to the hidden size (``eh_proj``, 2h → h), then one decoder layer of the
model's own kind (MLA attention and a MoE MLP for DeepSeek-V3/R1), the final norm and the shared LM head.
"""

from __future__ import annotations

import dataclasses

from kernelsight.simcore.kernel_shapes import NORM, BatchShape, Kernel, elementwise_kernel, linear_kernel
from kernelsight.simcore.kernels import attention_kernels, row_kernels, sampling_kernels
from kernelsight.simcore.model_spec import ModelSpec
from kernelsight.simcore.precision import Precision


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
    h, a = model.hidden_size, precision.act_bytes
    out = [elementwise_kernel("mtp_enorm", NORM, 3.0 * m * h * a, precision.gemm_compute_dtype),
           elementwise_kernel("mtp_hnorm", NORM, 3.0 * m * h * a, precision.gemm_compute_dtype),
           linear_kernel("mtp_eh_proj", m, h, 2 * h, precision)]
    return (out + row_kernels(one, m, tp, precision) + attention_kernels(one, batch, tp, precision)
            + sampling_kernels(model, batch.num_sampling_rows, tp, precision))
