"""Speculative decoding: vLLM's ``--speculative-config``, the acceptance model and the spec-decode counters.

A step with speculation verifies, for every decoding request, the bonus token plus the draft tokens proposed after
the previous step (vLLM schedules ``1 + k`` tokens for it); the rejection sampler keeps the longest accepted prefix
of the drafts plus one token sampled by the target, so a request gains ``1 + accepted`` tokens per step.

The acceptance model: ``acceptance_rates[i]`` is vLLM's *per-position acceptance rate*, the fraction of drafts whose
token ``i`` is accepted (``vllm:spec_decode_num_accepted_tokens_per_pos / vllm:spec_decode_num_drafts``), so it is
non-increasing. One uniform draw per draft then gives ``accepted = #{i : u < rates[i]}``, which reproduces every
position's rate exactly in expectation. The draw is a hash of (seed, request, output position): the same seed gives
the same acceptances whatever else is in the batch.

Default rates per method are geometric, ``rates[i] = c ** (i + 1)`` with a per-token conditional acceptance ``c``
taken from published figures (:data:`DEFAULT_CONDITIONAL_ACCEPTANCE`). They are defaults, not measurements: set
your own with ``"synthetic_acceptance_rates"`` (or ``"synthetic_acceptance_length"``) in the config, as vLLM's
synthetic rejection sampler takes them, or ``--speculative-acceptance-rates``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

NGRAM = "ngram"
EAGLE = "eagle"
EAGLE3 = "eagle3"
MTP = "mtp"
DRAFT_MODEL = "draft_model"
#: The methods the simulator prices (vLLM's names; the MTP aliases such as ``deepseek_mtp`` map to ``mtp``).
METHODS: tuple[str, ...] = (NGRAM, EAGLE, EAGLE3, MTP, DRAFT_MODEL)
#: vLLM's deprecated per-model MTP method names, replaced by "mtp" with a warning.
_MTP_ALIASES = frozenset({"deepseek_mtp", "mimo_mtp", "glm4_moe_mtp", "ernie_mtp", "qwen3_next_mtp",
                          "longcat_flash_mtp", "pangu_ultra_moe_mtp"})
#: vLLM methods that exist but the simulator does not price.
_UNPRICED = frozenset({"medusa", "mlp_speculator", "suffix", "ngram_gpu", "custom_class", "extract_hidden_states",
                       "dflash", "dspark"})

#: Per-token conditional acceptance (the chance a draft token is accepted given the ones before it were) per method.
#: Sources, as orders of magnitude for chat-style text, not measurements of any deployment:
#: - mtp 0.85: DeepSeek-V3 technical report (arXiv:2412.19437, sec. 5.4.3): "the acceptance rate of the second token
#:   prediction ranges between 85% and 90%";
#: - eagle3 0.80 and eagle 0.75: EAGLE (arXiv:2401.15077) reports per-position acceptance around 0.7-0.8 on MT-bench
#:   for chain drafts; EAGLE-3 (arXiv:2503.01840) reports higher acceptance than EAGLE at every position;
#: - draft_model 0.70: Leviathan et al., "Fast Inference from Transformers via Speculative Decoding" (ICML 2023,
#:   table 3: alpha 0.5-0.9 depending on the model pair and task);
#: - ngram 0.45: prompt lookup only helps where the output copies the prompt (summaries, code edits); a middle value.
DEFAULT_CONDITIONAL_ACCEPTANCE: dict[str, float] = {MTP: 0.85, EAGLE3: 0.80, EAGLE: 0.75, DRAFT_MODEL: 0.70,
                                                    NGRAM: 0.45}

#: Host time of the n-gram proposer per request per step (vLLM's numba KMP over the context, run on the CPU between
#: the target's forward passes): an estimate, not a measurement.
NGRAM_HOST_S_PER_REQUEST = 10e-6

#: The --speculative-config keys accepted (vLLM's SpeculativeConfig fields; those without effect here are checked
#: and ignored, such as quantization or revision).
CONFIG_KEYS = frozenset({"method", "model", "num_speculative_tokens", "draft_tensor_parallel_size",
                         "tensor_parallel_size", "prompt_lookup_max", "prompt_lookup_min", "quantization",
                         "max_model_len", "revision", "code_revision", "enforce_eager", "disable_padded_drafter_batch",
                         "rejection_sample_method", "synthetic_acceptance_rates", "synthetic_acceptance_length",
                         "draft_sample_method", "parallel_drafting", "kv_cache_dtype"})


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """A resolved speculative-decoding configuration."""

    method: str
    num_speculative_tokens: int
    acceptance_rates: tuple[float, ...]      # per position, non-increasing (see module docstring)
    model: str | None = None                 # the draft model or EAGLE head (None: ngram / MTP of the target)
    draft_tensor_parallel_size: int = 1
    prompt_lookup_max: int = 0
    prompt_lookup_min: int = 0

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots reserved past the verified tokens for the drafter's own next tokens: vLLM's scheduler sets
        ``num_lookahead_tokens = num_spec_tokens`` for EAGLE-family and draft-model methods, 0 for n-gram."""
        return 0 if self.method == NGRAM else self.num_speculative_tokens

    @property
    def uses_eagle(self) -> bool:
        """vLLM's ``use_eagle()``: the drafter runs on the target's hidden states (EAGLE heads, MTP layers)."""
        return self.method in (EAGLE, EAGLE3, MTP)

    @property
    def mean_acceptance_length(self) -> float:
        """Expected tokens per verification step (vLLM's convention: the bonus token included)."""
        return 1.0 + sum(self.acceptance_rates)

    def summary(self) -> dict[str, Any]:
        return {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens, "model": self.model,
                "draft_tensor_parallel_size": self.draft_tensor_parallel_size,
                "acceptance_rates": [round(r, 4) for r in self.acceptance_rates],
                "expected_acceptance_length": round(self.mean_acceptance_length, 4)}


