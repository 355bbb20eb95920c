"""Tool calls and structured outputs of a chat request (``chat_generation``): what the simulated model emits is
drawn up front from the request's schemas (``server/structured.py``), tokenized, and released like any other
output, so its timing is its real token count's; ``ToolCallGeneration`` renders it as vLLM's tool calls.

What a call looks like on the wire follows vLLM 0.33: a named ``tool_choice`` makes the model emit the
arguments alone (guided JSON; ``finish_reason`` "stop", ``content`` ""); ``required`` a JSON list of
``{"name", "parameters"}`` (``finish_reason`` "tool_calls"); ``auto`` (needs ``--enable-auto-tool-choice
--tool-call-parser``) a Hermes-style ``<tool_call>`` block that the parser turns into a call (``content`` null,
``finish_reason`` "tool_calls"). Under ``auto`` the simulated model calls a tool unless the conversation ends
with a tool's result, which it answers in text: an agent loop runs call → result → answer, as with a real model."""

from __future__ import annotations

import hashlib
import json
import random
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from kernelsight.server.errors import bad_request
from kernelsight.server.generation import Generation
from kernelsight.server.state import ServerState
from kernelsight.server.structured import constrained_text, instance_of
from kernelsight.server.wire import dumps

AUTO_TOOL_CHOICE_ERROR = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'


@dataclass(frozen=True)
class ToolPlan:
    """The one tool call a response makes: what the model emits is ``prefix + arguments + suffix``."""

    mode: str               # "named" | "required" | "auto"
    call_id: str
    name: str
    arguments: str          # JSON text
    prefix: str
    suffix: str

    @property
    def text(self) -> str:
        return self.prefix + self.arguments + self.suffix

    @property
    def finish_reason(self) -> str:
        return "stop" if self.mode == "named" else "tool_calls"

    def call(self) -> dict[str, Any]:
        return {"id": self.call_id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def draw_seed(req: Any, prompt_ids: list[int]) -> int:
    """The seed of the drawn output: the request's ``seed``, else the prompt's hash (same prompt, same output)."""
    h = hashlib.blake2b(dumps([req.seed, prompt_ids[-4096:], len(prompt_ids)]).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little")


def check_auto_tools(state: ServerState, req: Any) -> None:
    if req.tool_choice == "auto" and req.tools and not (state.opts.enable_auto_tool_choice
                                                        and state.opts.tool_call_parser):
        raise bad_request(AUTO_TOOL_CHOICE_ERROR)


def plan_tool_call(req: Any, messages: list[dict[str, Any]], seed: int) -> ToolPlan | None:
    """The call this request makes, or None (no tools, ``tool_choice`` "none", or ``auto`` answering a result)."""
    tools = [t for t in req.tools or [] if isinstance(t, dict) and isinstance(t.get("function"), dict)]
    choice = req.tool_choice
    if not tools or choice is None or choice == "none":
        return None
    rng = random.Random(seed)
    if isinstance(choice, dict):
        mode, name = "named", choice["function"]["name"]
    else:
        if choice == "auto" and messages and messages[-1].get("role") == "tool":
            return None
        mode, name = choice, rng.choice(tools)["function"].get("name", "")
    fn = next(t["function"] for t in tools if t["function"].get("name") == name)
    params = fn.get("parameters")
    args = json.dumps(instance_of(params if isinstance(params, dict) else {"type": "object"}, seed))
    call_id = f"chatcmpl-tool-{uuid.uuid4().hex}"     # unique per call, as vLLM's (agents key results by it)
    qname = json.dumps(name)
    if mode == "named":
        return ToolPlan(mode, call_id, name, args, "", "")
    if mode == "required":
        return ToolPlan(mode, call_id, name, args, f'[{{"name": {qname}, "parameters": ', "}]")
    return ToolPlan(mode, call_id, name, args, f'<tool_call>\n{{"name": {qname}, "arguments": ', "}\n</tool_call>")


def chat_generation(state: ServerState, request: Request, req: Any, rid: str, lora: str | None, stops: list[str],
                    messages: list[dict[str, Any]], prompt_ids: list[int]) -> Generation:
    """The chat request's ``Generation``: a tool call, a structured output, or free text."""
    seed = draw_seed(req, prompt_ids)
    plan = plan_tool_call(req, messages, seed)
    if plan is not None:
        gen: Generation = ToolCallGeneration(state, request, req, rid, lora, stops, is_chat=True, plan=plan)
        gen.fixed_output = state.tok.encode(plan.text, False)
        return gen
    gen = Generation(state, request, req, rid, lora, stops, is_chat=True)
    text = constrained_text(req.response_format, req.structured_outputs, seed)
    if text is not None:
        gen.fixed_output = state.tok.encode(text, False)
    return gen


class ToolCallGeneration(Generation):
    """A chat generation whose output is a tool call: the message carries ``tool_calls``, and a stream carries
    the arguments as they are released (the first tool-call delta with the call's id and name, as vLLM's)."""

    def __init__(self, *args: Any, plan: ToolPlan, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.plan = plan
        self._args_sent: dict[int, int] = {}

    def _fast_eligible(self) -> bool:
        return False        # its chunks are not the content template the fast path fills

    def _complete(self, v: Any) -> bool:
        return v.finish_reason == "stop" and v.consumed == len(self.fixed_output or ())

    def _full_response(self) -> dict[str, Any]:
        body = super()._full_response()
        for choice, v in zip(body["choices"], self.views, strict=True):
            if not self._complete(v):
                continue       # cut by max_tokens: vLLM's parser finds no complete call and returns the text
            msg = choice["message"]
            msg["content"] = None if self.plan.mode == "auto" else ""
            msg["tool_calls"] = [self.plan.call()]
            choice["finish_reason"] = self.plan.finish_reason
        return body

    def _chat_chunk(self, index: int, text: str | None, finish: str | None, stop_reason: str | None,
                    token_ids: list[int] | None = None, usage: dict | None = None, logprobs: str = "null") -> str:
        plan = self.plan
        v = self.views[index]
        start = self._args_sent.get(index)
        end = min(max(len(v.text) - len(plan.prefix), 0), len(plan.arguments))
        delta: dict[str, Any] = {}
        if start is None and len(v.text) >= len(plan.prefix):
            delta = {"tool_calls": [{"id": plan.call_id, "type": "function", "index": 0,
                                     "function": {"name": plan.name, "arguments": plan.arguments[:end]}}]}
            self._args_sent[index] = end
        elif start is not None and end > start:
            delta = {"tool_calls": [{"index": 0, "function": {"arguments": plan.arguments[start:end]}}]}
            self._args_sent[index] = end
        elif finish is None:
            return ""           # the call's header is still being emitted: nothing a parser would send yet
        ids = dumps(token_ids) if token_ids is not None else "null"
        if finish is None:
            choice = (f'{{"index":{index},"delta":{dumps(delta)},"logprobs":{logprobs},"finish_reason":null,'
                      f'"token_ids":{ids}}}')
        else:
            if self._complete(v):
                finish = plan.finish_reason
            choice = (f'{{"index":{index},"delta":{dumps(delta)},"logprobs":{logprobs},'
                      f'"finish_reason":{dumps(finish)},"stop_reason":{dumps(stop_reason)},"token_ids":{ids},'
                      f'"weight_versions":null}}')
        tail = f',"usage":{dumps(usage)}' if usage is not None else ""
        if finish is not None and not self.include_usage:
            tail += f',"system_fingerprint":{dumps(self.state.fingerprint)}'
        return f'data: {self._head("chat.completion.chunk")}"choices":[{choice}]{tail},"kv_transfer_params":null}}\n\n'
