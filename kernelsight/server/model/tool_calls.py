"""Tool calls and structured outputs of a chat request (``chat_generation``): what the simulated model emits is
drawn up front from the request's schemas (``server/model/structured.py``), tokenized, and released like any other
output, so its timing is its real token count's; ``ToolCallGeneration`` renders it as vLLM's tool calls.

What a call looks like on the wire follows vLLM 0.33: a named ``tool_choice`` makes the model emit the
arguments alone (guided JSON; ``finish_reason`` "stop", ``content`` ""); ``required`` a JSON list of
``{"name", "parameters"}`` (``finish_reason`` "tool_calls"); ``auto`` (needs ``--enable-auto-tool-choice
--tool-call-parser``) Hermes-style ``<tool_call>`` blocks that the parser turns into calls (``content`` null,
``finish_reason`` "tool_calls"). Parallel calls: with several tools and ``parallel_tool_calls`` on (vLLM's
default), ``required`` and ``auto`` draw 2 or 3 calls now and then (``_num_calls``), each with its own id and
arguments drawn from its tool's schema, streamed as vLLM streams them (each call's first delta carries its
``index``, id and name, later ones its index and an arguments piece); with ``parallel_tool_calls`` false the
model makes one (vLLM keeps only the first call the parser finds). Under ``auto`` the simulated model calls a
tool unless the conversation ends with a tool's result, which it answers in text: an agent loop runs call →
result → answer, as with a real model."""

from __future__ import annotations

import hashlib
import json
import random
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from kernelsight.server.engine.generation import Generation
from kernelsight.server.model.structured import (
    StructuredOutputError,
    check_schema_patterns,
    constrained_text,
    instance_of,
)
from kernelsight.server.state import ServerState
from kernelsight.server.wire.errors import bad_request
from kernelsight.server.wire.jsonio import dumps

AUTO_TOOL_CHOICE_ERROR = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'


