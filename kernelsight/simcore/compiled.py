"""What the optional compiled core (``python -m kernelsight.accel build``: mypyc) needs to hear from the source.

``mypyc_attr(allow_interpreted_subclasses=True)`` lets interpreted classes subclass a class mypyc compiles. Without
``mypy_extensions`` installed (the pure-Python install) it is a decorator that changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

try:
    from mypy_extensions import mypyc_attr
except ImportError:          # the pure-Python install: nothing is compiled, nothing to mark
    def mypyc_attr(*_args: Any, **_kwargs: Any) -> Callable[[Any], Any]:  # type: ignore[misc]
        return lambda cls: cls

__all__ = ["mypyc_attr"]
