"""Fault injection for testing routers, gateways and autoscalers against a misbehaving replica: the fault types,
``FaultConfig`` (what ``--fault-*`` and ``POST /kernelsight/faults`` set), the seeded per-request picker, the error
each rejecting type answers with, and dropping a connection without a response.

Two kinds of fault:

* per-request (``REQUEST_FAULTS``): a generation request is picked with probability ``rate`` (seeded: the k-th
  request of a run gets the same decision for the same seed) or forced by the ``X-Kernelsight-Fault`` header, and
  then fails as a client would see it: an error status in vLLM's body (429, 500, 503, and llm-d-inference-sim's
  401/400/404 kinds), a request that is never answered (``timeout``), a stream cut mid-way (``stream-abort``) or
  paused (``stream-stall``);
* replica states (``STATE_FAULTS``), on while listed in ``types``, whatever the rate: ``slow`` multiplies every
  simulated step time by ``slow_factor``; ``unready`` answers /health and /ping with 503.

Everything is off by default (rate 0, no types)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from kernelsight.server.wire.errors import APIError

#: Per-request faults: a picked request fails this way.
REQUEST_FAULTS = ("429", "500", "503", "timeout", "stream-abort", "stream-stall",
                  "invalid_api_key", "context_length", "invalid_request", "model_not_found")
#: Replica states: on while listed.
STATE_FAULTS = ("slow", "unready")
FAULT_TYPES = REQUEST_FAULTS + STATE_FAULTS
#: llm-d-inference-sim's names (``--failure-types``) for the types both have.
ALIASES = {"rate_limit": "429", "server_error": "500"}
#: llm-d-inference-sim's failure types (all error answers), in our names.
LLM_D_FAULTS = ("429", "invalid_api_key", "context_length", "500", "invalid_request", "model_not_found")
#: Faults that let the request into the engine and break its answer there (the rest never reach the engine).
IN_ENGINE_FAULTS = ("stream-abort", "stream-stall")
FAULT_HEADER = "x-kernelsight-fault"

#: vLLM 0.33's admission-limit answer (``QueueOverflowError``): what a loaded replica's 503 says.
BUSY_MESSAGE = ("The engine is currently busy and cannot accept new requests. Please try again later or on a "
                "different instance.")
TOKEN_BACKLOG_MESSAGE = ("The engine has reached its prefill token backlog limit. Please try again later or on a "
                         "different instance.")


def canonical_type(name: str) -> str:
    """A fault type's canonical name (llm-d-inference-sim's aliases accepted); ValueError if unknown."""
    t = ALIASES.get(name.strip(), name.strip())
    if t not in FAULT_TYPES:
        known = ", ".join(FAULT_TYPES + tuple(ALIASES))
        raise ValueError(f"unknown fault type {name!r} (known: {known})")
    return t


def parse_types(items: list[str] | tuple[str, ...] | str | None) -> tuple[str, ...]:
    """Fault types from a list whose items may themselves be comma-separated (``429,500 timeout``), in order,
    without repeats."""
    if items is None:
        return ()
    if isinstance(items, str):
        items = [items]
    out: list[str] = []
    for item in items:
        if not isinstance(item, str):
            raise ValueError(f"fault types are strings, got {item!r}")
        for part in item.split(","):
            if part.strip():
                t = canonical_type(part)
                if t not in out:
                    out.append(t)
    return tuple(out)


@dataclass(frozen=True)
class FaultConfig:
    """What is injected. ``rate``: probability that a generation request gets one of the per-request ``types``
    (uniformly among them); the state types in ``types`` are on regardless of the rate."""

    rate: float = 0.0
    types: tuple[str, ...] = ()
    seed: int = 0
    slow_factor: float = 4.0           # simulated step times × this while ``slow`` is on
    stall_s: float = 5.0               # wall seconds a ``stream-stall`` pauses
    timeout_s: float = 60.0            # wall seconds a ``timeout`` request is held before its connection is dropped

    def __post_init__(self) -> None:
        if not 0.0 <= self.rate <= 1.0:
            raise ValueError(f"fault rate must be in [0, 1], got {self.rate}")
        object.__setattr__(self, "types", parse_types(self.types))
        if not self.slow_factor > 0:
            raise ValueError(f"slow factor must be > 0, got {self.slow_factor}")
        if self.stall_s < 0 or self.timeout_s < 0:
            raise ValueError("stall and timeout seconds must be >= 0")

    @property
    def request_types(self) -> tuple[str, ...]:
        return tuple(t for t in self.types if t in REQUEST_FAULTS)

    @property
    def slow(self) -> bool:
        return "slow" in self.types

    @property
    def unready(self) -> bool:
        return "unready" in self.types

    def to_json(self) -> dict[str, Any]:
        return {"rate": self.rate, "types": list(self.types), "seed": self.seed, "slow_factor": self.slow_factor,
                "stall_s": self.stall_s, "timeout_s": self.timeout_s}

    def updated(self, changes: dict[str, Any]) -> FaultConfig:
        """A copy with the JSON ``changes`` applied (the admin endpoint's body); ValueError on a bad key or value.
        llm-d-inference-sim's keys (``failure-injection-rate`` in percent, ``failure-types``) work too."""
        kw: dict[str, Any] = {}
        for key, value in changes.items():
            if key in ("rate", "failure-injection-rate"):
                if isinstance(value, bool) or not isinstance(value, int | float):
                    raise ValueError(f"{key} must be a number, got {value!r}")
                kw["rate"] = float(value) / (100.0 if key == "failure-injection-rate" else 1.0)
            elif key in ("types", "failure-types"):
                if not isinstance(value, list | str):
                    raise ValueError(f"{key} must be a list of fault types, got {value!r}")
                kw["types"] = parse_types(value)
            elif key == "seed":
                if isinstance(value, bool) or not isinstance(value, int):
                    raise ValueError(f"seed must be an integer, got {value!r}")
                kw["seed"] = value
            elif key in ("slow_factor", "stall_s", "timeout_s"):
                if isinstance(value, bool) or not isinstance(value, int | float):
                    raise ValueError(f"{key} must be a number, got {value!r}")
                kw[key] = float(value)
            else:
                raise ValueError(f"unknown fault setting {key!r} (known: rate, types, seed, slow_factor, stall_s, "
                                 "timeout_s)")
        return replace(self, **kw)


@dataclass
class FaultPicker:
    """The seeded per-request decisions: every generation request takes the next draw of one stream, so the k-th
    request of a run is picked (and gets the same type) for the same seed, rate and types."""

    config: FaultConfig
    _rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.config.seed)

    def reconfigure(self, config: FaultConfig, reseed: bool) -> None:
        self.config = config
        if reseed:
            self._rng = random.Random(config.seed)

    def pick(self) -> str | None:
        """The next request's fault, or None. Two draws per request whatever the outcome, so that changing the
        rate does not shift which later requests a seed picks."""
        u, v = self._rng.random(), self._rng.random()
        types = self.config.request_types
        if not types or u >= self.config.rate:
            return None
        return types[int(v * len(types))]


