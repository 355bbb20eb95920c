"""argparse pieces shared by every command: the one-line-error parser and the value types (argparse turns their
errors into one-line messages)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import NoReturn, TypeVar

__all__ = ["OneLineParser", "positive_int", "non_negative_int", "rate", "fraction", "range_ratio",
           "json_object", "json_dataclass"]

_T = TypeVar("_T")


class OneLineParser(argparse.ArgumentParser):
    """Bad flags get one line on stderr (``kernelsight simulate: error: ...``), never a traceback."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def positive_int(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return v


def non_negative_int(text: str) -> int:
    v = int(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be ≥ 0, got {text}")
    return v


def rate(text: str) -> float:
    v = float(text)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 or inf, got {text}")
    return v


def fraction(text: str) -> float:
    v = float(text)
    if not 0.0 < v <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return v


def range_ratio(text: str) -> float:
    v = float(text)
    if not 0.0 <= v < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return v


def positive_float(text: str) -> float:
    v = float(text)
    if not 0.0 < v < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return v


def non_negative_float(text: str) -> float:
    v = float(text)
    if not 0.0 <= v < float("inf"):
        raise argparse.ArgumentTypeError(f"must be ≥ 0, got {text}")
    return v


def json_object(text: str) -> dict:
    """argparse type of a flag taking a JSON object: malformed JSON or another JSON value is a one-line message."""
    try:
        d = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"invalid JSON {text!r}: {exc}") from None
    if not isinstance(d, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return d


def json_dataclass(cls: type[_T], text: str) -> _T:
    """A vLLM-style ``--*-config JSON`` flag's value as dataclass ``cls``: malformed JSON, a non-object, an unknown
    field or a value the dataclass rejects (TypeError/ValueError) become one-line argparse messages."""
    d = json_object(text)
    valid = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(d) - valid)
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown field(s) {', '.join(unknown)}; valid: {', '.join(sorted(valid))}")
    try:
        return cls(**d)
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
