"""How a batch's tokens pick experts: the load of the busiest rank of a MoE layer.

A batch of ``T`` tokens, each routed to ``top_k`` experts of ``E``, sends ``T·top_k`` token-slots to the experts.
With expert parallelism over ``ep`` ranks each rank holds ``E/ep`` whole experts; the layer waits for the busiest.
Two quantities of that rank price its grouped expert GEMMs: the token-slots it computes (FLOPs, activation bytes)
and the distinct experts it touches (weight bytes: an expert no token picked is never read). Both depend on the
routing distribution, a real input (``--expert-routing``):

* ``balanced``: token i's j-th pick is expert (i + j·⌈E/k⌉) mod E (spread over the whole range when T < ⌈E/k⌉):
  every expert equally loaded, a rank gets its ``T·top_k/ep`` share of the slots.
* ``power_law_<a>`` (a = 1.01, 1.2): per-expert loads drawn from a bounded power law of exponent a — on
  ``[1, 0.8·T]`` when there are more slots than experts, on ``[0.01, 2]`` otherwise —, scaled to ``T·top_k``
  slots and rounded; the rank is the group of ``E/ep`` experts with the largest total. This is how the shared MoE
  tables (``moe.csv.gz``) define their ``distribution`` column, so the same relation prices their rows in
  calibration and a serving step in the simulator; η is fitted on the roofline of the experts actually touched.

Every one of the ``T`` tokens enters the layer on each rank (vLLM's default EP gathers the group's rows), and
vLLM's fused_experts runs its activation and top-k sum over all ``T·top_k`` slots, local or not: that traffic
is the layer's, whatever the rank holds (``kernel_shapes.fused_moe_kernel``).

vLLM's grouped expert GEMMs compute each expert's rows in blocks (``BLOCK_SIZE_M``): :func:`padded_slots` gives the
busiest rank's rows once each of its experts' is padded to a whole block, from the same per-expert loads.

The power law is evaluated as the mean over ``ROUTING_DRAWS`` seeded draws (deterministic, pure numpy, no I/O; the
tables average ten random draws per row). The busiest rank's slots over the mean share ``T·top_k/ep`` is the load
imbalance an EP group waits for (``--expert-load-imbalance`` overrides it).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

BALANCED = "balanced"
POWER_LAW_1_01 = "power_law_1.01"
POWER_LAW_1_2 = "power_law_1.2"
ROUTING_DISTRIBUTIONS: tuple[str, ...] = (BALANCED, POWER_LAW_1_01, POWER_LAW_1_2)
#: Default ``--expert-routing``. No shared measurement says how a served model's router spreads its tokens (that
#: needs a trained router's traces), so it is a documented input: the milder of the two power laws the kernel
#: tables were timed under (exponent 1.01: busiest of 2 ranks ≈ 1.07-1.12 × the mean share at 64-8192 tokens,
#: where the old flat default was 1.1; of 8 ranks ≈ 1.45-1.7 ×). ``balanced`` is the ideal (EPLB-like) spread.
DEFAULT_EXPERT_ROUTING = POWER_LAW_1_01
#: Seeded draws the power-law statistics average over (the tables average ten per row).
ROUTING_DRAWS = 16
_SEED = 20260101
#: Above this many token-slots the balanced pattern is taken at its even share instead of enumerated.
_EXACT_BALANCED_SLOTS = 65536


@dataclass(frozen=True, slots=True)
class RoutingLoad:
    """The busiest rank's share of one MoE layer's routing."""

    slots: float            # token-slots (token × expert pairs) the rank computes
    active_experts: float   # distinct experts of the rank at least one slot reaches
    mean_slots: float       # T·top_k/ep: a rank's share under perfect balance
    max_expert_slots: float = 0.0   # slots of the rank's most loaded expert (its longest grouped-GEMM row block)

    @property
    def imbalance(self) -> float:
        """Busiest rank's slots ÷ the mean share (≥ 1 up to rounding)."""
        return self.slots / self.mean_slots if self.mean_slots > 0 else 1.0


