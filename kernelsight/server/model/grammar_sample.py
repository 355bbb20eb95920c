"""Strings derived from a context-free grammar, drawn deterministically from a seed, for vLLM's
``structured_outputs.grammar`` (``sample_grammar``).

vLLM's default ("auto") structured-output backend takes a grammar in two syntaxes, and so does this module:

- xgrammar's EBNF / GBNF (chosen when the text contains ``::=``): ``name ::= expr``, start rule ``root``;
  string literals with escapes, character classes ``[a-z]`` / ``[^...]``, groups, ``|``, ``* + ?``, ``{m}``,
  ``{m,}``, ``{m,n}``, ``#`` comments.
- Lark, as llguidance reads it (otherwise): ``name: expr`` rules (``?`` / ``!`` prefixes), ``NAME: expr``
  terminals (``.priority`` ignored), start rule ``start``; literals (``i`` flag), ``/regex/flags``, ``"a".."z"``,
  ``[optional]``, ``~ n`` / ``~ m..n``, ``{m,n}``, ``-> alias`` (ignored), ``//`` and ``#`` comments,
  ``%import common.NAME`` (the usual common terminals), ``%ignore`` (nothing ignored is emitted, except one draw of
  it between two terminals whose touching characters would lex as one word) and ``%declare``.

Anything else (llguidance's ``%json``, ``%regex``, ``%llguidance``, special tokens ``<...>``, Lark templates,
``&`` / ``~`` regex operators) raises ``GrammarNotSupported``: the server answers 400 rather than emit text the
grammar might not accept. Terminals that are regexes are drawn by ``regex_sample``.

Derivations stay finite: past ``MAX_DEPTH`` nested rules every choice takes the alternative with the shallowest
finite derivation and every repeat its minimum (a grammar whose start rule has no finite derivation raises
``GrammarNotSupported``)."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

from kernelsight.server.model.regex_sample import RegexUnsatisfiable, sample_regex

__all__ = ["MAX_DEPTH", "GrammarNotSupported", "sample_grammar"]

#: Rule nesting past which the shortest derivations are taken.
MAX_DEPTH = 8
#: Extra items an unbounded repeat (``*``, ``+``, ``{m,}``) adds beyond its minimum, at most.
_REPEAT_EXTRA = 3
_INF = 1 << 30


class GrammarNotSupported(ValueError):
    """A grammar that does not parse, or uses what this module does not generate from."""


# -- AST: ("lit", text) ("re", pattern) ("ref", name) ("seq", [..]) ("alt", [..]) ("rep", lo, hi, node) ----------

@dataclass
class _Grammar:
    rules: dict[str, Any]
    start: str
    ignore: str | None = None      # a regex of ignored text (Lark %ignore), or None
    lark: bool = False


_COMMON = {
    "DIGIT": r"[0-9]", "HEXDIGIT": r"[a-fA-F0-9]", "INT": r"[0-9]+", "SIGNED_INT": r"[+-]?[0-9]+",
    "DECIMAL": r"[0-9]+\.[0-9]*|\.[0-9]+", "_EXP": r"[eE][+-]?[0-9]+",
    "FLOAT": r"[0-9]+[eE][+-]?[0-9]+|([0-9]+\.[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?",
    "SIGNED_FLOAT": r"[+-]?([0-9]+[eE][+-]?[0-9]+|([0-9]+\.[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?)",
    "NUMBER": r"[0-9]+(\.[0-9]*)?", "SIGNED_NUMBER": r"[+-]?[0-9]+(\.[0-9]*)?",
    "LCASE_LETTER": r"[a-z]", "UCASE_LETTER": r"[A-Z]", "LETTER": r"[a-zA-Z]", "WORD": r"[a-zA-Z]+",
    "CNAME": r"[a-zA-Z_][a-zA-Z0-9_]*", "ESCAPED_STRING": r'"[a-zA-Z0-9 ,.!?]*"', "WS_INLINE": r"[ \t]+",
    "WS": r"[ \t\f\r\n]+", "CR": r"\r", "LF": r"\n", "NEWLINE": r"(\r?\n)+",
}

_TOKEN = re.compile(r"""
    (?P<ws>\s+)
  | (?P<comment>(?:\#|//)[^\n]*)
  | (?P<define>::=)
  | (?P<string>"(?:[^"\\]|\\.)*"i?)
  | (?P<regex>/(?:[^/\\\n]|\\.)+/[imsulx]*)
  | (?P<cls>\[\^?(?:[^\]\\]|\\.)*\])
  | (?P<range>\.\.)
  | (?P<brace>\{\s*\d*\s*(?:,\s*\d*\s*)?\})
  | (?P<arrow>->\s*[A-Za-z_][\w]*)
  | (?P<path>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)
  | (?P<name>[?!]?[A-Za-z_][\w\-]*(?:\.-?\d+)?)
  | (?P<directive>%[A-Za-z_]+)
  | (?P<num>\d+)
  | (?P<op>[():|*+?~\[\]])
