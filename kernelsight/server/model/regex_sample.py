"""Strings that match a regular expression, drawn deterministically from a seed (``sample_regex``), for vLLM's
``structured_outputs.regex`` and a JSON schema's ``pattern``; and the check of which regexes vLLM's structured-output
backends accept at all (``check_regex``).

The generator walks Python's own parse tree of the pattern (``re._parser``): literals, classes (negated ones
too), the categories ``\\d \\w \\s`` and their negations, ``.``, alternation, groups (capturing, named,
non-capturing, inline flags), greedy and lazy repeats, anchors, word boundaries and back-references. Every draw is
checked with ``re.fullmatch`` before it is returned; a draw that fails (an anchor or ``\\b`` in a place the walk
cannot honour) is retried with the next state of the same seeded generator, and if ``ATTEMPTS`` draws all fail,
``RegexUnsatisfiable`` is raised: the caller never gets a string that does not match.

Bounded expansion: a repeat emits between its minimum and ``min(maximum, minimum + REPEAT_CAP)`` items, so ``*``,
``+`` and ``{n,}`` (and a wide ``{m,n}``) stay short, as a model's answer would. Characters are drawn from printable
ASCII (letters and digits first), so every token of the answer decodes on its own; a class with no ASCII member
gives one of its own characters."""

from __future__ import annotations

import functools
import random
import re
import re._constants as sre
import re._parser as sre_parse
import warnings
from typing import Any

__all__ = ["ATTEMPTS", "REPEAT_CAP", "RegexNotSupported", "RegexUnsatisfiable", "check_regex", "sample_regex"]

#: A repeat emits at most this many items beyond its minimum.
REPEAT_CAP = 8
#: Draws tried before giving up on a pattern (each one checked with re.fullmatch).
ATTEMPTS = 64
#: Longest string a draw may build (a nest of repeats cannot blow up).
_MAX_CHARS = 20_000

_ALNUM = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
_PUNCT = " !\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"
#: The characters a class or ``.`` is drawn from, readable ones first (ties are broken by this order).
_POOL = _ALNUM + _PUNCT + "\t\n\r\x0b\x0c"
_NON_ASCII = "éüßøλжあ中"
_WORD_EXTRA = "_"
_SPACE = " \t\n\r\x0b\x0c"


class RegexNotSupported(ValueError):
    """A construct vLLM's structured-output backends refuse (xgrammar and llguidance alike): look-around,
    back-references, conditionals, atomic groups and possessive repeats."""


class RegexUnsatisfiable(ValueError):
    """No matching string was found in ``ATTEMPTS`` draws (an empty language such as ``a^b``)."""


def _walk(tree: Any) -> Any:
    for op, av in tree:
        yield op, av
        if op is sre.SUBPATTERN:
            yield from _walk(av[3])
        elif op in (sre.MAX_REPEAT, sre.MIN_REPEAT, sre.POSSESSIVE_REPEAT):
            yield from _walk(av[2])
        elif op is sre.BRANCH:
            for alt in av[1]:
                yield from _walk(alt)
        elif op in (sre.ASSERT, sre.ASSERT_NOT):
            yield from _walk(av[1])
        elif op is sre.ATOMIC_GROUP:
            yield from _walk(av)
        elif op is sre.GROUPREF_EXISTS:
            yield from _walk(av[1])
            if av[2] is not None:
                yield from _walk(av[2])


_REFUSED = {sre.ASSERT: "look-around assertions", sre.ASSERT_NOT: "look-around assertions",
            sre.GROUPREF: "back-references", sre.GROUPREF_EXISTS: "conditional groups",
            sre.ATOMIC_GROUP: "atomic groups", sre.POSSESSIVE_REPEAT: "possessive repeats"}


def check_regex(pattern: str) -> re.Pattern[str]:
    """The compiled pattern; ``re.error`` if it does not parse, ``RegexNotSupported`` for what vLLM's backends
    refuse (so the server answers 400 where vLLM does)."""
    compiled, tree, _ = _parsed(pattern)
    for op, _ in _walk(tree):
        what = _REFUSED.get(op)
        if what is not None:
            raise RegexNotSupported(f"{what} are not supported")
    return compiled


