"""An optional compiled simulation core: the hot simcore modules compiled in place with mypyc.

``python -m kernelsight.accel build`` compiles :data:`MODULES` into extension modules next to their ``.py`` files
(the import system prefers an extension module to a source file in the same directory), ``clean`` removes them,
``status`` says which are loaded compiled and whether any was built from a source that has changed since.
The source stays plain Python that runs identically uncompiled: the pure path is the default, the one CI runs, and
the compiled one must give the same fingerprints (``benchmarks/sim_fingerprint.py --check``).
Needs the ``accel`` extra (mypy, whose mypyc is the compiler) and a C compiler; nothing at run time.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import hashlib
import importlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile

#: the modules compiled, by profile of ``benchmarks/sim_speed.py``: the step loop, scheduler, KV bookkeeping, the
#: step model's cached paths and the batch shapes they pass, and the fast-forward driver that records each event
#: (the rest of simcore is called per distinct kernel shape, not per step)
MODULES: tuple[str, ...] = (
    "kernelsight.simcore.request",
    "kernelsight.simcore.block_hash",
    "kernelsight.simcore.block_pool",
    "kernelsight.simcore.kv_cache",
    "kernelsight.simcore.scheduler",
    "kernelsight.simcore.engine",
    "kernelsight.simcore.step_model",
    "kernelsight.loadgen.fastforward",
)

#: mypyc's shared library of the group (every compiled module's code); the per-module files are small shims into it
GROUP = "kernelsight.simcore._accel"
#: which sources the extensions were built from (sha256 each), written by ``build``
MANIFEST = "_accel_manifest.json"

_PKG_DIR = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_PKG_DIR)          # the directory holding the kernelsight package
_SIMCORE = os.path.join(_PKG_DIR, "simcore")


def _source_path(module: str) -> str:
    return os.path.join(_ROOT, *module.split(".")) + ".py"


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _ext_suffix() -> str:
    return sysconfig.get_config_var("EXT_SUFFIX") or ".so"


def _ext_stem(module: str) -> str:
    """Where a module's extension goes, less its suffix (``…/engine`` → ``…/engine.cpython-311-….so``)."""
    return os.path.join(_ROOT, *module.split("."))


def built_files() -> list[str]:
    """The extension files ``build`` leaves in the package (any Python version's), and its manifest."""
    manifest = os.path.join(_SIMCORE, MANIFEST)
    modules = set(MODULES)
    if os.path.exists(manifest):          # a module built then and dropped from MODULES since
        with open(manifest) as f:
            modules.update(json.load(f)["sources"])
    stems = [_ext_stem(m) for m in sorted(modules)] + [_ext_stem(GROUP + "__mypyc")]
    found = [p for stem in stems for p in glob.glob(stem + ".*.so")]
    return sorted(found) + ([manifest] if os.path.exists(manifest) else [])


def clean() -> list[str]:
    """Remove the compiled modules; the pure-Python ones load again from the next process on."""
    removed = built_files()
    for path in removed:
        os.remove(path)
    return removed


def stale_modules() -> list[str]:
    """Modules whose compiled file was built from a source that differs from the ``.py`` now beside it."""
    manifest = os.path.join(_SIMCORE, MANIFEST)
    if not os.path.exists(manifest):
        return []
    with open(manifest) as f:
        built = json.load(f)["sources"]
    return [m for m, digest in built.items()
            if not os.path.exists(_source_path(m)) or _sha256(_source_path(m)) != digest]


def compiled_modules() -> list[str]:
    """Which of :data:`MODULES` this process imports from an extension module."""
    out = []
    for name in MODULES:
        mod = importlib.import_module(name)
        if (getattr(mod, "__file__", "") or "").endswith(".so"):
            out.append(name)
    return out


def build(verbose: bool = False) -> list[str]:
    """Compile :data:`MODULES` with mypyc into the package; returns the files written."""
    try:
        from mypyc.build import mypycify
        from setuptools import setup
    except ImportError as exc:
        raise SystemExit(f"kernelsight.accel build needs mypyc and setuptools: pip install -e '.[accel]' ({exc})") \
            from None
    clean()                   # an old build must not shadow a failed new one
    paths = [os.path.relpath(_source_path(m), _ROOT) for m in MODULES]
    with tempfile.TemporaryDirectory(prefix="kernelsight-accel-") as tmp:
        with _chdir(_ROOT):
            # the modules they import are type-checked, quietly (follow-imports=silent), to type the calls into
            # them; only MODULES are compiled
            ext = mypycify(["--follow-imports=silent", "--ignore-missing-imports", *paths], opt_level="3",
                           group_name=GROUP, target_dir=os.path.join(tmp, "c"), verbose=verbose)
        with _chdir(tmp):         # away from the project's pyproject.toml, which setup() would read
            setup(name="kernelsight-accel", ext_modules=ext, script_name="kernelsight.accel",
                  script_args=["-q", "build_ext", "--build-temp", os.path.join(tmp, "obj"),
                               "--build-lib", os.path.join(tmp, "lib")])
        written = []
        for module in (*MODULES, GROUP + "__mypyc"):
            rel = os.path.relpath(_ext_stem(module), _ROOT) + _ext_suffix()
            shutil.copy2(os.path.join(tmp, "lib", rel), os.path.join(_ROOT, rel))
            written.append(os.path.join(_ROOT, rel))
    manifest = {"sources": {m: _sha256(_source_path(m)) for m in MODULES}, "python": sys.version.split()[0]}
    with open(os.path.join(_SIMCORE, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
    return sorted(written)


@contextlib.contextmanager
def _chdir(path: str):
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kernelsight.accel", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="compile the hot simcore modules in place (the accel extra, a C compiler)")
    b.add_argument("-v", "--verbose", action="store_true")
    sub.add_parser("clean", help="remove the compiled modules")
    sub.add_parser("status", help="which modules load compiled, and which were built from a changed source")
    ns = ap.parse_args(argv)
    if ns.cmd == "build":
        for path in build(ns.verbose):
            print(f"built {os.path.relpath(path, _ROOT)}")
        return 0
    if ns.cmd == "clean":
        for path in clean():
            print(f"removed {os.path.relpath(path, _ROOT)}")
        return 0
    stale = stale_modules()
    compiled = compiled_modules()
    for name in MODULES:
        state = "compiled" if name in compiled else "pure Python"
        note = "  (STALE: its source changed since the build: build or clean again)" if name in stale else ""
        print(f"{name:40s} {state}{note}")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
