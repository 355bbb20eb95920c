"""The seeded regex sampler (``model/regex_sample.py``): every draw full-matches its pattern over many seeds and a
corpus of realistic patterns, draws repeat with their seed, unbounded repeats stay within the documented cap, and the
constructs vLLM's backends refuse are refused."""

from __future__ import annotations

import re

import pytest

from kernelsight.server.model.regex_sample import (
    REPEAT_CAP,
    RegexNotSupported,
    RegexUnsatisfiable,
    check_regex,
    sample_regex,
)

CORPUS = [
    r"\(\d{3}\) \d{3}-\d{4}",                                   # US phone number
    r"\+?1?[ -]?\d{3}[ -]\d{3}[ -]\d{4}",
    r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])",            # ISO date
    r"(?:[01]\d|2[0-3]):[0-5]\d(:[0-5]\d)?",                   # time
    r"(yes|no|maybe)",                                         # an enum
    r"(?P<level>DEBUG|INFO|WARN(ING)?|ERROR): [A-Z][a-z]+( [a-z]+){0,5}\.",
    r"((a|b)c(d(e|f)*)+)?g",                                   # nested groups
    r"^[\w.+-]+@[\w-]+\.[a-z]{2,6}$",                          # e-mail, anchored
    r"[^\s]+", r"[^a-zA-Z0-9]{3,5}", r"\W\D\S", r".*", r"(?s).{3}",
    r"(?i)hello (world|there)", r"\bfoo\b", r"a|^b", r"x*?y+?",
    r"-?\d+(\.\d+)?([eE][+-]?\d+)?",                           # a JSON number
    r"0x[0-9a-fA-F]{8}", r"[A-Z]{2}\d{2}[A-Z0-9]{11,30}",     # IBAN-like
    r"\s*\{\s*\"\w+\"\s*:\s*\d+\s*\}\s*",
    r"[α-ω]+", r"[^\x00-\x7f]", r"[\d\s\-]{5}", r"\d{2,}",
    r"(\w)\1", r"(?P<x>ab)(?P=x)",                              # back-references (the sampler supports them)
]


@pytest.mark.parametrize("pattern", CORPUS)
def test_every_draw_fullmatches_and_repeats_with_its_seed(pattern):
    seen = set()
    for seed in range(150):
        s = sample_regex(pattern, seed)
        assert re.fullmatch(pattern, s) is not None, (pattern, seed, s)
        assert sample_regex(pattern, seed) == s
        seen.add(s)
    # the draws vary (a finite language: every member is drawn)
    finite = {"(yes|no|maybe)": 3, r"a|^b": 2, r"(?i)hello (world|there)": 2, r"\bfoo\b": 1, r"(?P<x>ab)(?P=x)": 1}
    assert len(seen) >= finite.get(pattern, 5)


def test_unbounded_repeats_stay_within_the_cap():
    lengths = {len(sample_regex(r"a*", seed)) for seed in range(400)}
    assert min(lengths) == 0 and max(lengths) == REPEAT_CAP
    assert {len(sample_regex(r"b{3,}", seed)) for seed in range(400)} == set(range(3, 3 + REPEAT_CAP + 1))


def test_length_bounds_are_met_when_a_draw_can_meet_them():
    for seed in range(50):
        s = sample_regex(r"[a-z]+", seed, min_len=12, max_len=14)
        assert 12 <= len(s) <= 14 and s.isalpha()
        assert len(sample_regex(r"\d*", seed, max_len=0)) == 0
    # impossible bounds: the pattern wins (as xgrammar drops length bounds beside a pattern)
    assert sample_regex(r"ab", 1, min_len=5) == "ab"


@pytest.mark.parametrize("pattern,what", [
    (r"(?<=a)b", "look-around"), (r"a(?=b)", "look-around"), (r"a(?!b)c", "look-around"),
    (r"(a)\1", "back-references"), (r"(?P<n>a)(?P=n)", "back-references"), (r"(a)?(?(1)b|c)", "conditional"),
    (r"(?>ab)", "atomic"), (r"a++", "possessive"),
])
def test_what_vllm_refuses_is_refused(pattern, what):
    with pytest.raises(RegexNotSupported, match=what):
        check_regex(pattern)


def test_invalid_and_empty_languages_raise():
    with pytest.raises(re.error):
        check_regex(r"(ab")
    with pytest.raises(RegexUnsatisfiable):
        sample_regex(r"a^b", 3)
    with pytest.raises(RegexUnsatisfiable):
        sample_regex(r"[^\s\S]", 3)
    assert check_regex(r"\d{4}-\d{2}").fullmatch("2024-05")


def test_random_patterns_are_drawn_or_refused_never_crash():
    import random

    from kernelsight.server.model.structured import StructuredOutputError, constrained_text

    rng = random.Random(11)
    parts = ["a", "b", "\\d", "\\w", "\\s", ".", "[a-c]", "[^x]", "(", ")", "(?:", "|", "*", "+", "?", "{2}", "{1,3}",
             "{9999999999}", "^", "$", "\\b", "\\1", "(?=", "(?<!", "[", "]", "\\", "(?P<n>", "(?P=n)", "{", "}"]
    drawn = refused = 0
    for i in range(600):
        pattern = "".join(rng.choice(parts) for _ in range(rng.randint(1, 10)))
        try:
            text = constrained_text(None, {"regex": pattern}, i)
        except StructuredOutputError as exc:
            assert exc.status == 400 and exc.message
            refused += 1
            continue
        assert re.fullmatch(pattern, text) is not None, (pattern, text)
        drawn += 1
    assert drawn > 50 and refused > 50