def power_law_alpha(distribution: str) -> float | None:
    """The exponent of a ``power_law_<a>`` distribution name; None for ``balanced``."""
    if distribution == BALANCED:
        return None
    if distribution.startswith("power_law_"):
        try:
            alpha = float(distribution.removeprefix("power_law_"))
        except ValueError:
            alpha = 0.0
        if alpha > 1.0:
            return alpha
    raise ValueError(f"unknown expert routing {distribution!r}; known: {', '.join(ROUTING_DISTRIBUTIONS)} "
                     "(or power_law_<a> with a > 1)")


def _bounded_power_law(rng: np.random.Generator, shape: tuple[int, int], alpha: float, lo: float,
                       hi: float) -> np.ndarray:
    """Inverse-CDF draws of density ∝ x^−alpha on [lo, hi]."""
    u = rng.random(shape)
    e = 1.0 - alpha
    return ((hi ** e - lo ** e) * u + lo ** e) ** (1.0 / e)


def _balanced_counts(tokens: int, top_k: int, num_experts: int, local: int) -> np.ndarray:
    """Slots per expert of the first rank (its ``local`` experts) when token i's j-th pick is expert
    (i + j·s) mod E, s = ⌈E/k⌉ (spread over the whole range when there are fewer tokens than s): every expert
    equally loaded."""
    stride = math.ceil(num_experts / top_k)
    i = np.arange(tokens, dtype=float)[:, None]
    j = np.arange(top_k, dtype=float)[None, :]
    base = i if tokens >= stride else np.floor(i * stride / tokens)
    picks = ((base + j * stride) % num_experts).astype(np.int64)
    mine = picks[picks < local]
    out = np.bincount(mine, minlength=local)[:local].astype(float)
    out.setflags(write=False)
    return out


