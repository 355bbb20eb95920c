"""The OpenAI Responses API request (``/v1/responses``, field names and defaults as vLLM 0.33 takes them), and its
translation to the chat request vLLM's handler runs it as (``to_chat_messages``, ``chat_fields``)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool | None = False
    store: bool | None = True
    background: bool | None = False
    tools: list[dict[str, Any]] = []
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool | None = True
    text: dict[str, Any] | None = None
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    request_id: str | None = None
    priority: int = 0
    seed: int | None = None
    reasoning: dict[str, Any] | None = None
    service_tier: str | None = "auto"
    truncation: str | None = "disabled"
    top_logprobs: int | None = None


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content
                       if isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text"))
    return ""


def to_chat_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses input items as chat messages: messages, function calls (assistant tool calls) and their outputs
    (tool messages); reasoning items are dropped."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "message" or (kind is None and "role" in item):
            role = item.get("role", "user")
            out.append({"role": "system" if role == "developer" else role, "content": _text_of(item.get("content"))})
        elif kind == "function_call":
            out.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": item.get("call_id", ""), "type": "function",
                 "function": {"name": item.get("name", ""), "arguments": item.get("arguments", "{}")}}]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item.get("call_id", ""),
                        "content": _text_of(item.get("output"))})
    return out


def output_as_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A stored response's output items as the chat messages a follow-up (``previous_response_id``) continues."""
    items = []
    for o in output:
        if o.get("type") == "message":
            items.append({"type": "message", "role": "assistant", "content": o.get("content", [])})
        elif o.get("type") == "function_call":
            items.append(o)
    return to_chat_messages(items)


def chat_fields(req: ResponsesRequest) -> dict[str, Any]:
    """The chat request fields a Responses request sets (besides messages and streaming)."""
    tools = [{"type": "function", "function": {"name": t.get("name", ""), "description": t.get("description"),
                                               "parameters": t.get("parameters") or {"type": "object"}}}
             for t in req.tools if t.get("type") == "function"]
    fields: dict[str, Any] = {"model": req.model, "max_tokens": req.max_output_tokens, "temperature": req.temperature,
                              "top_p": req.top_p, "top_k": req.top_k, "seed": req.seed, "priority": req.priority,
                              "request_id": req.request_id}
    if tools:
        choice = req.tool_choice
        if isinstance(choice, dict):
            choice = {"type": "function", "function": {"name": choice.get("name", "")}}
        fields.update(tools=tools, tool_choice=choice, parallel_tool_calls=req.parallel_tool_calls)
    fmt = (req.text or {}).get("format") if isinstance(req.text, dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        fields["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.get("name", "response"), "schema": fmt.get("schema", {}), "strict": fmt.get("strict")}}
    elif isinstance(fmt, dict) and fmt.get("type") == "json_object":
        fields["response_format"] = {"type": "json_object"}
    return {k: v for k, v in fields.items() if v is not None}
