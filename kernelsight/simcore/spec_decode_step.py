"""A step with speculative decoding: the target verifies ``1 + k`` tokens per decoding request, then the drafter runs.

Verification: each decoding request computes its bonus token plus its draft tokens, so the token-parallel kernels
see ``num_decodes · (1 + k)`` decode rows (a small-m GEMM load), the LM head and sampler run over every verified
position (the rejection sampler needs the target's logits at each), and attention reads each request's KV once for
its ``1 + k`` query tokens (:func:`verify_attention_s`).

Drafting (vLLM's EAGLE / draft-model proposers): a first pass of the draft over every token the target computed
this step (it needs their hidden states or tokens, prompts included), then ``k - 1`` sequential passes over one row
per request that sampled. The draft is priced by its own :class:`StepModel` from its own model spec: the draft
model's, or one decoder layer of the target's shape for an EAGLE head (and for each MTP layer: the target's
``num_nextn_predict_layers``). The n-gram proposer has no GPU cost, only host time per request.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from kernelsight.simcore import kernels as K
from kernelsight.simcore.kernels import FAMILY_INDEX, BatchShape
from kernelsight.simcore.model_spec import ModelSpec
from kernelsight.simcore.spec_decode import NGRAM, NGRAM_HOST_S_PER_REQUEST, SpecDecodeStats, SpeculativeConfig
from kernelsight.simcore.step_model import StepModel

_I_HOST = FAMILY_INDEX[K.HOST]
_I_MOE = FAMILY_INDEX[K.MOE_GEMM]
_I_ATTN_PREFILL = FAMILY_INDEX[K.ATTN_PREFILL]
_I_ATTN_DECODE = FAMILY_INDEX[K.ATTN_DECODE]


def mtp_layers(model: ModelSpec) -> int:
    """The target's MTP modules (``num_nextn_predict_layers`` of its config.json, ``ModelSpec.num_mtp_layers``): the
    method 'mtp' needs at least one (DeepSeek-V3/R1 and the like)."""
    return model.num_mtp_layers


#: The draft vocabulary of the published EAGLE-3 heads (``draft_vocab_size`` in their config.json, e.g.
#: yuhuili/EAGLE3-LLaMA3.1-Instruct-8B): their LM head maps onto the target's vocabulary through a table.
EAGLE3_DRAFT_VOCAB = 32000


def one_layer_draft(target: ModelSpec, num_layers: int = 1, vocab_size: int | None = None) -> ModelSpec:
    """An EAGLE head or MTP module priced as ``num_layers`` decoder layers of the target's shape (+ LM head over
    ``vocab_size``, default the target's)."""
    # one layer of the target's kind: no sliding-window or chunked-local split to carry (as mtp.mtp_layer_model)
    return replace(target, name=f"{target.name} (draft head)", num_layers=num_layers,
                   num_moe_layers=min(target.num_moe_layers, num_layers),
                   vocab_size=min(vocab_size or target.vocab_size, target.vocab_size),
                   num_sliding_layers=None, num_chunked_layers=0)


def verify_step(sm: StepModel, batch: BatchShape, sampling_rows: int) -> tuple[np.ndarray, float]:
    """``sm``'s forward pass over a batch whose decodes compute ``1 + drafts`` tokens each."""
    prefills, num_decodes = batch.prefills, batch.num_decodes
    num_tokens = num_decodes + batch.num_spec_tokens + sum(p.num_new_tokens for p in prefills)
    mode, m_padded = sm._graph_mode(num_tokens, not prefills)
    out, base_s = sm._token_part(m_padded, sampling_rows)
    attn_s = 0.0
    if prefills:
        t = sm._prefill_attention_s(prefills)
        out[_I_ATTN_PREFILL] += t
        attn_s += t
    if num_decodes:
        t = verify_attention_s(sm, num_decodes, batch.decode_context_tokens, batch.num_spec_tokens)
        out[_I_ATTN_DECODE] += t
        attn_s += t
    return sm._finish(out, base_s + attn_s, mode, num_decodes + len(prefills), num_tokens)


