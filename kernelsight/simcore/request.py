"""A request as the engine tracks it: prompt, progress, KV blocks and timing."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kernelsight.simcore.multimodal import MultimodalItem


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"        # the model emitted EOS (from the output-length model)
    LENGTH = "length"    # max_tokens or max_model_len reached
    ABORT = "abort"


@dataclass(slots=True, eq=False)
class Request:
    """One sequence being generated (a parent request with ``n > 1`` becomes n of these)."""

    request_id: str
    prompt_token_ids: Sequence[int]
    max_tokens: int
    target_output_len: int          # tokens this request will generate before finishing
    finish_reason_at_target: FinishReason
    arrival_s: float
    priority: int = 0
    seq_no: int = 0                 # admission order tie-breaker, unique per engine
    parent_id: str | None = None
    index: int = 0                  # position among the parent's n sequences
    extra_keys: tuple | None = None  # e.g. ("lora", name) / cache salt: enters the first block hash
    output_token_ids: Sequence[int] | None = None  # when the driver knows them (prefix-caches generated text)
    # prefill/decode disaggregation (simcore/kv_transfer.py): a prefill instance's request keeps its blocks after a
    # length finish until the decode side pulls them; a decode instance's request loads its prompt's KV instead of
    # computing it
    hold_kv: bool = False
    remote_prefill: bool = False
    # images/videos in the prompt, in prompt order (simcore/multimodal.py): the encoder runs in the step that first
    # schedules an item's tokens, and an item's content hash enters the hashes of the blocks it overlaps
    mm_items: tuple[MultimodalItem, ...] = ()

    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = -1     # prefix-cache hit at first admission (-1: not yet admitted)
    num_preemptions: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    prompt_block_hashes: np.ndarray | None = None   # the prompt's block hashes (the first of block_hashes) as uint64
    num_hashed_blocks_cached: int = 0   # leading blocks of block_ids registered in the prefix cache
    decode_join_step: int = -1          # step it joined the scheduler's decode group (-1: not a member)
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    finish_reason: FinishReason | None = None
    kv_ready_s: float | None = None     # remote prefill / offload load: when the KV is in place (None: not started)
    # KV offloading (simcore/kv_offload.py): tokens computed once the load from the CPU tier ends (0: no load in
    # flight), and how many offloaded blocks of it the tier was asked to store
    kv_load_tokens: int = 0
    num_offloaded_blocks: int = 0

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens: what the KV cache must eventually hold."""
        return len(self.prompt_token_ids) + self.num_output_tokens

    @property
    def remaining_output_tokens(self) -> int:
        return self.target_output_len - self.num_output_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def block_content(self, block_index: int, block_size: int) -> Sequence[Any]:
        """The token content of a full block, as the hash input.

        Generated tokens whose ids the engine does not know are keyed by (request, position): such blocks
        can only ever be reused by the same request (after preemption), never falsely shared.
        """
        start, end = block_index * block_size, (block_index + 1) * block_size
        prompt = self.prompt_token_ids
        plen = len(prompt)
        head: Any = prompt[start:min(end, plen)] if start < plen else ()
        if hasattr(head, "tolist"):          # an int array: hash plain ints, as for list prompts
            head = tuple(head.tolist())
        if end <= plen:
            return head
        outs = self.output_token_ids
        if outs is not None and end - plen <= len(outs):
            return head + tuple(outs[max(start - plen, 0):end - plen])  # noqa: RUF005
        return head + (("gen", self.request_id, block_index),)
