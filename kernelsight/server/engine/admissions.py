"""Requests between the app's door and an engine: the engine loops wait for them before computing a step (see
``EngineBridge.read_window_s``), so a request that arrived in time joins the step vLLM would have given it."""

from __future__ import annotations

__all__ = ["admission_done", "admission_started", "admissions_pending"]


class _Admissions:
    pending = 0      # requests that reached the app and were neither submitted to an engine nor turned away


_ADMITTING_KEY = "kernelsight.admitting"


def admission_started(scope: dict) -> None:
    """A request entered the app (outermost ASGI layer): the engine loops wait for it before a step (see
    ``EngineBridge._read_window``)."""
    scope[_ADMITTING_KEY] = [True]     # a shared token: middlewares may pass copies of the scope down
    _Admissions.pending += 1


def admission_done(scope: dict) -> None:
    """The request was submitted to an engine, or is done without one (an error, another route); idempotent."""
    token = scope.get(_ADMITTING_KEY)
    if token and token[0]:
        token[0] = False
        _Admissions.pending -= 1


def admissions_pending() -> int:
    return _Admissions.pending