def verify_attention_s(sm: StepModel, num_decodes: int, context_tokens: int, num_spec_tokens: int) -> float:
    """Attention of decodes that each verify ``1 + drafts`` query tokens: vLLM's backends run them as decodes
    (FlashAttention / FlashInfer pack a sequence's query tokens with its GQA group, as extra query heads over the
    same KV), so it is the decode kernel with ``q_len`` times the query heads: the KV is read once, the FLOPs and
    query bytes grow with ``q_len``. (The prefill kernel's η is fitted on chunks of many tokens, not on 2-8.)"""
    m, tp, p = sm.model, sm.config.tp, sm.precision
    q_len = 1 + num_spec_tokens / num_decodes
    q_heads = max(round(m.num_attention_heads // tp * q_len), 1)
    k = K.attention_decode_kernel(num_decodes, context_tokens, q_heads, max(m.num_kv_heads // tp, 1), m.head_dim,
                                  p.act_bytes, p.kv_bytes_per_element, m.num_layers, m.sliding_window)
    return sm.kernel_time_s(k)


class SpecStepModel(StepModel):
    """A :class:`StepModel` for batches that carry draft tokens (``BatchShape.num_spec_tokens``), plus the drafter.

    ``drafter`` is the draft's own step model (None: n-gram, priced as host time). The time of the last step's
    verification, drafting and of the same batch without speculation are kept for the report's speedup.
    """

    def __init__(self, *args, spec: SpeculativeConfig, drafter: StepModel | None = None,
                 baseline: StepModel | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.spec = spec
        self.drafter = drafter
        # the same target without speculation (its own CUDA-graph sizes): prices the report's counterfactual
        self.baseline = baseline
        self.verify_s = 0.0          # Σ over steps: the target's part
        self.draft_s = 0.0           # Σ over steps: the drafter's part
        # over decode-only steps with drafts: their time (verification + drafting), the same batches' time without
        # draft tokens, and how many there were
        self.spec_s = 0.0
        self.baseline_s = 0.0
        self.num_decode_steps = 0
        # the last step's own MoE-GEMM seconds (verification, drafting) and, for a decode-only step, its plain
        # counterfactual's (MoE seconds, padded rows): what regroup swaps for a data-parallel MoE group's
        self._last_moe_s = (0.0, 0.0)
        self._last_plain: tuple[float, int] | None = None

    def step(self, batch: BatchShape) -> tuple[np.ndarray, float]:
        self._last_plain = None
        if batch.num_spec_tokens:
            out, total = verify_step(self, batch, batch.num_sampling_rows)
            if not batch.prefills:
                plain = replace(batch, num_spec_tokens=0)
                base = self.baseline if self.baseline is not None else self
                plain_out, plain_s = base.step(plain) if base is not self else StepModel.step(self, plain)
                self.baseline_s += plain_s
                self._last_plain = (float(plain_out[_I_MOE]),
                                    StepModel._graph_mode(base, plain.num_tokens, plain.is_decode_only)[1])
        else:
            out, total = StepModel.step(self, batch)
        self.verify_s += total
        draft_out, draft_s = self.draft(batch)
        self.draft_s += draft_s
        self._last_moe_s = (float(out[_I_MOE]), float(draft_out[_I_MOE]))
        if batch.num_spec_tokens and not batch.prefills:
            self.spec_s += total + draft_s
            self.num_decode_steps += 1
        return out + draft_out, total + draft_s

    @property
    def last_plain_rows(self) -> int | None:
        """Padded rows of the last step's counterfactual without drafts (None: not a decode-only verify step)."""
        return self._last_plain[1] if self._last_plain is not None else None

    def regroup(self, verify_group_s: float, draft_group_s: float, plain_group_s: float | None) -> None:
        """Re-count the last step as a data-parallel MoE group ran it: its verification's and its drafting's MoE
        GEMMs (own rows, :meth:`step`) replaced by the group's seconds for them (MoE GEMMs at the group's size plus
        dispatch/combine), and so its plain counterfactual's (``plain_group_s``, for a decode-only step), so that
        the summary's drafting share and estimated speedup are the group's."""
        v_own, d_own = self._last_moe_s
        dv, dd = verify_group_s - v_own, draft_group_s - d_own
        self.verify_s += dv
        self.draft_s += dd
        if self._last_plain is not None and plain_group_s is not None:
            self.spec_s += dv + dd
            self.baseline_s += plain_group_s - self._last_plain[0]

    def summary(self) -> dict[str, float]:
        """Seconds spent verifying and drafting, and the decode-only verification steps' time against the same
        batches without draft tokens (what one step of them costs without speculation)."""
        return {"verify_s": self.verify_s, "draft_s": self.draft_s, "decode_steps": self.num_decode_steps,
                "decode_steps_s": self.spec_s, "same_decode_batches_without_spec_s": self.baseline_s}

    def draft_passes(self, batch: BatchShape) -> list[tuple[StepModel, int]]:
        """The drafter's forward passes of this step as (its step model, padded rows), in the order :meth:`draft`
        prices them: a data-parallel MoE group runs each one across its ranks (vLLM pads every draft pass to the
        group's largest rank, as it does the target's pass), so the group prices their MoE layers and all-to-alls.
        None for n-gram (no GPU pass) or a step with no request to draft for."""
        d = self.drafter
        num_requests = batch.num_decodes + sum(1 for p in batch.prefills if p.samples)
        if not num_requests or self.spec.method == NGRAM or d is None:
            return []
        passes = [(d, d._graph_mode(batch.num_tokens, not batch.prefills)[1])]
        return passes + [(d, d._graph_mode(num_requests, True)[1])] * (self.spec.num_speculative_tokens - 1)

    def draft(self, batch: BatchShape) -> tuple[np.ndarray, float]:
        """The proposer's time after the target's pass: host time for n-gram, else the draft's passes."""
        num_requests = batch.num_decodes + sum(1 for p in batch.prefills if p.samples)
        out = np.zeros(len(K.FAMILIES))
        if not num_requests:
            return out, 0.0
        if self.spec.method == NGRAM or self.drafter is None:
            host_s = NGRAM_HOST_S_PER_REQUEST * num_requests
            out[_I_HOST] = host_s
            return out, host_s
        d = self.drafter
        # the first pass over every token of the step: one sampled row per request. The passes run inside the step
        # the target's host work already paid for (vLLM's proposer is called by the same execute_model), so only
        # their kernels and launches count
        first, total = verify_step(d, batch, num_requests) if batch.num_spec_tokens else d.step(batch)
        out += first
        total -= first[_I_HOST]
        k = self.spec.num_speculative_tokens
        if k > 1:
            ctx = batch.decode_context_tokens + sum(p.num_cached_tokens + p.num_new_tokens for p in batch.prefills
                                                    if p.samples)
            more, t = d.step(BatchShape((), num_requests, ctx + num_requests))
            out += more * (k - 1)
            total += (t - more[_I_HOST]) * (k - 1)
        out[_I_HOST] = 0.0
        return out, total


def spec_decode_summary(engines: list) -> dict[str, Any] | None:
    """Speculative decoding over engines (``Engine`` objects; None without it): vLLM's counters, the measured mean
    acceptance length and per-position rates, and the decode speedup estimated step for step over the decode-only
    steps: mean acceptance length × the same batches' time without drafts / their time with them (a mixed step's
    prefill is not sped up, and in a prefill-bound run the end-to-end gain is far smaller: benchmarks/spec_decode.py
    prints both)."""
    parts = [(e.spec_decoder.stats, e.step_model) for e in engines if e.spec_decoder is not None]
    if not parts:
        return None
    k = parts[0][0].num_spec_tokens
    total = SpecDecodeStats(k)
    times = {"verify_s": 0.0, "draft_s": 0.0, "decode_steps": 0, "decode_steps_s": 0.0,
             "same_decode_batches_without_spec_s": 0.0}
    for st, sm in parts:
        total.num_drafts += st.num_drafts
        total.num_draft_tokens += st.num_draft_tokens
        total.num_accepted_tokens += st.num_accepted_tokens
        total.num_accepted_tokens_per_pos = [a + b for a, b in zip(total.num_accepted_tokens_per_pos,
                                                                    st.num_accepted_tokens_per_pos, strict=True)]
        if isinstance(sm, SpecStepModel):
            for key, v in sm.summary().items():
                times[key] += v
    length = total.mean_acceptance_length
    speedup = (length * times["same_decode_batches_without_spec_s"] / times["decode_steps_s"]
               if times["decode_steps_s"] > 0 else None)
    return {"num_drafts": total.num_drafts, "num_draft_tokens": total.num_draft_tokens,
            "num_accepted_tokens": total.num_accepted_tokens,
            "num_accepted_tokens_per_pos": total.num_accepted_tokens_per_pos,
            "mean_acceptance_length": round(length, 4),
            "acceptance_rate_per_pos": [round(r, 4) for r in total.acceptance_rates()],
            "draft_acceptance_rate": round(total.num_accepted_tokens / max(total.num_draft_tokens, 1), 4),
            **{key: round(v, 6) for key, v in times.items()},
            "estimated_decode_speedup": round(speedup, 4) if speedup is not None else None}
