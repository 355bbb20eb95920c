"""OpenAI-compatible request models: /v1/completions and /v1/chat/completions (field names and defaults as in
vLLM 0.33's OpenAI server)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kernelsight.server.wire.protocol.tools import check_response_format, check_structured_outputs, check_tool_usage
from kernelsight.server.wire.protocol.validation import VLLMValidationError

__all__ = ["ChatCompletionRequest", "CompletionRequest", "StreamOptions", "VLLMValidationError"]


def _check_prompt_logprobs(data: Any) -> None:
    if (plp := data.get("prompt_logprobs")) is not None and isinstance(plp, int):
        if data.get("stream") and (plp > 0 or plp == -1):
            raise VLLMValidationError("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
        if plp < 0 and plp != -1:
            raise VLLMValidationError("`prompt_logprobs` must be a positive value or -1.", "prompt_logprobs")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    n: int = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(default_factory=list)
    stop_token_ids: list[int] | None = Field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    echo: bool | None = False
    priority: int = 0
    request_id: str | None = None
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None     # P/D disaggregation (server/integrations/kv_transfer.py)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool | None = True
    return_token_ids: bool | None = False
    return_tokens_as_token_ids: bool | None = None
    user: str | None = None


class CompletionRequest(_Common):
    prompt: list[int] | list[list[int]] | str | list[str] | None = None
    max_tokens: int | None = 16
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    add_special_tokens: bool = True
    suffix: str | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def check_logprobs(cls, data: Any) -> Any:
        if isinstance(data, dict):
            _check_prompt_logprobs(data)
            lp = data.get("logprobs")
            if isinstance(lp, int) and not isinstance(lp, bool) and lp < 0 and lp != -1:
                raise VLLMValidationError("`logprobs` must be a positive value or -1.", "logprobs")
        return data


class ChatCompletionRequest(_Common):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    prompt_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = "none"
    parallel_tool_calls: bool | None = True
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def check_tools_and_formats(cls, data: Any) -> Any:
        if isinstance(data, dict):
            check_response_format(data)
            check_structured_outputs(data)
            check_tool_usage(data)
        return data

    @model_validator(mode="before")
    @classmethod
    def check_logprobs(cls, data: Any) -> Any:
        if isinstance(data, dict):
            _check_prompt_logprobs(data)
            top = data.get("top_logprobs")
            if top and isinstance(top, int):
                if top < 0 and top != -1:
                    raise VLLMValidationError("`top_logprobs` must be a positive value or -1.", "top_logprobs")
                if (top == -1 or top > 0) and not data.get("logprobs"):
                    raise VLLMValidationError("when using `top_logprobs`, `logprobs` must be set to true.",
                                              "top_logprobs")
        return data
