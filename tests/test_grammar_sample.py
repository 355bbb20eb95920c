"""The seeded grammar sampler (``model/grammar_sample.py``): xgrammar EBNF/GBNF and Lark grammars give strings the
language accepts (checked by an independent oracle: Python's JSON parser and evaluator, or a regex of the same
language), the same for the same seed; what is not generated from is refused."""

from __future__ import annotations

import json
import re

import pytest

from kernelsight.server.model.grammar_sample import GrammarNotSupported, sample_grammar

ARITH_EBNF = r'''
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")"
number ::= [1-9] [0-9]{0,3}
'''

ARITH_LARK = r'''
?start: expr
?expr: term (("+"|"-") term)*
?term: factor (("*"|"/") factor)*
?factor: NUMBER | "(" expr ")" | "-" factor
%import common.NUMBER
%import common.WS
%ignore WS
'''

# llama.cpp's json.gbnf (GBNF is what xgrammar's EBNF reads)
JSON_GBNF = r'''
root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws
object ::=
  "{" ws (
            string ":" ws value
    ("," ws string ":" ws value)*
  )? "}" ws
array  ::=
  "[" ws (
            value
    ("," ws value)*
  )? "]" ws
string ::=
  "\"" (
    [^"\\\x7F\x00-\x1F] |
    "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4}) # escapes
  )* "\"" ws
number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws
ws ::= | " " | "\n" [ \t]{0,20}
'''

SQL_LARK = r'''
start: "SELECT " cols " FROM " NAME [" WHERE " cond] ";"
cols: NAME (", " NAME)* | "*"
cond: NAME " = " (NUMBER | "'" WORD "'") -> eq
NAME: /[a-z_][a-z0-9_]*/
%import common.NUMBER
%import common.WORD
'''
SQL_ORACLE = (r"SELECT ([a-z_][a-z0-9_]*(, [a-z_][a-z0-9_]*)*|\*) FROM [a-z_][a-z0-9_]*"
              r"( WHERE [a-z_][a-z0-9_]* = ([0-9]+(\.[0-9]*)?|'[a-zA-Z]+'))?;")

WORDS_LARK = r'''
start: NAME ("," NAME)* "." | "x"~2..3
NAME: "a".."c" LETTER*
%import common.LETTER
%ignore " "
'''


def _arith_ok(s: str) -> None:
    # parse and evaluate: numbers as 1 (no division by zero, no leading-zero literals) and "/" as "*"
    eval(re.sub(r"\d+(\.\d*)?", "1", s).replace("/", "*"), {"__builtins__": {}})   # noqa: S307 - our own string


@pytest.mark.parametrize("seed", range(60))
def test_draws_are_in_the_language(seed):
    _arith_ok(sample_grammar(ARITH_EBNF, seed))
    _arith_ok(sample_grammar(ARITH_LARK, seed))
    json.loads(sample_grammar(JSON_GBNF, seed))
    assert re.fullmatch(SQL_ORACLE, sample_grammar(SQL_LARK, seed))
    # %ignore " ": a NAME is one lexeme (nothing inside it); "x" "x" may be drawn apart by an ignored space
    words = sample_grammar(WORDS_LARK, seed)
    assert re.fullmatch(r"[a-c][a-zA-Z]*(,[a-c][a-zA-Z]*)*\.|x( ?x){1,2}", words), words
    assert sample_grammar(JSON_GBNF, seed) == sample_grammar(JSON_GBNF, seed)


def test_draws_vary_and_recursion_ends():
    outs = {sample_grammar(JSON_GBNF, seed) for seed in range(40)}
    assert len(outs) > 20
    # deeply recursive grammars still end: past MAX_DEPTH the shortest derivation is taken
    deep = 'root ::= "(" root ")" | "x"'
    for seed in range(40):
        s = sample_grammar(deep, seed)
        assert re.fullmatch(r"(\()*x(\))*", s) and s.count("(") == s.count(")")


@pytest.mark.parametrize("grammar,what", [
    ("root ::= x", "not defined"),
    ('start: %json {"type": "object"}', "llguidance extensions"),
    ('root ::= "a" root', "no finite derivation"),
    ("start: <|eot_id|>", "unexpected"),
    ('root ::= ("a"', "expected"),
    ('start: "a"\n%import python.NAME', "common terminals only"),
    ('other ::= "a"', "no 'root' rule"),
])
def test_unsupported_or_invalid_grammars_are_refused(grammar, what):
    with pytest.raises(GrammarNotSupported, match=what):
        sample_grammar(grammar, 1)


def test_garbage_is_refused_never_crashes():
    import random

    rng = random.Random(7)
    alphabet = ['root', '::=', 'start', ':', '"a"', '/b+/', '[c-d]', '(', ')', '|', '*', '+', '?', '{2,3}', '~', '2',
                '..', '%import', 'common.WS', '%ignore', '->', 'x', 'X', '[', ']', '\n', ' ', '<', '#', '"', '\\']
    for _ in range(400):
        text = "".join(rng.choice(alphabet) + rng.choice(["", " "]) for _ in range(rng.randint(1, 14)))
        try:
            sample_grammar(text, 1)
        except GrammarNotSupported:
            pass
    with pytest.raises(GrammarNotSupported, match="nested too deeply"):
        sample_grammar("root ::= " + "(" * 3000 + '"a"' + ")" * 3000, 1)
