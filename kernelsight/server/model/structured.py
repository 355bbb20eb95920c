"""Structured outputs without a model: a JSON value drawn from a JSON schema (``instance_of``), deterministically
from a seed, and the text a request's ``response_format`` / ``structured_outputs`` constrains the output to
(``constrained_text``): a JSON value, one of the choices, a string matching a regex (``regex_sample``; a schema's
``pattern`` too) or one a grammar derives (``grammar_sample``).

What vLLM's engine refuses when it validates a request's structured-output parameters (its default "auto" backend:
xgrammar, then llguidance) is a ``StructuredOutputError``: a 400, or in a stream the in-stream error event, as the
engine's input processor raises it inside ``generate()``. A regex with look-around or back-references is refused
(neither backend takes them); an invalid regex or grammar is refused with llguidance's "Grammar error: " prefix; a
grammar this simulator cannot generate from (see ``grammar_sample``) is refused the same way, since emitting text
the grammar might reject would break the client's parser.

vLLM constrains decoding with a grammar, so a finished constrained output always parses and validates; here the
whole output is drawn up front, tokenized, and released token by token like any other output (see
``Generation.fixed_output``), so its timing is that of its real token count."""

from __future__ import annotations

import json
import math
import random
import re
from typing import Any

from kernelsight.server.model.grammar_sample import GrammarNotSupported, parse_grammar, sample_grammar
from kernelsight.server.model.regex_sample import RegexNotSupported, RegexUnsatisfiable, check_regex, sample_regex
from kernelsight.server.wire.errors import APIError, bad_request

#: Words the strings are made of (short, ASCII: every token decodes on its own, so deltas join exactly).
_WORDS = ("alpha", "bravo", "cedar", "delta", "ember", "fjord", "garnet", "harbor", "iris", "juniper", "kelp",
          "lumen", "maple", "nectar", "onyx", "prairie", "quartz", "river", "sage", "tundra", "umber", "violet",
          "willow", "xenon", "yarrow", "zephyr")
#: Depth past which optional members are left out and arrays kept empty (recursive schemas must end).
_MAX_DEPTH = 6
#: String formats (xgrammar's set) as regexes the value is drawn from; the ones the draw cannot express exactly
#: (a valid calendar date) are kept inside their valid range by construction.
_FORMAT_REGEXES = {
    "date": r"20[0-3]\d-(0[1-9]|1[0-2])-(0[1-9]|1\d|2[0-8])",
    "time": r"([01]\d|2[0-3]):[0-5]\d:[0-5]\dZ",
    "date-time": r"20[0-3]\d-(0[1-9]|1[0-2])-(0[1-9]|1\d|2[0-8])T([01]\d|2[0-3]):[0-5]\d:[0-5]\dZ",
    "duration": r"P[1-9]DT[1-9]H", "email": r"[a-z]{3,8}(\.[a-z]{3,8})?@[a-z]{4,9}\.(com|org|net)",
    "uuid": r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}",
    "ipv4": r"(19[2-8]|1[0-8]\d|[1-9]\d?)\.(1?\d\d?)\.(1?\d\d?)\.(1?\d\d?)",
    "ipv6": r"2001:db8(:[1-9a-f][0-9a-f]{0,3}){6}", "hostname": r"[a-z]{4,9}\.(com|org|net)",
    "uri": r"https://[a-z]{4,9}\.com/[a-z]{3,8}", "url": r"https://[a-z]{4,9}\.com/[a-z]{3,8}",
    "uri-reference": r"/[a-z]{3,8}/[1-9]\d?", "uri-template": r"https://[a-z]{4,9}\.com/\{id\}",
    "json-pointer": r"/[a-z]{3,8}/[0-9]", "relative-json-pointer": r"[0-9]/[a-z]{3,8}",
}