def request_fault_error(fault: str, model: str, max_model_len: int, served: list[str]) -> APIError | None:
    """The error an immediately rejected request gets, in vLLM's body; None for the faults that are not one
    error answer. ``invalid_api_key`` is answered by ``unauthorized_body`` instead (vLLM's 401 is not this shape)."""
    if fault == "429":
        return APIError(f"Too many requests for model {model}. Please try again later.", "Too Many Requests", 429)
    if fault == "500":
        return APIError("Internal server error", "InternalServerError", 500)
    if fault == "503":
        return APIError(BUSY_MESSAGE, "Service Unavailable", 503)
    if fault == "context_length":
        return APIError(f"This model's maximum context length is {max_model_len} tokens. However, your request "
                        f"exceeds this limit. Please reduce the length of the input prompt.", "BadRequestError",
                        400, "input_tokens")
    if fault == "invalid_request":
        return APIError("Invalid request.", "BadRequestError", 400)
    if fault == "model_not_found":
        aliases = ", ".join(served)
        return APIError(f"The model `{model}` does not exist. Valid aliases: {aliases}.", "NotFoundError", 404,
                        "model")
    return None


#: vLLM's --api-key rejection (not the nested error shape).
UNAUTHORIZED_BODY = {"error": "Unauthorized"}


class FaultInjector:
    """One replica's fault settings, its seeded picker and the count of what it injected (``on_inject``, which
    feeds ``kernelsight:injected_faults_total``)."""

    def __init__(self, config: FaultConfig, on_inject: Callable[[str], None]) -> None:
        self.config = config
        self.picker = FaultPicker(config)
        self.on_inject = on_inject

    def configure(self, config: FaultConfig, reseed: bool) -> None:
        self.config = config
        self.picker.reconfigure(config, reseed)

    def decide(self, header: str | None) -> str | None:
        """The fault of the next generation request: the one its ``X-Kernelsight-Fault`` header forces, else the
        picker's (which draws for every request, forced or not, so that a forced request does not shift the
        seeded decisions of the others). ValueError on a header naming no per-request fault."""
        picked = self.picker.pick()
        if header is not None and header.strip():
            forced = canonical_type(header)
            if forced not in REQUEST_FAULTS:
                raise ValueError(f"{forced!r} is a replica state, not a per-request fault: set it with "
                                 "POST /kernelsight/faults")
            return forced
        return picked

    def decide_counted(self, header: str | None) -> str | None:
        """:meth:`decide`, with the injection counted (and a slow replica's every request), as every front end
        (HTTP, gRPC) counts them. ValueError as :meth:`decide`."""
        fault = self.decide(header)
        if fault is not None:
            self.on_inject(fault)
        if self.config.slow:
            self.on_inject("slow")
        return fault


def drop_connection(raw_send: Any) -> bool:
    """Close the client's connection now, with nothing more sent: what a router sees when a replica dies or a
    middlebox cuts the link. ``raw_send`` is the server's own send (uvicorn's request cycle behind it); later sends
    of the response become no-ops. False if the server is not one whose transport can be reached."""
    cycle = getattr(raw_send, "__self__", None)
    transport = getattr(cycle, "transport", None)
    if transport is None or not hasattr(transport, "close"):
        return False
    if hasattr(cycle, "disconnected"):
        cycle.disconnected = True       # uvicorn: the app's remaining sends (the end of a stream) are dropped
    transport.close()
    return True
