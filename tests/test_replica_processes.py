"""``kernelsight serve --replicas N --replica-processes P``: the replicas spread over worker processes (each replica
keeps its port and its own engine), the parent binding every port first and supervising the workers; and the bad
starts that must stop with one line (an HTTP port in use, a worker's KV-event port in use)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("fastapi")

from kernelsight.server.replica_processes import replica_groups  # noqa: E402
from tests.conftest import free_port_run  # noqa: E402

MODEL = "meta-llama/Llama-3.1-8B"


def test_replica_groups_cover_every_replica_once_in_contiguous_even_groups():
    assert replica_groups(3, 2) == [[0, 1], [2]]
    assert replica_groups(5, 3) == [[0, 1], [2, 3], [4]]
    assert replica_groups(2, 8) == [[0], [1]]           # never more processes than replicas
    assert replica_groups(1, None) == [[0]]
    for n in range(1, 9):
        groups = replica_groups(n, None)
        assert sorted(i for g in groups for i in g) == list(range(n))
        assert len(groups) == min(n, len(os.sched_getaffinity(0)))
        assert max(map(len, groups)) - min(map(len, groups)) <= 1


def _serve(*args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kernelsight.server", "--model", MODEL, "--host", "127.0.0.1", "--max-model-len",
           "2048", "--num-gpu-blocks-override", "512", "--time-scale", "20", "--deadline-spin-us", "0",
           "--uvicorn-log-level", "warning", *args]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)


def _one_line_error(proc: subprocess.Popen, timeout_s: float = 120) -> str:
    assert proc.wait(timeout_s) == 2
    err = proc.stderr.read().decode().strip()
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith("kernelsight serve: error: ")]
    assert len(lines) == 1, err
    return lines[0]


def test_http_port_in_use_stops_the_start_with_one_line_and_binds_nothing():
    base = free_port_run(3)
    taken = socket.socket()
    taken.bind(("127.0.0.1", base + 1))          # the second replica's port
    taken.listen()
    try:
        proc = _serve("--port", str(base), "--replicas", "3")
        line = _one_line_error(proc)
        assert line == f"kernelsight serve: error: cannot listen on 127.0.0.1:{base + 1}: address already in use"
    finally:
        taken.close()
    for p in (base, base + 2):                   # the ports bound before the failure were let go
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_bad_flag_with_replica_processes_is_one_line_not_one_per_worker():
    base = free_port_run(2)
    proc = _serve("--port", str(base), "--replicas", "2", "--replica-processes", "2", "--time-scale", "0")
    assert _one_line_error(proc) == "kernelsight serve: error: --time-scale must be > 0, got 0.0"


def _children(pid: int) -> list[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(x) for x in text.split()]


def _wait_healthy(proc: subprocess.Popen, urls: list[str], deadline_s: float = 120) -> None:
    t_end = time.monotonic() + deadline_s
    pending = list(urls)
    with httpx.Client(timeout=1.0) as c:
        while pending:
            if proc.poll() is not None:
                raise AssertionError(f"server exited with {proc.returncode}: {proc.stderr.read().decode()[-2000:]}")
            assert time.monotonic() < t_end, f"not healthy in {deadline_s} s: {pending}"
            try:
                if c.get(pending[0] + "/health").status_code == 200:
                    pending.pop(0)
                    continue
            except httpx.TransportError:
                pass
            time.sleep(0.05)


def _served_by(url: str) -> int:
    """The generation tokens this replica's /metrics has counted."""
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:generation_tokens_total{"):
            return int(float(line.rsplit(" ", 1)[1]))
    raise AssertionError("no vllm:generation_tokens_total")


@pytest.fixture(scope="module")
def two_process_fleet():
    base = free_port_run(3)
    proc = _serve("--port", str(base), "--replicas", "3", "--replica-processes", "2")
    urls = [f"http://127.0.0.1:{base + i}" for i in range(3)]
    try:
        _wait_healthy(proc, urls)
        yield proc, urls
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_replicas_run_in_worker_processes_each_with_its_own_engine(two_process_fleet):
    proc, urls = two_process_fleet
    workers = _children(proc.pid)
    assert len(workers) == 2
    before = [_served_by(u) for u in urls]
    with httpx.Client(timeout=30) as c:
        for k, u in enumerate(urls):
            r = c.post(u + "/v1/completions", json={"model": MODEL, "prompt": [100 + k] * 8,
                                                    "max_tokens": 3 + k, "ignore_eos": True})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3 + k
    # each replica counted exactly its own request: three engines, not one shared by a port
    assert [_served_by(u) - b for u, b in zip(urls, before, strict=True)] == [3, 4, 5]


def test_sigterm_to_the_parent_stops_every_worker_and_exits_0(two_process_fleet):
    proc, urls = two_process_fleet
    workers = _children(proc.pid)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    for pid in workers:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
    for u in urls:
        with pytest.raises(httpx.TransportError):
            httpx.get(u + "/health", timeout=2)


@pytest.mark.slow      # a fleet of its own to kill (~30 s to start on a loaded 2-core machine)
def test_a_dead_worker_stops_the_fleet_with_its_exit_code():
    base = free_port_run(2)
    proc = _serve("--port", str(base), "--replicas", "2", "--replica-processes", "2")
    try:
        _wait_healthy(proc, [f"http://127.0.0.1:{base + i}" for i in range(2)])
        first, second = _children(proc.pid)
        os.kill(second, signal.SIGKILL)
        assert proc.wait(30) == 128 + signal.SIGKILL      # the shell's code for a worker killed by a signal
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{base}/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.mark.slow      # builds a worker's engine before the port fails (~30 s on a loaded 2-core machine)
def test_a_workers_kv_event_port_in_use_stops_the_start_with_one_line():
    base = free_port_run(2)
    kv = free_port_run(2)
    taken = socket.socket()
    taken.bind(("", kv + 1))                      # replica 1's KV-event port (replica i: endpoint port + i)
    taken.listen()
    try:
        cfg = json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{kv}"})
        proc = _serve("--port", str(base), "--replicas", "2", "--replica-processes", "2", "--kv-events-config", cfg)
        line = _one_line_error(proc)
        assert f"cannot bind tcp://*:{kv + 1}" in line and "in use" in line
    finally:
        taken.close()


# -- the supervisor alone (no server: workers are plain functions) -----------------------------------------------
def _exit_with(code: int, ready) -> int:
    ready.wait(60)                  # fail only once the other worker can take its SIGTERM
    return code


def _wait_for_sigterm(marker: str, ready) -> int:
    """Block until SIGTERM, then leave a marker (proof the supervisor stopped this worker) and exit 0."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})     # held from here: no window to miss it in
    ready.set()
    signal.sigwait({signal.SIGTERM})
    Path(marker).write_text("stopped")
    return 0


def _raise_value_error() -> int:
    raise ValueError("--kv-events-config: cannot bind tcp://*:5557: Address already in use")


def test_supervisor_stops_the_others_when_a_worker_fails_and_returns_its_code(tmp_path):
    import multiprocessing

    from kernelsight.server.replica_processes import run_replica_processes

    marker = tmp_path / "stopped"
    ready = multiprocessing.get_context("fork").Event()
    code = run_replica_processes(lambda fn, arg: fn(arg, ready), [(_wait_for_sigterm, str(marker)), (_exit_with, 3)])
    assert code == 3
    assert marker.read_text() == "stopped"


def test_supervisor_reports_a_workers_bad_config_in_one_line(capfd):
    from kernelsight.server.replica_processes import run_replica_processes

    assert run_replica_processes(lambda f: f(), [(_raise_value_error,)]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert err == ["kernelsight serve: error: --kv-events-config: cannot bind tcp://*:5557: Address already in use"]


def test_api_server_count_and_its_alias_are_a_count():
    from kernelsight.server.serve_args import ignored_flags, serve_parser

    for argv in (["-asc", "4"], ["--api-server-count", "4"]):
        ns = serve_parser().parse_args(argv)
        assert ns.api_server_count == 4 and ignored_flags(ns) == []
    assert serve_parser().parse_args([]).api_server_count == 1


def test_replica_processes_default_to_one_and_take_auto():
    from kernelsight.server.serve_args import serve_parser

    assert serve_parser().parse_args([]).replica_processes == 1
    assert serve_parser().parse_args(["--replica-processes", "auto"]).replica_processes is None   # one per CPU
    assert serve_parser().parse_args(["--replica-processes", "3"]).replica_processes == 3
    with pytest.raises(SystemExit):
        serve_parser().parse_args(["--replica-processes", "0"])