class StructuredOutputError(APIError):
    """A 400 the engine raises when it validates the request's structured outputs (in a stream: the in-stream
    error event, as vLLM's input processor raises it inside ``generate()``)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "BadRequestError", 400, None)


def _regex_error(pattern: str) -> StructuredOutputError | None:
    try:
        check_regex(pattern)
    except (re.error, RegexNotSupported) as exc:
        return StructuredOutputError(f"Grammar error: invalid regex {pattern!r}: {exc}")
    except (RecursionError, OverflowError):
        return StructuredOutputError(f"Grammar error: regex {pattern[:100]!r} is nested too deeply")
    return None


def check_schema_patterns(schema: Any) -> None:
    """vLLM compiles the whole schema: a bad ``pattern`` anywhere in it refuses the request."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            pat = node.get("pattern")
            if isinstance(pat, str) and (err := _regex_error(pat)) is not None:
                raise err
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


class _Draw:
    def __init__(self, root: dict[str, Any], seed: int) -> None:
        self.root = root
        self.rng = random.Random(seed)

    def _resolve(self, schema: Any) -> Any:
        ref = schema.get("$ref") if isinstance(schema, dict) else None
        seen = 0
        while isinstance(ref, str) and ref.startswith("#") and seen < 32:
            node: Any = self.root
            for part in ref.lstrip("#").strip("/").split("/"):
                if not part:
                    continue
                node = node.get(part.replace("~1", "/").replace("~0", "~"), {}) if isinstance(node, dict) else {}
            merged = {k: v for k, v in schema.items() if k != "$ref"}
            schema = {**node, **merged} if isinstance(node, dict) else merged
            ref = schema.get("$ref")
            seen += 1
        return schema

    def value(self, schema: Any, depth: int = 0) -> Any:
        if schema is True or schema is None or schema == {}:
            return self._words(1, 3) if depth > 0 else {}
        if schema is False or not isinstance(schema, dict):
            return None
        schema = self._resolve(schema)
        if "const" in schema:
            return schema["const"]
        if isinstance(schema.get("enum"), list) and schema["enum"]:
            return self.rng.choice(schema["enum"])
        if isinstance(schema.get("allOf"), list):
            merged: dict[str, Any] = {}
            for part in schema["allOf"]:
                part = self._resolve(part)
                if isinstance(part, dict):
                    props = {**merged.get("properties", {}), **part.get("properties", {})}
                    req = list(dict.fromkeys([*merged.get("required", []), *part.get("required", [])]))
                    merged = {**merged, **part, "properties": props, "required": req}
            rest = {k: v for k, v in schema.items() if k != "allOf"}
            return self.value({**merged, **rest}, depth)
        for key in ("anyOf", "oneOf"):
            if isinstance(schema.get(key), list) and schema[key]:
                # the first alternative: oneOf needs exactly one match, and alternatives usually differ by type
                rest = {k: v for k, v in schema.items() if k != key}
                return self.value({**rest, **self._resolve(schema[key][0])}, depth)
        t = schema.get("type")
        if isinstance(t, list):
            t = next((x for x in t if x != "null"), "null")
        if t is None:
            t = ("object" if "properties" in schema else "array" if "items" in schema else
                 "string" if "minLength" in schema or "maxLength" in schema else "string")
        return getattr(self, "_" + t, self._string)(schema, depth)

    def _object(self, schema: dict[str, Any], depth: int) -> dict[str, Any]:
        props = schema.get("properties") or {}
        required = set(schema.get("required") or [])
        out: dict[str, Any] = {}
        for name, sub in props.items():
            if name in required or depth < _MAX_DEPTH:
                out[name] = self.value(sub, depth + 1)
        n_min = schema.get("minProperties", 0)
        extra = schema.get("additionalProperties", True)
        i = 0
        while len(out) < n_min and extra is not False:
            out[f"field_{i}"] = self.value(extra if isinstance(extra, dict) else {"type": "string"}, depth + 1)
            i += 1
        return out

    def _array(self, schema: dict[str, Any], depth: int) -> list[Any]:
        lo = int(schema.get("minItems", 0))
        hi = int(schema.get("maxItems", max(lo, 3)))
        n = lo if depth >= _MAX_DEPTH else self.rng.randint(max(lo, min(1, hi)), max(lo, min(hi, lo + 3)))
        prefix = schema.get("prefixItems") or []
        items = schema.get("items", {})
        out = [self.value(prefix[i] if i < len(prefix) else items, depth + 1) for i in range(n)]
        if schema.get("uniqueItems"):
            seen, uniq = set(), []
            for v in out:
                key = json.dumps(v, sort_keys=True)
                if key not in seen:
                    seen.add(key)
                    uniq.append(v)
            out = uniq if len(uniq) >= lo else out
        return out

    def _string(self, schema: dict[str, Any], depth: int) -> str:
        lo = int(schema.get("minLength", 0))
        hi = schema.get("maxLength")
        pattern = schema.get("pattern")
        if isinstance(pattern, str):
            # a pattern wins over the length bounds when no draw meets both (xgrammar drops them beside it)
            try:
                return sample_regex(pattern, self.rng.getrandbits(63), min_len=lo,
                                    max_len=int(hi) if hi is not None else None)
            except (re.error, RegexUnsatisfiable, RecursionError):
                raise StructuredOutputError(f"Grammar error: no string matches the pattern {pattern!r}") from None
        fmt = schema.get("format")
        fmt_re = _FORMAT_REGEXES.get(fmt) if isinstance(fmt, str) else None
        s = sample_regex(fmt_re, self.rng.getrandbits(63)) if fmt_re is not None else self._words(1, 4)
        while len(s) < lo:
            s += " " + self._words(1, 2)
        if hi is not None and len(s) > int(hi):
            s = s[: int(hi)].rstrip() or s[: int(hi)]
        return s

    def _number(self, schema: dict[str, Any], depth: int, integer: bool = False) -> float | int:
        # draft 6+: exclusiveMinimum / exclusiveMaximum are numbers of their own
        ex_lo = schema.get("exclusiveMinimum") if not isinstance(schema.get("exclusiveMinimum"), bool) else None
        ex_hi = schema.get("exclusiveMaximum") if not isinstance(schema.get("exclusiveMaximum"), bool) else None
        lo = schema.get("minimum", ex_lo)
        hi = schema.get("maximum", ex_hi)
        excl_lo = "minimum" not in schema and ex_lo is not None
        excl_hi = "maximum" not in schema and ex_hi is not None
        lo_f = float(lo) if lo is not None else (float(hi) - 100 if hi is not None else 0.0)
        hi_f = float(hi) if hi is not None else lo_f + 100
        if integer:
            a = math.floor(lo_f) + 1 if excl_lo else math.ceil(lo_f)
            b = math.ceil(hi_f) - 1 if excl_hi else math.floor(hi_f)
            v = self.rng.randint(a, max(a, b))
            step = schema.get("multipleOf")
            if isinstance(step, int) and step > 0 and math.ceil(a / step) * step <= b:
                v = self.rng.randint(math.ceil(a / step), b // step) * step
            return v
        v = round(self.rng.uniform(lo_f, hi_f), 2)
        if (excl_lo and v <= lo_f) or (excl_hi and v >= hi_f) or not lo_f <= v <= hi_f:
            v = (lo_f + hi_f) / 2
        return v

    def _integer(self, schema: dict[str, Any], depth: int) -> int:
        return int(self._number(schema, depth, integer=True))

    def _boolean(self, schema: dict[str, Any], depth: int) -> bool:
        return self.rng.random() < 0.5

    def _null(self, schema: dict[str, Any], depth: int) -> None:
        return None

    def _words(self, lo: int, hi: int) -> str:
        return " ".join(self.rng.choice(_WORDS) for _ in range(self.rng.randint(lo, hi)))


def instance_of(schema: dict[str, Any] | bool, seed: int) -> Any:
    """A JSON value valid against ``schema`` (the common JSON-schema keywords, ``pattern`` and ``format``
    included), the same for the same seed."""
    root = schema if isinstance(schema, dict) else {}
    return _Draw(root, seed).value(schema)


def _as_schema(value: Any, param: str) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise bad_request(f"Invalid JSON schema in {param}.", param) from None
    if not isinstance(value, dict | bool):
        raise bad_request(f"Invalid JSON schema in {param}.", param)
    return value if isinstance(value, dict) else {}


def constrained_text(response_format: Any, structured_outputs: Any, seed: int) -> str | None:
    """The output text a request is constrained to, or None for free text. ``response_format`` (OpenAI:
    ``json_object``, ``json_schema``) or vLLM's ``structured_outputs`` (``json``, ``regex``, ``choice``,
    ``grammar``, ``json_object``; ``structural_tag`` is left free). Raises ``StructuredOutputError`` where vLLM's
    engine refuses the parameters."""
    so = structured_outputs if isinstance(structured_outputs, dict) else None
    if so is not None:
        check_structured_outputs(so)
        if so.get("json") is not None:
            schema = _as_schema(so["json"], "structured_outputs.json")
            check_schema_patterns(schema)
            return json.dumps(instance_of(schema, seed))
        if isinstance(so.get("regex"), str):
            try:
                return sample_regex(so["regex"], seed)
            except (RegexUnsatisfiable, RecursionError) as exc:
                raise StructuredOutputError(f"Grammar error: no string matching the regex was found ({exc})"
                                            ) from None
        if isinstance(so.get("choice"), list) and so["choice"]:
            return str(random.Random(seed).choice(so["choice"]))
        if isinstance(so.get("grammar"), str):
            try:
                return sample_grammar(so["grammar"], seed)
            except GrammarNotSupported as exc:
                raise StructuredOutputError(f"Grammar error: {exc}") from None
        if so.get("json_object"):
            return json.dumps(_free_object(seed))
    rf = response_format if isinstance(response_format, dict) else None
    if rf is None:
        return None
    kind = rf.get("type")
    if kind == "json_object":
        return json.dumps(_free_object(seed))
    if kind == "json_schema":
        js = rf.get("json_schema") or {}
        schema = js.get("schema", js.get("json_schema", {})) if isinstance(js, dict) else {}
        schema = _as_schema(schema, "response_format.json_schema")
        check_schema_patterns(schema)
        return json.dumps(instance_of(schema, seed))
    return None


def check_structured_outputs(so: dict[str, Any]) -> None:
    """vLLM's engine-side checks of ``structured_outputs`` (``SamplingParams._validate_structured_outputs`` and the
    backends' compile check), in its order."""
    choice, grammar, js, regex = so.get("choice"), so.get("grammar"), so.get("json"), so.get("regex")
    if isinstance(choice, list) and not choice:
        raise StructuredOutputError(f"Choice '{choice}' cannot be an empty list")
    if isinstance(grammar, str) and grammar.strip() == "":
        raise StructuredOutputError("structured_outputs.grammar cannot be an empty string")
    if isinstance(js, str) and js.strip() == "":
        raise StructuredOutputError("structured_outputs.json cannot be an empty string")
    if so.get("json_object") is False:
        raise StructuredOutputError("structured_outputs.json_object must be True if set; omit structured_outputs "
                                    "to disable structured outputs")
    if isinstance(regex, str):
        if "\x00" in regex:
            raise StructuredOutputError("structured_outputs.regex must not contain a NUL character ('\\x00')")
        if (err := _regex_error(regex)) is not None:
            raise err
    if isinstance(grammar, str):
        try:
            parse_grammar(grammar)
        except GrammarNotSupported as exc:
            raise StructuredOutputError(f"Grammar error: {exc}") from None


def _free_object(seed: int) -> dict[str, Any]:
    """What ``json_object`` (any JSON object) gets: a small flat object."""
    d = _Draw({}, seed)
    return {"answer": d._words(2, 6), "confidence": round(d.rng.uniform(0, 1), 2)}