class _Draw:
    def __init__(self, rng: random.Random, cap: int, flags: int, cands: dict[Any, list[list[str]]],
                 skew: bool = True) -> None:
        self.rng = rng
        self.skew = skew
        self.cands = cands          # per class: its candidate tiers (shared by the draws of one pattern)
        self.cap = cap
        self.dotall = bool(flags & re.DOTALL)
        self.out: list[str] = []
        self.size = 0
        self.groups: dict[int, str] = {}

    def emit(self, s: str) -> None:
        self.out.append(s)
        self.size += len(s)
        if self.size > _MAX_CHARS:
            raise _DeadEnd

    def seq(self, tree: Any) -> None:
        for op, av in tree:
            self.node(op, av)

    def node(self, op: Any, av: Any) -> None:
        rng = self.rng
        if op is sre.LITERAL:
            self.emit(chr(av))
        elif op is sre.NOT_LITERAL:
            self.emit(self.pick(("not", av), lambda c: ord(c) != av))
        elif op is sre.ANY:
            dotall = self.dotall
            self.emit(self.pick(("any", dotall), lambda c: dotall or c != "\n", readable=True))
        elif op is sre.IN:
            self.emit(self.pick(id(av), _member(av)))
        elif op is sre.BRANCH:
            self.seq(rng.choice(av[1]))
        elif op is sre.SUBPATTERN:
            group, add_flags, _, sub = av
            dotall = self.dotall
            if add_flags & re.DOTALL:
                self.dotall = True
            start = len(self.out)
            self.seq(sub)
            self.dotall = dotall
            if group is not None:
                self.groups[group] = "".join(self.out[start:])
        elif op in (sre.MAX_REPEAT, sre.MIN_REPEAT, sre.POSSESSIVE_REPEAT):
            lo, hi, sub = av
            top = lo + self.cap if hi is sre.MAXREPEAT else min(hi, lo + self.cap)
            # skewed to the short end: `\\s*` is mostly nothing or one space, as in a model's answer
            n = lo + int((top - lo + 1) * rng.random() ** 2) if self.skew else rng.randint(lo, top)
            for _ in range(n):
                self.seq(sub)
        elif op is sre.AT:
            if av in (sre.AT_BEGINNING, sre.AT_BEGINNING_STRING) and self.size:
                raise _DeadEnd      # text before a start anchor: this walk cannot match
            # end anchors, \b and \B: left to the final re.fullmatch
        elif op is sre.GROUPREF:
            if av not in self.groups:
                raise _DeadEnd
            self.emit(self.groups[av])
        elif op is sre.GROUPREF_EXISTS:
            group, yes, no = av
            self.seq(yes if group in self.groups else (no or []))
        elif op is sre.ATOMIC_GROUP:
            self.seq(av)
        elif op in (sre.ASSERT, sre.ASSERT_NOT):
            pass                    # zero-width: the final check decides
        else:
            raise RegexNotSupported(f"regex construct {op} is not supported")

    def pick(self, key: Any, ok: Any, readable: bool = False) -> str:
        tiers = self.cands.get(key)
        if tiers is None:
            tiers = self.cands[key] = _tiers(ok, readable)
        if not tiers:
            raise _DeadEnd
        # readable characters first (letters and digits, then printable ASCII): answers look like text
        rng = self.rng
        for tier in tiers[:-1]:
            if rng.random() < 0.9:
                return rng.choice(tier)
        return rng.choice(tiers[-1])


def _tiers(ok: Any, readable: bool) -> list[list[str]]:
    """The characters a class may give, in preference tiers: letters/digits, printable ASCII, then the rest."""
    pool = [c for c in _POOL if ok(c)] or [c for c in (*getattr(ok, "extra", ()), *_NON_ASCII) if ok(c)]
    if not pool:
        return []
    tiers = [[c for c in pool if c.isalnum()], [c for c in pool if " " <= c <= "~"], pool]
    if readable and tiers[0]:
        return [tiers[0]]
    out: list[list[str]] = []
    for t in tiers:
        if t and (not out or len(t) > len(out[-1])):
            out.append(t)
    return out


