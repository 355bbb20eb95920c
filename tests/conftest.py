from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from kernelsight import profiles
from kernelsight.simcore.engine import Engine
from kernelsight.simcore.engine_config import EngineArgs, EngineConfig, build_engine, build_step_model

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
# Tests on the measured data run wherever ../shared/data is checked out beside the project (always in CI,
# where its absence is an error, not a skip); a newcomer without it still gets a green run of the rest.
HAVE_SHARED = SHARED_DATA.is_dir() or bool(os.environ.get("CI"))


def pytest_collection_modifyitems(config, items):
    if HAVE_SHARED:
        return
    marker = pytest.mark.skipif(True, reason=f"needs the shared measured data at {SHARED_DATA}")
    for item in items:
        if "shared_data" in getattr(item, "fixturenames", ()):
            item.add_marker(marker)


def needs_shared(path: Path) -> pytest.MarkDecorator:
    """Skip a test that reads ``path`` (under ../shared/data) with a one-line reason when it is absent, as the
    ``shared_data`` fixture does; in CI (where the data is checked out) it runs, and fails if the data is missing."""
    return pytest.mark.skipif(not path.exists() and not HAVE_SHARED, reason=f"needs the shared measured data at {path}")


@pytest.fixture(scope="session")
def shared_data() -> Path:
    assert SHARED_DATA.is_dir(), f"shared data not found at {SHARED_DATA} (CI checks it out beside the project)"
    return SHARED_DATA


def make_config(**kw) -> EngineConfig:
    from kernelsight.engine_args import create_engine_config

    args = EngineArgs(**{"model": "meta-llama/Llama-3.1-8B", "hardware": "h100", "max_model_len": 8192, **kw})
    return create_engine_config(args)


def make_engine(per_token_events: bool = True, use_decode_group: bool = True, **kw) -> Engine:
    cfg = make_config(**kw)
    if use_decode_group:
        return build_engine(cfg, per_token_events=per_token_events)
    return Engine(cfg.scheduler, cfg.num_gpu_blocks, build_step_model(cfg), seed=cfg.args.seed,
                  per_token_events=per_token_events, use_decode_group=False)


@pytest.fixture(scope="session")
def llama8b():
    return profiles.load_model("meta-llama/Llama-3.1-8B")


@pytest.fixture(scope="session")
def h100():
    return profiles.load_hardware("h100")


def cli_one_line_error(capsys, argv: list[str]) -> str:
    """Run the CLI on ``argv`` expecting a start-up refusal: exit 2, no traceback, and the last stderr line (a
    tokenizer library may warn on lines of its own before it) is the command's one-line error, returned."""
    from kernelsight.cli import main
    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = exc.code
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    last = err.splitlines()[-1]
    assert last.startswith("kernelsight serve: error: ") or last.startswith("kernelsight: error: ")
    return last


def free_port_run(n: int) -> int:
    """A base port p with p .. p + n - 1 all free on every interface at the time of asking.

    Tests that derive ports from a base (rank r publishes on base + r) need the whole run free: one free port
    says nothing about its neighbours, which another xdist worker's sockets may hold."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        socks: list[socket.socket] = []
        try:
            for port in range(base, base + n):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("", port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no run of {n} free ports")


class EngineSpy:
    """An engine with its ``add_request`` wrapped, put in a bridge's place (``bridge.engine = EngineSpy(...)``): a
    compiled Engine (``python -m kernelsight.accel build``) takes no instance attributes, so a test wraps it instead.
    Every other attribute, read or set, is the engine's."""

    def __init__(self, engine: Engine, add_request) -> None:
        object.__setattr__(self, "_engine", engine)
        object.__setattr__(self, "add_request", add_request)

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self._engine, name, value)
