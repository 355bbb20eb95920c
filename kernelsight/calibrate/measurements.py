"""Read kernel measurements in the shared schema (``../shared/data/README.md``).

One directory describes one GPU and holds any of ``gemm``, ``attn_prefill``, ``attn_decode``, ``comm``,
``attn_encoder`` (a ViT's attention) and ``moe`` (the ``moe_gemm`` family: one FusedMoE layer forward per row) as
``<name>.csv`` or ``<name>.csv.gz``.
``latency_us`` is optional (prediction inputs lack it).
Duplicate keys are repeated measurements: every row is kept as one sample.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import numpy as np

#: Columns per family (``latency_us`` and ``kernel`` optional; ``attn_prefill`` may add ``cached_len``, the tokens
#: each sequence has cached before its chunk, 0 when absent); numeric ones are parsed as float.
SCHEMA: dict[str, tuple[str, ...]] = {
    "gemm": ("dtype", "m", "n", "k"),
    "attn_prefill": ("batch", "seq_len", "num_heads", "num_kv_heads", "head_dim", "kv_dtype", "window"),
    "attn_decode": ("batch", "cached_len", "num_heads", "num_kv_heads", "head_dim", "kv_dtype", "window"),
    "comm": ("op", "backend", "dtype", "num_gpus", "message_bytes"),
    "attn_encoder": ("batch", "seq_len", "num_heads", "head_dim", "dtype"),
    "moe_gemm": ("dtype", "num_tokens", "hidden_size", "inter_size", "topk", "num_experts", "moe_tp_size",
                 "moe_ep_size", "distribution"),
}
FAMILIES: tuple[str, ...] = tuple(SCHEMA)
#: File name stem per family where it is not the family's name: the shared MoE tables are ``moe.csv.gz`` (one
#: FusedMoE layer forward each), priced as the ``moe_gemm`` kernel family.
FILE_STEMS: dict[str, str] = {"moe_gemm": "moe"}
_STRING_COLUMNS = frozenset({"dtype", "kv_dtype", "kernel", "op", "backend", "distribution", "token_scope"})
#: Format column per family whose values the kernel model must know.
_FORMAT_COLUMN = {"gemm": "dtype", "attn_prefill": "kv_dtype", "attn_decode": "kv_dtype", "attn_encoder": "dtype",
                  "moe_gemm": "dtype"}
#: Formats real measurement sets hold that the kernel model has no roofline for yet, and why. Reading with
#: ``skipped`` leaves their rows out (counted) instead of failing the whole set; any other unknown value
#: stays an error, since it is more likely a malformed row than a format nobody has modelled. Empty since NVFP4
#: GEMMs are priced (``simcore.fp4_dispatch``); kept for the next format a measurement set brings first.
UNMODELLED_FORMATS: dict[str, str] = {}


@dataclass(slots=True)
class Table:
    """Column-oriented rows of one family file: str columns as ``<U`` arrays, the rest as float64."""

    family: str
    columns: dict[str, np.ndarray]
    header: tuple[str, ...]  # original column order, to write rows back unchanged
    raw: list[list[str]]  # original cell text, for round-tripping in ``predict``

    def __len__(self) -> int:
        return len(self.raw)

    def __getitem__(self, name: str) -> np.ndarray:
        return self.columns[name]

    @property
    def has_latency(self) -> bool:
        return "latency_us" in self.columns

    def subset(self, mask_or_index: np.ndarray) -> Table:
        idx = np.flatnonzero(mask_or_index) if mask_or_index.dtype == bool else mask_or_index
        return Table(
            self.family, {k: v[idx] for k, v in self.columns.items()}, self.header, [self.raw[i] for i in idx]
        )


def family_of_path(path: Path) -> str:
    """``gemm.csv.gz`` → ``gemm``; raises for files outside the schema."""
    stem = path.name.removesuffix(".gz").removesuffix(".csv")
    for fam in sorted(FAMILIES, key=len, reverse=True):   # moe_gemm before any shorter prefix
        s = FILE_STEMS.get(fam, fam)
        if stem == s or stem.startswith(s + "_") or stem.startswith(s + ".") or stem == fam:
            return fam
    raise ValueError(f"{path}: file name must start with one of {', '.join(FAMILIES)}")


def _family_of(path: Path, header: tuple[str, ...]) -> str:
    """Family from the file name, else from the columns (any file name works for ``predict``)."""
    try:
        return family_of_path(path)
    except ValueError:
        matches = [f for f, cols in SCHEMA.items() if set(cols) <= set(header)]
        if len(matches) != 1:
            raise
        return matches[0]


def _open_text(path: Path) -> io.TextIOBase:
    with open(path, "rb") as fh:
        magic = fh.read(2)
    if magic == b"\x1f\x8b":  # gzip by content, whatever the suffix
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8", newline="")
    return open(path, encoding="utf-8", newline="")  # noqa: SIM115 - closed by the caller's with


def read_table(path: str | Path, family: str | None = None, skipped: dict[str, int] | None = None) -> Table:
    """Read one measurement file (gzip or plain CSV). When ``skipped`` is given, rows of an
    :data:`UNMODELLED_FORMATS` format are left out and counted in it by ``"<family> <format>"``."""
    path = Path(path)
    with _open_text(path) as fh:
        reader = csv.reader(fh)
        try:
            header = tuple(h.strip() for h in next(reader))
        except StopIteration as exc:
            raise ValueError(f"{path}: empty file") from exc
        raw = [row for row in reader if row]
    fam = family or _family_of(path, header)
    missing = [c for c in SCHEMA[fam] if c not in header]
    if missing:
        raise ValueError(f"{path}: missing columns {missing} for family {fam!r}")
    for i, row in enumerate(raw):
        if len(row) != len(header):
            raise ValueError(f"{path}: line {i + 2} has {len(row)} cells, the header {len(header)}")
    if skipped is not None and fam in _FORMAT_COLUMN:
        j = header.index(_FORMAT_COLUMN[fam])
        kept = [r for r in raw if r[j] not in UNMODELLED_FORMATS]
        for r in raw:
            if r[j] in UNMODELLED_FORMATS:
                key = f"{fam} {r[j]}"
                skipped[key] = skipped.get(key, 0) + 1
        raw = kept
    cols: dict[str, np.ndarray] = {}
    for j, name in enumerate(header):
        cells = [r[j] for r in raw]
        if name in _STRING_COLUMNS:
            cols[name] = np.array(cells, dtype=str) if cells else np.array([], dtype=str)
        else:
            try:
                cols[name] = np.array(cells, dtype=float) if cells else np.zeros(0)
            except ValueError as exc:
                raise ValueError(f"{path}: column {name!r} is not numeric") from exc
    _check_values(path, fam, cols)
    return Table(fam, cols, header, raw)


#: Shape columns that must be positive; the rest of each family's numeric schema columns must be ≥ 0.
_POSITIVE = {
    "gemm": ("m", "n", "k"),
    "attn_prefill": ("batch", "seq_len", "num_heads", "num_kv_heads", "head_dim"),
    "attn_decode": ("batch", "num_heads", "num_kv_heads", "head_dim"),
    "comm": ("num_gpus", "message_bytes"),
    "attn_encoder": ("batch", "seq_len", "num_heads", "head_dim"),
    "moe_gemm": ("num_tokens", "hidden_size", "inter_size", "topk", "num_experts", "moe_tp_size", "moe_ep_size"),
}


def _check_values(path: Path, fam: str, cols: dict[str, np.ndarray]) -> None:
    """Values the kernel model has no roofline for are an error naming them, not a traceback later."""
    from kernelsight.calibrate.rows import ELEMENT_BYTES
    from kernelsight.simcore.kernels import GEMM_FORMAT_CODES, MOE_FORMAT_CODES

    known = {"gemm": GEMM_FORMAT_CODES, "attn_prefill": ELEMENT_BYTES, "attn_decode": ELEMENT_BYTES,
             "attn_encoder": ELEMENT_BYTES, "moe_gemm": MOE_FORMAT_CODES}.get(fam)
    if known is not None:
        col = _FORMAT_COLUMN[fam]
        bad = sorted(set(cols[col].tolist()) - set(known))
        if bad:
            why = "".join(f"; {b}: {UNMODELLED_FORMATS[b]}" for b in bad if b in UNMODELLED_FORMATS)
            raise ValueError(f"{path}: {col} {', '.join(map(repr, bad))} not supported (one of {', '.join(known)})"
                             f"{why}")
    for name in SCHEMA[fam]:
        if name in _STRING_COLUMNS:
            continue
        x = cols[name]
        positive = name in _POSITIVE[fam]
        ok = np.isfinite(x) & ((x > 0) if positive else (x >= 0))
        if not ok.all():
            i = int(np.flatnonzero(~ok)[0])
            raise ValueError(f"{path}: line {i + 2}: {name} must be {'> 0' if positive else '≥ 0'}, got {x[i]:g}")


def read_measurements(path: str | Path, skipped: dict[str, int] | None = None) -> dict[str, Table]:
    """All families of one GPU: a directory of family files, or a single file. ``skipped``: as in
    :func:`read_table` (rows of formats the model cannot price yet are counted there instead of failing)."""
    path = Path(path)
    if path.is_file():
        t = read_table(path, skipped=skipped)
        return {t.family: t}
    if not path.is_dir():
        raise FileNotFoundError(f"no measurement file or directory at {path}")
    out: dict[str, Table] = {}
    rank_tokens = measurement_software(path).get("vllm") in RANK_TOKEN_MOE_RELEASES
    for fam in FAMILIES:
        stem = FILE_STEMS.get(fam, fam)
        files = sorted(p for p in path.iterdir() if p.is_file() and p.name in (f"{stem}.csv", f"{stem}.csv.gz"))
        for p in files:
            t = read_table(p, fam, skipped)
            if fam == "moe_gemm" and rank_tokens:
                t = with_token_scope(t, "rank")
            out[fam] = t if fam not in out else concat_tables(out[fam], t)
    if not out:
        names = ", ".join(FILE_STEMS.get(f, f) + ".csv[.gz]" for f in FAMILIES)
        raise ValueError(f"{path}: no measurement files ({names})")
    return out


#: vLLM releases whose shared MoE tables were timed with only the rank's tokens entering the layer
#: (``calibrate.rows.RANK_TOKENS``): the A100 folder's.
RANK_TOKEN_MOE_RELEASES = ("0.14.0",)


def with_token_scope(table: Table, scope: str) -> Table:
    """The MoE table with a ``token_scope`` column (``rank``: only the tokens that picked the rank's experts were
    timed entering the layer)."""
    cols = dict(table.columns)
    cols["token_scope"] = np.full(len(table), scope)
    return Table(table.family, cols, table.header + ("token_scope",), [r + [scope] for r in table.raw])


def describe_skipped(skipped: dict[str, int]) -> list[str]:
    """One line per left-out format: how many rows of which family, and why."""
    out = []
    for key, n in sorted(skipped.items()):
        fam, fmt = key.split(" ", 1)
        out.append(f"skipped {n} {fam} rows of format {fmt!r}: {UNMODELLED_FORMATS.get(fmt, 'not supported')}")
    return out


def concat_tables(a: Table, b: Table) -> Table:
    if a.header != b.header:
        raise ValueError(f"cannot concatenate {a.family} tables with different columns")
    return Table(
        a.family,
        {k: np.concatenate([a.columns[k], b.columns[k]]) for k in a.columns},
        a.header,
        a.raw + b.raw,
    )


def write_table(table: Table, path: str | Path, extra: dict[str, np.ndarray] | None = None) -> None:
    """Write the rows back unchanged, plus ``extra`` columns (e.g. ``predicted_us``); gzip if ``.gz``; ``-`` is
    standard output."""
    extra = extra or {}
    if str(path) == "-":
        _write_rows(sys.stdout, table, extra)
        sys.stdout.flush()
        return
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt", encoding="utf-8", newline="") as fh:
        _write_rows(fh, table, extra)


def _write_rows(fh: TextIO, table: Table, extra: dict[str, np.ndarray]) -> None:
    w = csv.writer(fh)
    w.writerow(list(table.header) + list(extra))
    extra_cols = [np.asarray(v) for v in extra.values()]
    for i, row in enumerate(table.raw):
        w.writerow(row + [_fmt(c[i]) for c in extra_cols])


def _fmt(x: object) -> str:
    if isinstance(x, float | np.floating):
        return f"{float(x):.6g}" if np.isfinite(x) else ""
    return str(x)


#: What ``kernelsight calibrate sweep`` writes beside its measurement files: the GPU it ran on and how it timed.
SWEEP_INFO_FILE = "sweep.json"


def read_sweep_info(path: str | Path) -> dict | None:
    """The description a sweep left in a measurement directory (None: not a sweep's directory, or a single file)."""
    f = Path(path) / SWEEP_INFO_FILE
    if not f.is_file():
        return None
    try:
        info = json.loads(f.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{f}: not JSON ({exc})") from None
    return info if isinstance(info, dict) else None


#: The software whose versions decide which kernels a GPU runs (a kernel library picks its kernels per release).
SOFTWARE_KEYS = ("vllm", "torch", "cuda", "hip", "nccl")
#: The provenance file of a measurement folder in the shared layout ("key: value" lines, e.g. "vllm: 0.24.0").
SOURCE_FILE = "SOURCE"


def measurement_software(path: str | Path) -> dict[str, str]:
    """The versions of :data:`SOFTWARE_KEYS` the measurements in ``path`` were timed under, as far as recorded: a
    sweep's ``sweep.json``, else a ``SOURCE`` file's ``key: value`` lines. Empty for a single file or a folder
    that records neither."""
    path = Path(path)
    info = read_sweep_info(path) if path.is_dir() else None
    if info is not None:
        return {k: str(info[k]) for k in SOFTWARE_KEYS if info.get(k) not in (None, "")}
    source = path / SOURCE_FILE
    if not (path.is_dir() and source.is_file()):
        return {}
    out: dict[str, str] = {}
    for line in source.read_text(errors="replace").splitlines():
        key, sep, value = line.partition(":")
        key, value = key.strip().lower(), value.strip()
        if sep and key in SOFTWARE_KEYS and value:
            out[key] = value
    return {k: out[k] for k in SOFTWARE_KEYS if k in out}
