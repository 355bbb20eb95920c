"""Tensor shapes (and small integer tensors' values) from a ``torch.save`` payload, without torch and without
unpickling: vLLM's ``image_embeds`` content parts are base64 ``torch.save`` files, and unpickling one runs whatever
code its pickle names.

A ``torch.save`` file is a zip: ``<root>/data.pkl`` (the object graph) and ``<root>/data/<key>`` (each storage's raw
bytes, little-endian). The pickle is read opcode by opcode (``pickletools.genops``: parsing only) by a small stack
machine that knows the few constructs ``torch.save`` writes for tensors, tuples, lists and dicts; the only callables
it accepts are ``torch._utils._rebuild_tensor_v2`` (a tensor: its storage, offset, size, stride) and
``collections.OrderedDict`` (its hooks), and it calls neither: each becomes a record. Anything else (another global,
an ``obj``/``inst``/``build`` of arbitrary classes) is refused.
"""

from __future__ import annotations

import io
import pickletools
import zipfile
from dataclasses import dataclass
from typing import Any

import numpy as np

MAX_PAYLOAD_BYTES = 1 << 30

_DTYPES = {
    "FloatStorage": ("float32", 4), "DoubleStorage": ("float64", 8), "HalfStorage": ("float16", 2),
    "BFloat16Storage": ("bfloat16", 2), "LongStorage": ("int64", 8), "IntStorage": ("int32", 4),
    "ShortStorage": ("int16", 2), "CharStorage": ("int8", 1), "ByteStorage": ("uint8", 1), "BoolStorage": ("bool", 1),
}
_INT_NUMPY = {"int64": "<i8", "int32": "<i4", "int16": "<i2", "int8": "i1", "uint8": "u1"}


class UnsafePayloadError(ValueError):
    """Not a torch.save payload this reader understands (or one that names code to run)."""


@dataclass(frozen=True, slots=True)
class TensorRecord:
    dtype: str
    shape: tuple[int, ...]
    storage_key: str
    offset: int                  # in elements
    stride: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class _Global:
    module: str
    name: str


@dataclass(frozen=True, slots=True)
class _Storage:
    dtype: str
    key: str


class _Mark:
    pass


_MARK = _Mark()
_ALLOWED_GLOBALS = {("torch._utils", "_rebuild_tensor_v2"), ("collections", "OrderedDict")}


def _global(module: str, name: str) -> _Global:
    if (module, name) in _ALLOWED_GLOBALS or (module == "torch" and name in _DTYPES):
        return _Global(module, name)
    raise UnsafePayloadError(f"the payload names {module}.{name}, which a tensor payload does not need")


def _pop_mark(stack: list[Any]) -> list[Any]:
    for i in range(len(stack) - 1, -1, -1):
        if stack[i] is _MARK:
            items = stack[i + 1:]
            del stack[i:]
            return items
    raise UnsafePayloadError("malformed pickle (no mark)")


def _reduce(fn: Any, args: Any) -> Any:
    if not isinstance(fn, _Global) or not isinstance(args, tuple):
        raise UnsafePayloadError("malformed pickle (a call of something not a known global)")
    if fn.name == "OrderedDict":
        return {}
    if fn.name == "_rebuild_tensor_v2":
        if len(args) < 4 or not isinstance(args[0], _Storage):
            raise UnsafePayloadError("malformed tensor record")
        storage, offset, size, stride = args[:4]
        if not (isinstance(offset, int) and isinstance(size, tuple) and isinstance(stride, tuple)
                and all(isinstance(v, int) and v >= 0 for v in size + stride)):
            raise UnsafePayloadError("malformed tensor record")
        return TensorRecord(storage.dtype, tuple(size), storage.key, offset, tuple(stride))
    raise UnsafePayloadError(f"the payload calls {fn.module}.{fn.name}")