""", re.VERBOSE)


def _tokens(text: str, lark: bool) -> list[tuple[str, str]]:
    out, i = [], 0
    while i < len(text):
        m = _TOKEN.match(text, i)
        if m is None:
            raise GrammarNotSupported(f"unexpected {text[i:i + 12]!r} at position {i}")
        kind = m.lastgroup
        if kind == "cls" and lark:      # Lark has no character classes outside /regex/: "[" opens an optional
            out.append(("op", "["))
            i += 1
            continue
        if kind not in ("ws", "comment"):
            out.append((kind, m.group()))
        elif kind == "ws" and "\n" in m.group():
            out.append(("nl", "\n"))
        i = m.end()
    return out


def _unescape(body: str) -> str:
    try:
        return body.encode("latin-1", "backslashreplace").decode("unicode_escape")
    except UnicodeDecodeError:
        raise GrammarNotSupported(f"bad escape in {body!r}") from None


class _Parser:
    def __init__(self, toks: list[tuple[str, str]], lark: bool) -> None:
        self.toks = toks
        self.i = 0
        self.lark = lark

    def peek(self, k: int = 0) -> tuple[str, str] | None:
        j = self.i + k
        return self.toks[j] if j < len(self.toks) else None

    def at_rule_start(self) -> bool:
        a, b = self.peek(), self.peek(1)
        if a is None or a[0] != "name":
            return False
        return b is not None and (b == ("define", "::=") if not self.lark else b == ("op", ":"))

    def skip_nl(self) -> None:
        while self.peek() is not None and self.peek()[0] == "nl":
            self.i += 1

    def expr(self) -> Any:
        alts = [self.seq()]
        while True:
            self.skip_nl_if_continued()
            t = self.peek()
            if t == ("op", "|"):
                self.i += 1
                alts.append(self.seq())
            else:
                break
        return alts[0] if len(alts) == 1 else ("alt", alts)

    def skip_nl_if_continued(self) -> None:
        # a newline ends a rule unless the next line goes on with "|" (Lark) or is not a new rule (EBNF)
        j = self.i
        while j < len(self.toks) and self.toks[j][0] == "nl":
            j += 1
        if j == self.i or j >= len(self.toks):
            return
        nxt = self.toks[j]
        save = self.i
        self.i = j
        if nxt == ("op", "|") or (not self.lark and not self.at_rule_start() and nxt[0] != "directive"):
            return
        self.i = save

    def seq(self) -> Any:
        items = []
        while True:
            self.skip_nl_if_continued()
            t = self.peek()
            if t is None or t[0] in ("nl", "directive") or t in (("op", "|"), ("op", ")"), ("op", "]")) \
                    or self.at_rule_start():
                break
            if t[0] == "arrow":
                self.i += 1
                continue
            items.append(self.postfix(self.atom()))
        return items[0] if len(items) == 1 else ("seq", items)

    def atom(self) -> Any:
        kind, text = self.peek()
        self.i += 1
        if kind == "string":
            flag_i = text.endswith("i")
            lit = _unescape(text[1:-2] if flag_i else text[1:-1])
            nxt = self.peek()
            if self.lark and nxt == ("range", ".."):
                self.i += 1
                k2, t2 = self.peek()
                self.i += 1
                if k2 != "string":
                    raise GrammarNotSupported("a range needs two literals")
                hi = _unescape(t2[1:-1])
                return ("re", f"[{re.escape(lit)}-{re.escape(hi)}]")
            return ("lit", lit)
        if kind == "regex":
            body, flags = text[1:].rsplit("/", 1)
            return ("re", (f"(?{flags})" if flags else "") + body)
        if kind == "cls":
            return ("re", text)
        if kind == "name":
            if text[0] in "?!":
                raise GrammarNotSupported(f"unexpected {text!r}")
            return ("ref", text.split(".")[0])
        if (kind, text) == ("op", "("):
            inner = self.expr()
            self.expect(("op", ")"))
            return inner
        if (kind, text) == ("op", "[") and self.lark:
            inner = self.expr()
            self.expect(("op", "]"))
            return ("rep", 0, 1, inner)
        if kind == "op" and text == "<" or text.startswith("<"):
            raise GrammarNotSupported("special tokens are not supported")
        raise GrammarNotSupported(f"unexpected {text!r}")

    def expect(self, tok: tuple[str, str]) -> None:
        self.skip_nl_if_continued()
        if self.peek() != tok:
            raise GrammarNotSupported(f"expected {tok[1]!r}")
        self.i += 1

    def postfix(self, node: Any) -> Any:
        while True:
            t = self.peek()
            if t is None:
                return node
            kind, text = t
            if (kind, text) == ("op", "*"):
                node = ("rep", 0, None, node)
            elif (kind, text) == ("op", "+"):
                node = ("rep", 1, None, node)
            elif (kind, text) == ("op", "?"):
                node = ("rep", 0, 1, node)
            elif kind == "brace":
                body = text[1:-1].replace(" ", "")
                lo_s, _, hi_s = body.partition(",")
                lo = int(lo_s or 0)
                hi = lo if "," not in body else (int(hi_s) if hi_s else None)
                node = ("rep", lo, hi, node)
            elif (kind, text) == ("op", "~") and self.lark:
                self.i += 1
                k1, n1 = self.peek()
                self.i += 1
                lo = hi = int(n1)
                if self.peek() == ("range", ".."):
                    self.i += 1
                    hi = int(self.peek()[1])
                    self.i += 1
                node = ("rep", lo, hi, node)
                continue
            else:
                return node
            self.i += 1

    def grammar(self) -> _Grammar:
        rules: dict[str, Any] = {}
        ignore: list[Any] = []
        while True:
            self.skip_nl()
            t = self.peek()
            if t is None:
                break
            if t[0] == "directive":
                self.directive(rules, ignore)
                continue
            if not self.at_rule_start():
                raise GrammarNotSupported(f"expected a rule definition at {t[1]!r}")
            name = t[1].lstrip("?!").split(".")[0]
            self.i += 2
            rules[name] = self.expr()
        start = "start" if self.lark else "root"
        if start not in rules:
            raise GrammarNotSupported(f"the grammar has no {start!r} rule")
        for node in rules.values():
            for ref in _refs(node):
                if ref not in rules:
                    raise GrammarNotSupported(f"rule {ref!r} is not defined")
        ign = None
        if ignore:
            ign = "|".join(f"(?:{_as_regex(n, rules, 0)})" for n in ignore)
        return _Grammar(rules, start, ign, self.lark)

    def directive(self, rules: dict[str, Any], ignore: list[Any]) -> None:
        _, word = self.peek()
        self.i += 1
        if word == "%import":
            _, path = self.peek()
            self.i += 1
            names = [path.rsplit(".", 1)[-1]]
            if self.peek() == ("op", "("):    # %import common (A, B)
                self.i += 1
                names = []
                while self.peek() not in (None, ("op", ")")):
                    if self.peek()[0] == "name":
                        names.append(self.peek()[1])
                    self.i += 1
                self.i += 1
            elif self.peek() is not None and self.peek()[0] == "arrow":
                alias = self.peek()[1][2:].strip()
                self.i += 1
                names = [(names[0], alias)]      # type: ignore[list-item]
            for n in names:
                src, dst = n if isinstance(n, tuple) else (n, n)
                if src not in _COMMON:
                    raise GrammarNotSupported(f"%import of {src!r} is not supported (common terminals only)")
                rules[dst] = ("re", _COMMON[src])
        elif word == "%ignore":
            ignore.append(self.seq())
        elif word == "%declare":
            while self.peek() is not None and self.peek()[0] == "name":
                rules.setdefault(self.peek()[1], ("lit", ""))
                self.i += 1
        else:
            raise GrammarNotSupported(f"{word} is not supported")


def _refs(node: Any) -> Any:
    kind = node[0]
    if kind == "ref":
        yield node[1]
    elif kind in ("seq", "alt"):
        for n in node[1]:
            yield from _refs(n)
    elif kind == "rep":
        yield from _refs(node[3])


def _as_regex(node: Any, rules: dict[str, Any], depth: int) -> str:
    """A (non-recursive) node as a regex: for %ignore."""
    kind = node[0]
    if depth > 20:
        raise GrammarNotSupported("recursive %ignore")
    if kind == "lit":
        return re.escape(node[1])
    if kind == "re":
        return node[1]
    if kind == "ref":
        return f"(?:{_as_regex(rules[node[1]], rules, depth + 1)})"
    if kind == "seq":
        return "".join(f"(?:{_as_regex(n, rules, depth + 1)})" for n in node[1])
    if kind == "alt":
        return "|".join(f"(?:{_as_regex(n, rules, depth + 1)})" for n in node[1])
    hi = "" if node[2] is None else node[2]
    return f"(?:{_as_regex(node[3], rules, depth + 1)}){{{node[1]},{hi}}}"


def _min_depths(rules: dict[str, Any]) -> dict[str, int]:
    """Per rule: the least rule nesting of a finite derivation (_INF: none), by fixpoint."""
    depth = {name: _INF for name in rules}

    def cost(node: Any) -> int:
        kind = node[0]
        if kind in ("lit", "re"):
            return 0
        if kind == "ref":
            d = depth[node[1]]
            return d + 1 if d < _INF else _INF
        if kind == "seq":
            return max((cost(n) for n in node[1]), default=0)
        if kind == "alt":
            return min(cost(n) for n in node[1])
        return 0 if node[1] == 0 else cost(node[3])

    changed = True
    while changed:
        changed = False
        for name, node in rules.items():
            c = cost(node)
            if c < depth[name]:
                depth[name] = c
                changed = True
    depth["__cost__"] = cost      # type: ignore[assignment]
    return depth


class _Walk:
    def __init__(self, g: _Grammar, rng: random.Random) -> None:
        self.g = g
        self.rng = rng
        self.depths = _min_depths(g.rules)
        self.cost = self.depths["__cost__"]
        self.out: list[str] = []
        self.size = 0
        self.in_terminal = 0        # inside a Lark terminal (NAME): one lexeme, nothing ignored in between
        self.lexeme_start = False

    def emit(self, s: str, terminal: bool) -> None:
        if not s:
            return
        boundary = not self.in_terminal or self.lexeme_start
        self.lexeme_start = False
        if boundary and self.g.ignore is not None and self.out:
            prev = self.out[-1]
            if (prev[-1].isalnum() or prev[-1] == "_") and (s[0].isalnum() or s[0] == "_"):
                self.out.append(sample_regex(self.g.ignore, self.rng.getrandbits(63), min_len=1, max_len=1))
        self.out.append(s)
        self.size += len(s)
        if self.size > 50_000:
            raise GrammarNotSupported("the derivation grows without bound")

    def node(self, node: Any, depth: int) -> None:
        kind = node[0]
        rng = self.rng
        if kind == "lit":
            self.emit(node[1], True)
        elif kind == "re":
            self.emit(sample_regex(node[1], rng.getrandbits(63)), True)
        elif kind == "ref":
            lexeme = self.g.lark and node[1].lstrip("_")[:1].isupper()
            if lexeme:
                self.in_terminal += 1
                self.lexeme_start = self.in_terminal == 1
            self.node(self.g.rules[node[1]], depth + 1)
            if lexeme:
                self.in_terminal -= 1
        elif kind == "seq":
            for n in node[1]:
                self.node(n, depth)
        elif kind == "alt":
            alts = node[1]
            if depth >= MAX_DEPTH:
                best = min(self.cost(a) for a in alts)
                alts = [a for a in alts if self.cost(a) == best]
            else:
                alts = [a for a in alts if self.cost(a) < _INF] or alts
            self.node(rng.choice(alts), depth)
        else:
            _, lo, hi, sub = node
            if depth >= MAX_DEPTH:
                n = lo
            else:
                top = lo + _REPEAT_EXTRA if hi is None else min(hi, lo + _REPEAT_EXTRA)
                n = lo + int((top - lo + 1) * rng.random() ** 2)     # skewed short, as answers are
            for _ in range(n):
                self.node(sub, depth)


def parse_grammar(text: str) -> _Grammar:
    """The grammar (``GrammarNotSupported`` if it does not parse or uses what is not generated from)."""
    lark = "::=" not in text
    if re.search(r"%(json|regex|llguidance)\b", text):
        raise GrammarNotSupported("llguidance extensions (%json, %regex, %llguidance) are not supported")
    try:
        g = _Parser(_tokens(text, lark), lark).grammar()
        for node in g.rules.values():
            _check_regexes(node)
        depth = _min_depths(g.rules)[g.start]
    except GrammarNotSupported:
        raise
    except RecursionError:
        raise GrammarNotSupported("the grammar is nested too deeply") from None
    except (IndexError, TypeError, ValueError):      # the token stream ended or broke off mid-construct
        raise GrammarNotSupported("the grammar ends in the middle of an expression") from None
    if depth >= _INF:
        raise GrammarNotSupported(f"rule {g.start!r} has no finite derivation")
    return g


def _check_regexes(node: Any) -> None:
    kind = node[0]
    if kind == "re":
        try:
            re.compile(node[1])
        except re.error as exc:
            raise GrammarNotSupported(f"invalid regex {node[1]!r}: {exc}") from None
    elif kind in ("seq", "alt"):
        for n in node[1]:
            _check_regexes(n)
    elif kind == "rep":
        _check_regexes(node[3])


def sample_grammar(text: str, seed: int) -> str:
    """A string the grammar derives, the same for the same seed."""
    g = parse_grammar(text)
    w = _Walk(g, random.Random(seed))
    try:
        w.node(("ref", g.start), 0)
    except RegexUnsatisfiable as exc:
        raise GrammarNotSupported(str(exc)) from None
    except RecursionError:
        raise GrammarNotSupported("the grammar is nested too deeply") from None
    return "".join(w.out)