def default_acceptance_rates(method: str, k: int) -> tuple[float, ...]:
    c = DEFAULT_CONDITIONAL_ACCEPTANCE[method]
    return tuple(c ** (i + 1) for i in range(k))


def _check_rates(rates: Any, k: int, name: str = "synthetic_acceptance_rates") -> tuple[float, ...]:
    """vLLM's checks of synthetic_acceptance_rates (same messages)."""
    if not isinstance(rates, list | tuple) or not all(isinstance(r, int | float) and not isinstance(r, bool)
                                                      for r in rates):
        raise ValueError(f"{name} must be a list of numbers, got {rates!r}.")
    rates = [float(r) for r in rates]
    if len(rates) != k:
        raise ValueError(f"{name} must have length {k}, got {rates}.")
    if not all(0.0 <= r <= 1.0 for r in rates):
        raise ValueError(f"{name} entries must be in [0, 1], got {rates}.")
    if any(rates[i] > rates[i - 1] for i in range(1, k)):
        raise ValueError(f"{name} must be non-increasing, got {rates}.")
    return tuple(rates)


def rates_from_length(length: float, k: int) -> tuple[float, ...]:
    """vLLM's synthetic_acceptance_length → rates: the minimum-variance schedule (1, ..., 1, frac, 0, ..., 0)."""
    if not 1.0 <= length <= float(k + 1):
        raise ValueError(f"synthetic_acceptance_length must be in [1, {k + 1}], got {length}.")
    drafts = length - 1.0
    full = int(drafts)
    return tuple(([1.0] * full + [drafts - full] + [0.0] * k)[:k])


def _positive_int(d: dict, key: str) -> int | None:
    v = d.get(key)
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{key} must be an integer greater than or equal to 1, got {v!r}")
    return v


def resolve_speculative_config(raw: dict[str, Any], target_tp: int, target_mtp_layers: int = 0,
                               acceptance_rates: tuple[float, ...] | None = None) -> SpeculativeConfig:
    """vLLM's SpeculativeConfig.__post_init__ on the fields the simulator uses; ValueError with vLLM's messages.

    ``target_mtp_layers`` is the target's ``num_nextn_predict_layers`` (0: it has none); ``acceptance_rates``
    (``--speculative-acceptance-rates``) overrides the config's and the method's default rates.
    """
    if not isinstance(raw, dict):
        raise ValueError(f"speculative_config must be a JSON object, got {raw!r}")
    unknown = sorted(set(raw) - CONFIG_KEYS)
    if unknown:
        raise ValueError(f"Unexpected keyword argument(s) for SpeculativeConfig: {', '.join(unknown)}")
    d = dict(raw)
    if d.get("tensor_parallel_size") is not None:
        raise ValueError("'tensor_parallel_size' is not a valid argument in the speculative_config. Please pass "
                         "'draft_tensor_parallel_size' instead.")
    k = _positive_int(d, "num_speculative_tokens")
    model = d.get("model")
    method = d.get("method")
    if method is None:
        method = NGRAM if model in ("ngram", "[ngram]") else DRAFT_MODEL
    if method == "[ngram]":
        method = NGRAM
    if method in _MTP_ALIASES:
        method = MTP                        # vLLM: "method `...` is deprecated and replaced with mtp."
    if method in _UNPRICED:
        raise ValueError(f"speculative method {method!r} is not modelled by the simulator; "
                         f"supported: {', '.join(METHODS)}")
    if method not in METHODS:
        raise ValueError(f"Unsupported speculative method: '{method}'")
    if model is None and k is not None and method not in (NGRAM, MTP):
        raise ValueError("num_speculative_tokens was provided but without speculative model.")
    lookup_max = _positive_int(d, "prompt_lookup_max")
    lookup_min = _positive_int(d, "prompt_lookup_min")
    draft_tp = _positive_int(d, "draft_tensor_parallel_size")
    if method == NGRAM:
        if lookup_min is None and lookup_max is None:
            lookup_min = lookup_max = 5            # vLLM's defaults
        lookup_min = lookup_min if lookup_min is not None else lookup_max
        lookup_max = lookup_max if lookup_max is not None else lookup_min
        if lookup_min > lookup_max:
            raise ValueError(f"prompt_lookup_min={lookup_min} must be <= prompt_lookup_max={lookup_max}")
        model, draft_tp = None, target_tp
    elif method == MTP:
        if target_mtp_layers < 1:
            raise ValueError("method 'mtp' needs a target model with MTP layers (num_nextn_predict_layers > 0 in "
                             "its config.json)")
        if k is None:
            k = target_mtp_layers                  # vLLM: defaults to the draft config's n_predict
        elif k > target_mtp_layers and k % target_mtp_layers:
            raise ValueError(f"num_speculative_tokens:{k} must be divisible by n_predict={target_mtp_layers}")
        model, draft_tp = None, target_tp
    else:
        if k is None:
            raise ValueError("A speculative model was provided, but `num_speculative_tokens` was not provided")
        if draft_tp is None:
            draft_tp = target_tp                   # vLLM: the draft runs at the target's TP unless told
        elif draft_tp not in (1, target_tp):
            raise ValueError(f"draft_tensor_parallel_size={draft_tp} cannot be other value than 1 or target model "
                             f"tensor_parallel_size={target_tp}")
    if k is None:
        raise ValueError("num_speculative_tokens must be provided with speculative method "
                         f"{method!r}")
    rates = _resolve_rates(d, method, k)
    if acceptance_rates is not None:
        rates = _check_rates(list(acceptance_rates), k, "--speculative-acceptance-rates")
    return SpeculativeConfig(method, k, rates, model, draft_tp, lookup_max or 0, lookup_min or 0)