class _DeadEnd(Exception):
    pass


def _member(items: list[tuple[Any, Any]]) -> Any:
    """A membership test for a parsed character class."""
    negate = bool(items) and items[0][0] is sre.NEGATE
    body = items[1:] if negate else items
    extra: list[str] = []       # the class's own non-ASCII characters (drawn when nothing in the pool matches)

    def inside(c: str) -> bool:
        o = ord(c)
        for op, av in body:
            if op is sre.LITERAL and o == av:
                return True
            if op is sre.RANGE and av[0] <= o <= av[1]:
                return True
            if op is sre.CATEGORY and _category(av, c):
                return True
        return False

    for op, av in body:
        if op is sre.LITERAL and av > 0x7F:
            extra.append(chr(av))
        elif op is sre.RANGE and av[1] > 0x7F:
            extra.append(chr(max(av[0], 0x80)))

    def ok(c: str) -> bool:
        return inside(c) != negate

    ok.extra = extra            # type: ignore[attr-defined]
    return ok


def _category(cat: Any, c: str) -> bool:
    if cat is sre.CATEGORY_DIGIT:
        return c.isdigit()
    if cat is sre.CATEGORY_NOT_DIGIT:
        return not c.isdigit()
    if cat is sre.CATEGORY_SPACE:
        return c in _SPACE
    if cat is sre.CATEGORY_NOT_SPACE:
        return c not in _SPACE
    if cat is sre.CATEGORY_WORD:
        return c.isalnum() or c in _WORD_EXTRA
    if cat is sre.CATEGORY_NOT_WORD:
        return not (c.isalnum() or c in _WORD_EXTRA)
    if cat is sre.CATEGORY_LINEBREAK:
        return c == "\n"
    if cat is sre.CATEGORY_NOT_LINEBREAK:
        return c != "\n"
    return False


#: Caps tried in turn (the first is the documented REPEAT_CAP): shorter and longer expansions for length bounds.
_CAPS = (REPEAT_CAP, 0, 2, 4, REPEAT_CAP * 2, REPEAT_CAP * 4, REPEAT_CAP * 8)


@functools.lru_cache(maxsize=256)
def _parsed(pattern: str) -> tuple[re.Pattern[str], Any, dict[Any, list[list[str]]]]:
    """A pattern's compiled form, parse tree and class-candidate cache (an agent sends the same one often)."""
    with warnings.catch_warnings():     # re's FutureWarnings about a client's pattern are not the server's to log
        warnings.simplefilter("ignore", FutureWarning)
        return re.compile(pattern), sre_parse.parse(pattern), {}


def sample_regex(pattern: str, seed: int, *, min_len: int = 0, max_len: int | None = None) -> str:
    """A string ``re.fullmatch``-ing ``pattern``, the same for the same seed. ``min_len``/``max_len`` (a JSON
    schema's bounds next to ``pattern``) are met when some draw meets them; otherwise the pattern wins, as with
    xgrammar, which drops length bounds beside a pattern. Raises ``re.error`` (invalid pattern) or
    ``RegexUnsatisfiable``."""
    compiled, tree, cands = _parsed(pattern)
    rng = random.Random(seed)
    fallback: str | None = None
    bounded = min_len > 0 or max_len is not None
    for attempt in range(ATTEMPTS * 4 if bounded else ATTEMPTS):
        # with length bounds: uniform repeat counts and more draws, to reach the bounds' range
        d = _Draw(rng, _CAPS[attempt % len(_CAPS)], compiled.flags, cands, skew=not bounded)
        try:
            d.seq(tree)
        except _DeadEnd:
            continue
        s = "".join(d.out)
        if compiled.fullmatch(s) is None:
            continue
        if len(s) >= min_len and (max_len is None or len(s) <= max_len):
            return s
        if fallback is None:
            fallback = s
    if fallback is not None:
        return fallback
    raise RegexUnsatisfiable(f"no string matching {pattern!r} was found")