def _read_pickle(data: bytes) -> Any:
    """The object graph of a torch.save pickle, tensors as ``TensorRecord``s (no code run)."""
    stack: list[Any] = []
    memo: dict[int, Any] = {}
    try:
        ops = list(pickletools.genops(data))
    except Exception as exc:  # noqa: BLE001 - any parse failure is a bad payload
        raise UnsafePayloadError(f"not a pickle ({exc.__class__.__name__})") from None
    for op, arg, _ in ops:
        name = op.name
        if name in ("PROTO", "FRAME"):
            continue
        if name == "STOP":
            break
        if name in ("GLOBAL",):
            module, _, attr = str(arg).partition(" ")
            stack.append(_global(module, attr))
        elif name == "STACK_GLOBAL":
            attr, module = stack.pop(), stack.pop()
            stack.append(_global(str(module), str(attr)))
        elif name in ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING", "BINSTRING",
                      "STRING", "BININT", "BININT1", "BININT2", "LONG1", "LONG4", "INT", "LONG", "BINFLOAT", "FLOAT",
                      "SHORT_BINBYTES", "BINBYTES", "BINBYTES8"):
            stack.append(arg)
        elif name == "NONE":
            stack.append(None)
        elif name in ("NEWTRUE", "NEWFALSE"):
            stack.append(name == "NEWTRUE")
        elif name == "MARK":
            stack.append(_MARK)
        elif name == "EMPTY_TUPLE":
            stack.append(())
        elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
            n = int(name[-1])
            items = stack[-n:]
            del stack[-n:]
            stack.append(tuple(items))
        elif name == "TUPLE":
            stack.append(tuple(_pop_mark(stack)))
        elif name == "EMPTY_LIST":
            stack.append([])
        elif name == "EMPTY_DICT":
            stack.append({})
        elif name == "APPEND":
            v = stack.pop()
            stack[-1].append(v)
        elif name == "APPENDS":
            items = _pop_mark(stack)
            stack[-1].extend(items)
        elif name == "SETITEM":
            v, k = stack.pop(), stack.pop()
            stack[-1][k] = v
        elif name == "SETITEMS":
            items = _pop_mark(stack)
            target = stack[-1]
            for i in range(0, len(items) - 1, 2):
                target[items[i]] = items[i + 1]
        elif name in ("BINPUT", "LONG_BINPUT", "PUT"):
            memo[int(arg)] = stack[-1]
        elif name == "MEMOIZE":
            memo[len(memo)] = stack[-1]
        elif name in ("BINGET", "LONG_BINGET", "GET"):
            stack.append(memo[int(arg)])
        elif name == "BINPERSID":
            pid = stack.pop()
            if not (isinstance(pid, tuple) and len(pid) >= 3 and pid[0] == "storage" and isinstance(pid[1], _Global)
                    and pid[1].name in _DTYPES):
                raise UnsafePayloadError("malformed storage reference")
            stack.append(_Storage(_DTYPES[pid[1].name][0], str(pid[2])))
        elif name == "REDUCE":
            args, fn = stack.pop(), stack.pop()
            stack.append(_reduce(fn, args))
        else:
            raise UnsafePayloadError(f"the payload uses pickle opcode {name}, which a tensor payload does not need")
    if len(stack) != 1:
        raise UnsafePayloadError("malformed pickle")
    return stack[0]


@dataclass
class TorchPayload:
    """One torch.save file: its object (tensors as records) and access to small integer tensors' values."""

    obj: Any
    _zip: zipfile.ZipFile
    _root: str

    def int_values(self, t: TensorRecord) -> list[int]:
        """A contiguous integer tensor's values (e.g. ``image_grid_thw``), read from its storage bytes."""
        if t.dtype not in _INT_NUMPY:
            raise UnsafePayloadError(f"expected an integer tensor, got {t.dtype}")
        n = int(np.prod(t.shape)) if t.shape else 1
        if n > 1 << 16:
            raise UnsafePayloadError("integer tensor too large")
        try:
            raw = self._zip.read(f"{self._root}/data/{t.storage_key}")
        except KeyError:
            raise UnsafePayloadError(f"storage {t.storage_key} missing") from None
        arr = np.frombuffer(raw, dtype=_INT_NUMPY[t.dtype])
        if t.offset + n > arr.size:
            raise UnsafePayloadError("tensor past its storage")
        return [int(v) for v in arr[t.offset:t.offset + n]]


def read_torch_payload(data: bytes) -> TorchPayload:
    """Parse a torch.save zip (UnsafePayloadError for anything else: legacy non-zip files included)."""
    if len(data) > MAX_PAYLOAD_BYTES:
        raise UnsafePayloadError("payload too large")
    try:
        zf = zipfile.ZipFile(io.BytesIO(data))
        names = zf.namelist()
    except (zipfile.BadZipFile, ValueError) as exc:
        raise UnsafePayloadError(f"not a torch.save zip file ({exc})") from None
    pkl = [n for n in names if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(pkl) != 1:
        raise UnsafePayloadError("not a torch.save zip file (no data.pkl)")
    root = pkl[0].split("/", 1)[0]
    return TorchPayload(_read_pickle(zf.read(pkl[0])), zf, root)
