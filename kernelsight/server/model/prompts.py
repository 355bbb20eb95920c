"""Request inputs to token ids: a completion's ``prompt`` in its four shapes (``completion_prompts``), chat
messages with content parts joined for the template (``normalize_messages``, also /tokenize's), the cheap length
pre-check before tokenizing, and big texts encoded off the event loop."""

from __future__ import annotations

import asyncio
from typing import Any

from kernelsight.server.model.tokenizer import ServerTokenizer
from kernelsight.server.state import ServerState
from kernelsight.server.wire.errors import APIError, bad_request
from kernelsight.server.wire.protocol.version import MAX_COMPLETION_PROMPTS


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Content parts ([{"type":"text","text":...}]) become one string, as vLLM does for string templates."""
    out = []
    for m in messages:
        if not isinstance(m, dict) or "role" not in m:
            raise bad_request("Each message must be an object with a 'role'.", "messages")
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if isinstance(part, dict) and part.get("type") == "text":
                    texts.append(str(part.get("text", "")))
                elif isinstance(part, str):
                    texts.append(part)
            content = "\n".join(texts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise bad_request("Message content must be a string or a list of content parts.", "messages")
        out.append({**m, "content": content})
    return out


def too_many_chars(state: ServerState, n_chars: int) -> APIError:
    """vLLM's error for a text too long to fit even before tokenizing it (``state.max_chars``)."""
    L = state.max_model_len
    return bad_request(f"This model's maximum context length is {L} tokens. However, your prompt contains {n_chars} "
                       f"characters (more than {state.max_chars} characters, which is the upper bound for {L} input "
                       f"tokens). Please reduce the length of the input prompt.", "input_text")


async def encode_prompt(tok: ServerTokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """``tok.encode``, in a worker thread for big texts."""
    if len(text) > 65536:   # big inputs off the event loop, so other streams keep their timing
        return await asyncio.to_thread(tok.encode, text, add_special_tokens)
    return tok.encode(text, add_special_tokens)


async def completion_prompts(state: ServerState, prompt: Any, add_special: bool) -> list[tuple[list[int], str | None]]:
    """(token ids, text or None) per prompt."""
    empty = bad_request("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
    if prompt is None or (isinstance(prompt, str | list) and len(prompt) == 0):
        raise empty
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif isinstance(prompt[0], int):
        items = [prompt]
    else:
        items = list(prompt)
    if len(items) > MAX_COMPLETION_PROMPTS:
        raise bad_request(f"At most {MAX_COMPLETION_PROMPTS} prompts are allowed, got {len(items)}.", "prompt")
    out = []
    vocab = state.tok.vocab_size
    for item in items:
        if isinstance(item, str):
            if not item:
                raise empty
            if len(item) > state.max_chars:
                raise too_many_chars(state, len(item))
            out.append((await encode_prompt(state.tok, item, add_special), item))
        else:
            if not item:
                raise empty
            bad = [t for t in item if t < 0 or t >= vocab]
            if bad:
                raise bad_request(f"Token id {bad[0]} is out of vocabulary", "prompt")
            out.append((list(item), None))
    return out
