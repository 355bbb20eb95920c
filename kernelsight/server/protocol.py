"""Request models and vLLM's error bodies (field names and defaults as in vLLM 0.33's OpenAI server)."""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

VLLM_VERSION = "0.33.0"
MAX_COMPLETION_PROMPTS = 1024     # VLLM_MAX_COMPLETION_PROMPTS
MAX_STOP_STRINGS = 4              # VLLM_MAX_STOP_STRINGS (0.33)


# json.dumps builds a new encoder per call when given options (~2 µs), and JSONEncoder.encode builds a C encoder per
# non-string value (~1.5 µs): SSE rendering calls this several times per token, mostly on str and None
_ENCODE = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode
_ENCODE_STR = json.encoder.encode_basestring      # what that encoder uses for a str (ensure_ascii=False)


def dumps(obj: Any) -> str:
    """Compact JSON, as vLLM writes responses and SSE chunks (same bytes as json.dumps with those options)."""
    if obj is None:
        return "null"
    if type(obj) is str:
        return _ENCODE_STR(obj)
    return _ENCODE(obj)


class VLLMValidationError(ValueError):
    """A request-model check that names the offending parameter (reported as the error's ``param``)."""

    def __init__(self, message: str, parameter: str | None = None) -> None:
        super().__init__(message)
        self.parameter = parameter


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


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    tokens: list[int]


class LoadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    lora_name: str
    lora_int_id: int | None = None


# -- errors -----------------------------------------------------------------------------------------
class APIError(Exception):
    """An error answered in vLLM's nested shape: {"error": {message, type, param, code}}."""

    def __init__(self, message: str, err_type: str = "BadRequestError", status: int = 400,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.err_type = err_type
        self.status = status
        self.param = param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param, "code": self.status}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(message, "BadRequestError", 400, param)


def not_found(message: str, param: str | None = None) -> APIError:
    return APIError(message, "NotFoundError", 404, param)


def validation_error(exc: ValidationError | list[dict[str, Any]]) -> APIError:
    """pydantic errors as vLLM 0.33 reports them: 400, type "Bad Request", param from the location."""
    errors = exc.errors() if isinstance(exc, ValidationError) else exc
    n = len(errors)
    lines = [f"{n} validation error{'s' if n != 1 else ''}:"]
    for e in errors:
        clean = {k: e.get(k) for k in ("type", "loc", "msg", "input") if k in e}
        if "input" in clean:
            clean["input"] = _short(clean["input"])
        lines.append(f"  {clean!r}")
    loc = errors[0].get("loc", ()) if errors else ()
    param = ".".join(str(x) for x in loc) if loc else None
    for e in errors:     # a VLLMValidationError raised by a request-model check names its parameter
        err = (e.get("ctx") or {}).get("error")
        if isinstance(err, VLLMValidationError):
            param = err.parameter
            break
    return APIError("\n".join(lines), HTTPStatus.BAD_REQUEST.phrase, 400, param)


def _short(v: Any) -> Any:
    r = repr(v)
    return v if len(r) <= 200 else r[:200] + "..."


def sse_error_event(err: APIError, compact: bool) -> str:
    """In-stream error: chat writes compact JSON, completions uses json.dumps' default separators."""
    body = dumps(err.body()) if compact else json.dumps(err.body(), ensure_ascii=False)
    return f"data: {body}\n\n"