@dataclass(frozen=True)
class DrawnCall:
    """One call in the emitted text: its arguments (JSON text) start at ``start``."""

    call_id: str
    name: str
    arguments: str
    start: int

    def call(self) -> dict[str, Any]:
        return {"id": self.call_id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolPlan:
    """The tool calls a response makes (one, or several in parallel) and the text the model emits for them."""

    mode: str               # "named" | "required" | "auto"
    calls: tuple[DrawnCall, ...]
    text: str

    @property
    def finish_reason(self) -> str:
        return "stop" if self.mode == "named" else "tool_calls"

    def tool_calls(self) -> list[dict[str, Any]]:
        return [c.call() for c in self.calls]


#: P(1 call), P(2 calls): what a draw gives under parallel tool calls (otherwise 3).
_PARALLEL_P = (0.7, 0.9)


def draw_seed(req: Any, prompt_ids: list[int]) -> int:
    """The seed of the drawn output: the request's ``seed``, else the prompt's hash (same prompt, same output)."""
    h = hashlib.blake2b(dumps([req.seed, prompt_ids[-4096:], len(prompt_ids)]).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little")


def check_auto_tools(state: ServerState, req: Any) -> None:
    if req.tool_choice == "auto" and req.tools and not (state.opts.enable_auto_tool_choice
                                                        and state.opts.tool_call_parser):
        raise bad_request(AUTO_TOOL_CHOICE_ERROR)


def _num_calls(req: Any, tools: list[dict[str, Any]], mode: str, seed: int) -> int:
    """How many calls the simulated model makes at once: with several tools and ``parallel_tool_calls`` on (the
    default) a seeded draw gives 2 or 3 now and then (``_PARALLEL_P``); a named tool choice is one call."""
    if mode == "named" or req.parallel_tool_calls is False or len(tools) < 2:
        return 1
    r = random.Random(seed ^ 0x9A3A11E1).random()
    return 1 if r < _PARALLEL_P[0] else 2 if r < _PARALLEL_P[1] else 3


def _arguments(params: Any, seed: int, guided: bool) -> str:
    schema = params if isinstance(params, dict) else {"type": "object"}
    if guided:              # named / required: vLLM guides decoding with the parameters' schema and checks it first
        check_schema_patterns(schema)
        return json.dumps(instance_of(schema, seed))
    try:                    # auto: nothing constrains the model, so a pattern no draw meets is simply not met
        return json.dumps(instance_of(schema, seed))
    except StructuredOutputError:
        return json.dumps(instance_of(_without_patterns(schema), seed))


def _without_patterns(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _without_patterns(v) for k, v in node.items() if not (k == "pattern" and isinstance(v, str))}
    if isinstance(node, list):
        return [_without_patterns(v) for v in node]
    return node


def plan_tool_call(req: Any, messages: list[dict[str, Any]], seed: int) -> ToolPlan | None:
    """The calls this request makes, or None (no tools, ``tool_choice`` "none", or ``auto`` answering a result)."""
    tools = [t for t in req.tools or [] if isinstance(t, dict) and isinstance(t.get("function"), dict)]
    choice = req.tool_choice
    if not tools or choice is None or choice == "none":
        return None
    rng = random.Random(seed)
    if isinstance(choice, dict):
        mode, names = "named", [choice["function"]["name"]]
    else:
        if choice == "auto" and messages and messages[-1].get("role") == "tool":
            return None
        mode = choice
        names = [rng.choice(tools)["function"].get("name", "")]
        extra = random.Random(seed + 1)     # the first call is drawn as a single call is: adding calls keeps it
        more = _num_calls(req, tools, mode, seed) - 1
        names += [extra.choice(tools)["function"].get("name", "") for _ in range(more)]
    calls: list[DrawnCall] = []
    text = "[" if mode == "required" else ""
    for i, name in enumerate(names):
        fn = next(t["function"] for t in tools if t["function"].get("name") == name)
        args = _arguments(fn.get("parameters"), seed if i == 0 else seed + 7919 * i, mode != "auto")
        qname = json.dumps(name)
        if mode == "required":
            text += (", " if i else "") + f'{{"name": {qname}, "parameters": '
        elif mode == "auto":
            text += ("\n" if i else "") + f'<tool_call>\n{{"name": {qname}, "arguments": '
        call_id = f"chatcmpl-tool-{uuid.uuid4().hex}"     # unique per call, as vLLM's (agents key results by it)
        calls.append(DrawnCall(call_id, name, args, len(text)))
        text += args
        if mode == "required":
            text += "}"
        elif mode == "auto":
            text += "}\n</tool_call>"
    if mode == "required":
        text += "]"
    return ToolPlan(mode, tuple(calls), text)


def chat_generation(state: ServerState, request: Request, req: Any, rid: str, lora: str | None, stops: list[str],
                    messages: list[dict[str, Any]], prompt_ids: list[int]) -> Generation:
    """The chat request's ``Generation``: a tool call, a structured output, or free text."""
    seed = draw_seed(req, prompt_ids)
    try:
        plan = plan_tool_call(req, messages, seed)
        if plan is not None:
            gen: Generation = ToolCallGeneration(state, request, req, rid, lora, stops, is_chat=True, plan=plan)
            gen.fixed_output = state.tok.encode(plan.text, False)
            return gen
        text = constrained_text(req.response_format, req.structured_outputs, seed)
    except StructuredOutputError as exc:       # refused by the engine: a 400, or the stream's error event
        gen = Generation(state, request, req, rid, lora, stops, is_chat=True)
        gen.engine_error = exc
        return gen
    gen = Generation(state, request, req, rid, lora, stops, is_chat=True)
    if text is not None:
        gen.fixed_output = state.tok.encode(text, False)
    return gen


class ToolCallGeneration(Generation):
    """A chat generation whose output is a tool call: the message carries ``tool_calls``, and a stream carries
    the arguments as they are released (the first tool-call delta with the call's id and name, as vLLM's)."""

    def __init__(self, *args: Any, plan: ToolPlan, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.plan = plan
        self._args_sent: dict[tuple[int, int], int] = {}      # (choice, call) -> argument characters sent

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
            msg["tool_calls"] = self.plan.tool_calls()
            choice["finish_reason"] = self.plan.finish_reason
        return body

    def _chat_chunk(self, index: int, text: str | None, finish: str | None, stop_reason: str | None,
                    token_ids: list[int] | None = None, usage: dict | None = None, logprobs: str = "null") -> str:
        plan = self.plan
        v = self.views[index]
        released = len(v.text)
        deltas = []
        for i, call in enumerate(plan.calls):
            if released < call.start:
                break           # this call's header is still being emitted: nothing a parser would send yet
            end = min(released - call.start, len(call.arguments))
            start = self._args_sent.get((index, i))
            if start is None:   # vLLM's first delta of a call: its index, id, type and name
                deltas.append({"id": call.call_id, "type": "function", "index": i,
                               "function": {"name": call.name, "arguments": call.arguments[:end]}})
            elif end > start:
                deltas.append({"index": i, "function": {"arguments": call.arguments[start:end]}})
            else:
                continue
            self._args_sent[(index, i)] = end
        if not deltas and finish is None:
            return ""
        delta: dict[str, Any] = {"tool_calls": deltas} if deltas else {}
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
