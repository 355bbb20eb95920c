"""``--plot FILE.html``: self-contained (plotly.js inlined once, nothing fetched), and a real headless browser renders
the charts (skipped without chromium; CI installs Debian's: ``apt-get install -y chromium``)."""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import pytest

from kernelsight.cli import main
from kernelsight.loadgen.metrics import RequestRecord
from kernelsight.loadgen.plot import line_chart, render_plot_html

pytest.importorskip("plotly")

CHROMIUM = next((p for p in (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")) if p), None)


def _records() -> list[RequestRecord]:
    return [RequestRecord(True, 10, 4, 0.1 + 0.01 * i, [0.02, 0.03, 0.025], 0.175 + 0.01 * i, start_s=0.1 * i)
            for i in range(20)] + [RequestRecord(False, 3, 0, 0.0, [], 0.0, error="x")]


def test_page_is_self_contained():
    page = render_plot_html("t", _records(), summary={"a": 1.5},
                            timeline={"time_s": [0, 1, 2], "running": [1, 3, 2], "waiting": [0, 2, 0],
                                      "kv_cache_usage": [0.1, 0.5, 0.2], "scheduled_tokens": [10, 300, 40]})
    assert page.startswith("<!DOCTYPE html>")
    assert page.count('class="plotly-graph-div"') == page.count("Plotly.newPlot") == 7   # 4 CDFs + 3 timeline charts
    assert page.count("window.PlotlyConfig") == 1, "plotly.js is inlined once, not once per chart"
    assert not re.search(r"<script[^>]*\bsrc=", page) and "<link" not in page, "nothing is fetched"


def test_empty_series_and_degenerate_axes():
    empty = line_chart("x", [("a", [], [])], xlabel="x", ylabel="y")
    assert not empty.data and empty.layout.annotations[0].text == "no data"
    flat = line_chart("x", [("a", [1.0, 1.0], [2.0, 2.0])], xlabel="x", ylabel="y", step=True)
    assert list(flat.data[0].y) == [2.0, 2.0] and flat.data[0].line.shape == "hv"
    assert "nan" not in flat.to_json().lower()


def _png_rgb(path: Path) -> tuple[int, int, list[bytes]]:
    """Rows of RGB(A) bytes of an 8-bit, non-interlaced PNG (what chromium writes), with no image library."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width = 8, b"", 0
    while pos < len(data):
        (n,), kind = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            width, height, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and color in (2, 6) and interlace == 0
            bpp = 3 if color == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    raw = zlib.decompress(idat)
    stride = width * bpp
    rows: list[bytes] = []
    prev = bytearray(stride)
    for y in range(height):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line[k] for k in range(stride) if bpp == 3 or k % 4 != 3))
        prev = line
    return width, height, rows


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary (apt-get install -y chromium)")
def test_headless_browser_renders_the_charts(tmp_path):
    page, shot = tmp_path / "plot.html", tmp_path / "shot.png"
    assert main(["simulate", "--num-prompts", "120", "--request-rate", "40", "--random-input-len", "1000",
                 "--random-output-len", "100", "--max-model-len", "4096", "--plot", str(page)]) == 0
    proc = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                           "--disable-component-update", "--disable-sync", "--no-first-run",
                           f"--user-data-dir={tmp_path / 'profile'}", "--hide-scrollbars", f"--screenshot={shot}",
                           "--virtual-time-budget=10000",     # let plotly.js draw before the shot
                           "--window-size=1000,1500", page.as_uri()], capture_output=True, text=True, timeout=90)
    assert shot.is_file(), proc.stderr[-2000:]
    width, height, rows = _png_rgb(shot)
    assert (width, height) == (1000, 1500)
    blue, red = bytes.fromhex("1f77b4"), bytes.fromhex("d62728")

    def count(color: bytes, y0: int, y1: int) -> int:   # pixels close to the color (lines are anti-aliased)
        return sum(sum(1 for x in range(0, width * 3, 3)
                       if all(abs(row[x + k] - color[k]) <= 40 for k in range(3))) for row in rows[y0:y1])

    # the CDF lines (blue) are drawn in the upper part, the timeline's waiting line (red) below them
    assert count(blue, 350, 950) > 500
    assert count(red, 950, 1500) > 100
