"""``BatchChatCompletionRequest`` (vLLM 0.33's /v1/chat/completions/batch): a chat request whose ``messages`` is a
list of conversations."""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field

from kernelsight.server.wire.protocol.openai import ChatCompletionRequest


class BatchChatCompletionRequest(ChatCompletionRequest):
    model_config = ConfigDict(extra="allow")

    messages: list[list[dict[str, Any]]] = Field(..., min_length=1)   # type: ignore[assignment]