def _resolve_rates(d: dict[str, Any], method: str, k: int) -> tuple[float, ...]:
    sample = d.get("rejection_sample_method", "standard")
    if sample not in ("standard", "synthetic", "block"):
        raise ValueError(f"rejection_sample_method must be one of 'standard', 'synthetic', 'block', got {sample!r}")
    rates, length = d.get("synthetic_acceptance_rates"), d.get("synthetic_acceptance_length")
    if sample != "synthetic":
        if rates is not None or length is not None:
            raise ValueError("synthetic_acceptance_rates and synthetic_acceptance_length are only valid when "
                             "rejection_sample_method is 'synthetic'.")
        return default_acceptance_rates(method, k)
    if (rates is None) == (length is None):
        raise ValueError("rejection_sample_method='synthetic' requires exactly one of synthetic_acceptance_rates or "
                         "synthetic_acceptance_length.")
    if rates is not None:
        return _check_rates(rates, k)
    if not isinstance(length, int | float) or isinstance(length, bool):
        raise ValueError(f"synthetic_acceptance_length must be a number, got {length!r}")
    return rates_from_length(float(length), k)


# -- the seeded acceptance draws ---------------------------------------------------------------------------------
_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


@dataclass(slots=True)
class SpecDecodeStats:
    """vLLM's spec-decode counters (SpecDecodingStats), cumulative over an engine's life."""

    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        for i in range(num_accepted_tokens):
            per_pos[i] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted / drafts (vLLM's convention; 1 before any draft)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def acceptance_rates(self) -> list[float]:
        n = max(self.num_drafts, 1)
        return [c / n for c in self.num_accepted_tokens_per_pos]


class SpecDecoder:
    """The scheduler's hook: how many draft tokens a decoding request verifies, and how many are accepted."""

    def __init__(self, config: SpeculativeConfig, seed: int = 0) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.num_lookahead_tokens = config.num_lookahead_tokens
        self._rates = config.acceptance_rates
        self._seed = _splitmix64(seed & _MASK64)
        self.stats = SpecDecodeStats(self.k)

    def num_drafts_for(self, num_computed_tokens: int, max_model_len: int) -> int:
        """Draft tokens a decoding request carries into a step: k, fewer near max_model_len (vLLM caps the scheduled
        tokens at ``max_model_len - 1 - num_computed_tokens``, bonus token included)."""
        return max(0, min(self.k, max_model_len - 2 - num_computed_tokens))

    def accept(self, seq_no: int, position: int, num_drafted: int) -> int:
        """Accepted drafts of one verification (request ``seq_no``, first new token at output ``position``);
        recorded in the counters."""
        u = _splitmix64(self._seed ^ _splitmix64(((seq_no << 32) ^ position) & _MASK64)) / 2.0**64
        accepted = 0
        rates = self._rates
        while accepted < num_drafted and u < rates[accepted]:
            accepted += 1
        self.stats.observe_draft(num_drafted, accepted)
        return accepted
