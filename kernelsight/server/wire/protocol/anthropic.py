"""The Anthropic Messages API as vLLM 0.33 takes it (``/v1/messages``, ``/v1/messages/count_tokens``), and its
translation to the chat request vLLM's handler runs it as (``chat_fields``)."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator

#: vLLM's map from chat finish reasons to Anthropic stop reasons.
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


class _Base(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("model")
    @classmethod
    def validate_model(cls, v: str) -> str:
        if not v:
            raise ValueError("Model is required")
        return v


class AnthropicCountTokensRequest(_Base):
    pass


class AnthropicMessagesRequest(_Base):
    max_tokens: int
    metadata: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    kv_transfer_params: dict[str, Any] | None = None

    @field_validator("max_tokens")
    @classmethod
    def validate_max_tokens(cls, v: int) -> int:
        if v <= 0:
            raise ValueError("max_tokens must be positive")
        return v


def _system_text(req: _Base) -> str:
    parts: list[str] = []
    blocks = [req.system] if isinstance(req.system, str) else req.system or []
    blocks += [m.get("content") for m in req.messages if m.get("role") == "system"]
    for b in blocks:
        if isinstance(b, str):
            parts.append(b)
        elif isinstance(b, dict) and b.get("type") == "text" and b.get("text"):
            if not b["text"].startswith("x-anthropic-billing-header"):   # per-request hash: defeats prefix caching
                parts.append(b["text"])
        elif isinstance(b, list):
            parts += [x.get("text", "") for x in b if isinstance(x, dict) and x.get("type") == "text" and x.get("text")]
    return "".join(parts)


def _messages(req: _Base) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    system = _system_text(req)
    if system:
        out.append({"role": "system", "content": system})
    for m in req.messages:
        role = {"ctx": "user", "msg": "user"}.get(m.get("role", "user"), m.get("role", "user"))
        if role == "system":
            continue
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        texts, calls = [], []
        for b in content or []:
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text" and b.get("text"):
                texts.append(b["text"])
            elif kind == "tool_use":
                calls.append({"id": b.get("id") or "call", "type": "function",
                              "function": {"name": b.get("name") or "", "arguments": json.dumps(b.get("input") or {})}})
            elif kind == "tool_result":
                result = b.get("content")
                if isinstance(result, list):
                    result = "\n".join(x.get("text", "") for x in result if isinstance(x, dict)
                                       and x.get("type") == "text")
                if role == "user":
                    out.append({"role": "tool", "tool_call_id": b.get("tool_use_id") or "",
                                "content": result or ""})
                else:
                    texts.append(f"Tool result: {result or ''}")
        msg: dict[str, Any] = {"role": role}
        if texts:
            msg["content"] = "".join(texts) if len(texts) == 1 else "\n".join(texts)
        if calls:
            msg["tool_calls"] = calls
            msg.setdefault("content", None)
        if "content" in msg or role != "user":
            out.append(msg if "content" in msg else {**msg, "content": ""})
    return out


def chat_fields(req: _Base) -> dict[str, Any]:
    """The chat request vLLM builds from a Messages (or count_tokens) request."""
    fields: dict[str, Any] = {"model": req.model, "messages": _messages(req),
                              "chat_template_kwargs": req.chat_template_kwargs}
    if isinstance(req, AnthropicMessagesRequest):
        fields.update(max_tokens=req.max_tokens, stop=req.stop_sequences, temperature=req.temperature,
                      top_p=req.top_p, top_k=req.top_k)
        if req.stream:
            fields.update(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
        fmt = (req.output_config or {}).get("format")
        if isinstance(fmt, dict) and fmt.get("schema"):
            fields["response_format"] = {"type": "json_schema",
                                         "json_schema": {"name": "json_schema", "schema": fmt["schema"]}}
    choice = req.tool_choice or {}
    kind = choice.get("type")
    if kind in ("auto", "none"):
        fields["tool_choice"] = kind
    elif kind == "any":
        fields["tool_choice"] = "required"
    elif kind == "tool":
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    if req.tools is not None:
        fields["tools"] = [{"type": "function", "function": {
            "name": t.get("name", ""), "description": t.get("description"),
            "parameters": {"type": "object", **(t.get("input_schema") or {})}}} for t in req.tools]
        fields.setdefault("tool_choice", "auto")
    return {k: v for k, v in fields.items() if v is not None}
