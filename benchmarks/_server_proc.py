"""A ``kernelsight serve`` subprocess for the reliability benchmarks, and what they read of it: RSS, open file
descriptors and CPU time from /proc/PID, the engine gauges and the release-lateness histogram from /metrics, and
the VM's steal time from /proc/stat."""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx
from _common import free_port

MODEL = "meta-llama/Llama-3.1-8B"
CLK_TCK = os.sysconf("SC_CLK_TCK")




@dataclass
class ServerProc:
    """``with ServerProc(["--max-num-seqs", "64"]) as srv: srv.base_url`` — serve on a free port, stopped on exit."""

    args: list[str] = field(default_factory=list)
    port: int = 0
    proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout_s: float = 180.0) -> ServerProc:
        self.port = self.port or free_port()
        cmd = [sys.executable, "-m", "kernelsight.server", "--model", MODEL, "--host", "127.0.0.1", "--port",
               str(self.port), "--uvicorn-log-level", "warning", "--lateness-warn-ms", "0", *self.args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        t_end = time.monotonic() + timeout_s
        while time.monotonic() < t_end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {' '.join(cmd)}")
            try:
                if httpx.get(self.base_url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server did not start in {timeout_s:.0f} s")

    def stop(self, timeout_s: float = 20.0) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def __enter__(self) -> ServerProc:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# -- /proc -----------------------------------------------------------------------------------------------------
def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def cpu_s(pid: int) -> float:
    """utime + stime of the process (all its threads), in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK




# -- /metrics --------------------------------------------------------------------------------------------------
_GAUGE = re.compile(r"^(vllm:num_requests_running|vllm:num_requests_waiting|vllm:kv_cache_usage_perc)\{[^}]*\} (\S+)$",
                    re.M)
_LATE_BUCKET = re.compile(r'^kernelsight:release_lateness_seconds_bucket\{[^}]*le="([^"]+)"[^}]*\} (\S+)$', re.M)
_GEN = re.compile(r"^vllm:generation_tokens_total\{[^}]*\} (\S+)$", re.M)


def scrape(base_url: str) -> str:
    return httpx.get(base_url + "/metrics", timeout=30).text


def gauges(text: str) -> dict[str, float]:
    return {m.group(1): float(m.group(2)) for m in _GAUGE.finditer(text)}


def generation_tokens(text: str) -> float:
    m = _GEN.search(text)
    return float(m.group(1)) if m else 0.0


def lateness_buckets(text: str) -> list[tuple[float, float]]:
    """(upper bound s, cumulative count) of kernelsight:release_lateness_seconds, summed over engines."""
    acc: dict[float, float] = {}
    for m in _LATE_BUCKET.finditer(text):
        le = math.inf if m.group(1) == "+Inf" else float(m.group(1))
        acc[le] = acc.get(le, 0.0) + float(m.group(2))
    return sorted(acc.items())


def lateness_quantiles(before: str, after: str, qs: tuple[float, ...] = (0.5, 0.99)) -> dict[str, float | None]:
    """Quantiles (ms) of the releases between two scrapes, interpolated inside the histogram's buckets."""
    b0 = dict(lateness_buckets(before))
    b1 = lateness_buckets(after)
    delta = [(le, c - b0.get(le, 0.0)) for le, c in b1]
    total = delta[-1][1] if delta else 0.0
    out: dict[str, float | None] = {}
    for q in qs:
        key = f"p{round(q * 100):d}_ms"
        if total <= 0:
            out[key] = None
            continue
        rank, lo_le, lo_c = q * total, 0.0, 0.0
        for le, c in delta:
            if c >= rank:
                hi = le if math.isfinite(le) else lo_le
                frac = (rank - lo_c) / (c - lo_c) if c > lo_c else 1.0
                out[key] = 1e3 * (lo_le + (hi - lo_le) * frac)
                break
            lo_le, lo_c = le, c
    out["releases"] = total
    return out


def wait_idle(base_url: str, timeout_s: float = 60.0) -> dict[str, float]:
    """Poll /metrics until running = waiting = 0 and KV usage 0 (or the timeout); the last gauges."""
    t_end = time.monotonic() + timeout_s
    while True:
        g = gauges(scrape(base_url))
        if all(v == 0 for v in g.values()) or time.monotonic() > t_end:
            return g
        time.sleep(0.1)


def leaked(g: dict[str, float]) -> bool:
    return any(v != 0 for v in g.values()) or len(g) != 3
