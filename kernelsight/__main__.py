"""The ``kernelsight`` command (console script) and ``python -m kernelsight``.

A one-shot ``simulate`` runs with the cyclic garbage collector off from its first import to its exit, and its objects
frozen at the end. It makes almost no garbage cycles (the fast-forward run already switches the collector off), yet
the collector cost it ~50 ms of a 10,000-request run and ~10% of its start-up. It rescanned the imports' objects, then
the run's millions of objects once the collector came back on, and all of them again in the interpreter's final
collection at exit. Long-lived commands (``serve``, ``bench``, ``plan``'s worker pool) keep the collector.
"""

from __future__ import annotations

import gc
import sys

#: commands that run once and exit, with the collector off
_ONE_SHOT = frozenset({"simulate"})


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    one_shot = bool(args) and args[0] in _ONE_SHOT
    was_enabled = gc.isenabled()
    if one_shot:
        gc.disable()
    try:
        from kernelsight.cli import main as cli_main

        return cli_main(args)
    finally:
        if one_shot:
            gc.freeze()          # the exit's final collection skips what is left (it is all freed at exit)
            if was_enabled:
                gc.enable()


if __name__ == "__main__":
    sys.exit(main())