@functools.lru_cache(maxsize=8192)
def routing_load(tokens: int, top_k: int, num_experts: int, ep_size: int = 1,
                 distribution: str = DEFAULT_EXPERT_ROUTING) -> RoutingLoad:
    """The busiest rank's token-slots and touched experts when ``tokens`` tokens each pick ``top_k`` of
    ``num_experts`` experts split over ``ep_size`` ranks (see the module docstring)."""
    tokens, ep = max(int(tokens), 0), max(int(ep_size), 1)
    mean = tokens * top_k / ep
    if tokens == 0:
        return RoutingLoad(0.0, 0.0, 0.0, 0.0)
    counts = _rank_counts(tokens, top_k, num_experts, ep, distribution)
    if counts is None:   # balanced beyond the enumerated range: the even share
        local = max(num_experts // ep, 1)
        return RoutingLoad(mean, float(local), mean, math.ceil(mean / local))
    return RoutingLoad(float(counts.sum(axis=1).mean()), float((counts > 0).sum(axis=1).mean()), mean,
                       float(counts.max(axis=1).mean()))


@functools.lru_cache(maxsize=8192)
def padded_slots(tokens: int, top_k: int, num_experts: int, ep_size: int, distribution: str,
                 block_m: int) -> float:
    """The busiest rank's token-slots once each expert's rows are padded to a multiple of ``block_m``: Σ over its
    experts of ⌈slots/block_m⌉·block_m. vLLM's grouped expert GEMMs (``moe_align_block_size`` then one row block of
    ``block_m`` rows per program) compute those padded rows: an expert with 3 slots costs a whole 64-row block."""
    tokens, ep, bm = max(int(tokens), 0), max(int(ep_size), 1), max(int(block_m), 1)
    if tokens == 0:
        return 0.0
    counts = _rank_counts(tokens, top_k, num_experts, ep, distribution)
    if counts is None:
        local = max(num_experts // ep, 1)
        return float(local * math.ceil(tokens * top_k / ep / local / bm) * bm)
    return float((np.ceil(counts / bm) * bm).sum(axis=1).mean())


@functools.lru_cache(maxsize=256)   # arrays of up to draws × 512 experts: the two callers' results are cached apart
def _rank_counts(tokens: int, top_k: int, num_experts: int, ep: int, distribution: str) -> np.ndarray | None:
    """Slots per expert of the busiest rank (draws × its experts; one row for the balanced pattern), or None for a
    balanced pattern too large to enumerate (taken at its even share)."""
    alpha = power_law_alpha(distribution)
    local = max(num_experts // ep, 1)
    if alpha is None:
        if tokens * top_k > _EXACT_BALANCED_SLOTS:
            return None
        return _balanced_counts(tokens, top_k, num_experts, local)[None, :]
    rng = np.random.default_rng(_SEED)
    total = tokens * top_k
    lo, hi = (1.0, 0.8 * tokens) if total > num_experts else (0.01, 2.0)
    if hi <= lo:
        hi = lo * 1.000001
    x = _bounded_power_law(rng, (ROUTING_DRAWS, num_experts), alpha, lo, hi)
    counts = np.rint(x / x.sum(axis=1, keepdims=True) * total)[:, : local * ep]
    # a token picks an expert at most once: loads above T are cut to T; the cut slots, then the rounding's
    # deficit, are dealt to the ranks in turn, each giving its least loaded expert one more (a surplus: its most
    # loaded one less)
    over = np.maximum(counts - tokens, 0.0).sum(axis=1)
    counts = np.minimum(counts, float(tokens)).reshape(ROUTING_DRAWS, ep, local)
    counts = _deal(counts, over)
    counts = _deal(counts, total - counts.sum(axis=(1, 2)))
    busiest = np.argmax(counts.sum(axis=2), axis=1)
    out = counts[np.arange(ROUTING_DRAWS), busiest]
    out.setflags(write=False)
    return out


def _deal(counts: np.ndarray, units: np.ndarray) -> np.ndarray:
    """Deal ``units[d]`` slots (negative: take them) to draw d's ranks in turn (rank r gets ⌊u/ep⌋, one more for
    the first u mod ep), each rank's share one at a time to its least loaded expert — water-filling, computed in
    closed form — or taken off its most loaded."""
    draws, ep, local = counts.shape
    out = counts.copy()
    for d in range(draws):
        u = int(round(units[d]))
        if u == 0:
            continue
        share = np.full(ep, abs(u) // ep, dtype=float)
        share[: abs(u) % ep] += 1.0
        if u < 0:   # the most loaded expert of each rank gives them up (touched experts unchanged unless emptied)
            top = np.argmax(out[d], axis=1)
            out[d, np.arange(ep), top] = np.maximum(out[d, np.arange(ep), top] - share, 0.0)
            continue
        srt = np.sort(out[d], axis=1)                       # ascending per rank
        csum = np.cumsum(srt, axis=1)
        j = np.arange(1, local + 1, dtype=float)
        cost = j * srt - csum                               # slots to raise the j smallest to the j-th's level
        k = np.maximum((cost <= share[:, None]).sum(axis=1), 1)    # experts the water reaches
        level_base = srt[np.arange(ep), k - 1]
        spare = share - cost[np.arange(ep), k - 1]
        level = level_base + np.floor(spare / k)
        extra = spare - np.floor(spare / k) * k
        filled = np.where(np.arange(local)[None, :] < k[:, None], level[:, None], srt)
        filled += (np.arange(local)[None, :] < extra[:, None]).astype(float)
        out[d] = filled
    return out


def load_imbalance(tokens: int, top_k: int, num_experts: int, ep_size: int,
                   distribution: str = DEFAULT_EXPERT_ROUTING) -> float:
    """Busiest EP rank's routed token-slots ÷ the mean share (the derived ``--expert-load-imbalance``)."""
    return max(routing_load(tokens, top_k, num_experts, ep_size, distribution).imbalance, 1.0)


__all__ = [
    "BALANCED",
    "DEFAULT_EXPERT_ROUTING",
    "POWER_LAW_1_01",
    "POWER_LAW_1_2",
    "ROUTING_DISTRIBUTIONS",
    "ROUTING_DRAWS",
    "RoutingLoad",
    "load_imbalance",
    "padded_slots",
    "power_law_alpha",
    "routing_load",
]
