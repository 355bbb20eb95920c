"""The optional compiled core (``python -m kernelsight.accel``): what clean removes, what status calls stale, and (slow,
where mypyc and a C compiler exist) that a compiled copy of the tree simulates bit for bit what the pure one does."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

from kernelsight import accel


@pytest.fixture
def fake_tree(tmp_path, monkeypatch):
    """A package tree under tmp_path holding every compiled module's source; accel pointed at it."""
    for module in accel.MODULES:
        path = tmp_path.joinpath(*module.split(".")).with_suffix(".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# {module}\n")
    monkeypatch.setattr(accel, "_ROOT", str(tmp_path))
    monkeypatch.setattr(accel, "_SIMCORE", str(tmp_path / "kernelsight" / "simcore"))
    return tmp_path


def test_clean_removes_the_built_extensions_and_nothing_else(fake_tree):
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    built = [fake_tree.joinpath(*m.split(".")).with_name(m.rsplit(".", 1)[1] + suffix) for m in accel.MODULES]
    built.append(fake_tree / "kernelsight" / "simcore" / f"_accel__mypyc{suffix}")
    built.append(fake_tree / "kernelsight" / "simcore" / accel.MANIFEST)
    for path in built:
        path.write_text(json.dumps({"sources": {}}))
    other = fake_tree / "kernelsight" / "simcore" / f"someone_elses{suffix}"     # not ours: stays
    other.write_bytes(b"")
    removed = accel.clean()
    assert sorted(removed) == sorted(str(p) for p in built)
    assert not any(p.exists() for p in built)
    assert other.exists()
    assert all(fake_tree.joinpath(*m.split(".")).with_suffix(".py").exists() for m in accel.MODULES)


def test_status_calls_a_module_stale_once_its_source_changes_after_the_build(fake_tree):
    assert accel.stale_modules() == []                 # nothing built: nothing stale
    sources = {m: accel._sha256(accel._source_path(m)) for m in accel.MODULES}
    (fake_tree / "kernelsight" / "simcore" / accel.MANIFEST).write_text(json.dumps({"sources": sources}))
    assert accel.stale_modules() == []
    changed = "kernelsight.simcore.scheduler"
    with open(accel._source_path(changed), "a") as f:
        f.write("x = 1\n")
    assert accel.stale_modules() == [changed]


def test_the_pure_install_needs_no_mypy_extensions(monkeypatch):
    """Without mypy_extensions (a Python-only install) the class marker changes nothing."""
    monkeypatch.setitem(sys.modules, "mypy_extensions", None)       # import fails
    spec = importlib.util.find_spec("kernelsight.simcore.compiled")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    class Plain:
        pass

    assert mod.mypyc_attr(allow_interpreted_subclasses=True)(Plain) is Plain


_FINGERPRINT = r"""
import hashlib, sys
import numpy as np
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
sys.path.insert(0, sys.argv[1])
from kernelsight import accel
from kernelsight.engine_args import create_engine_config
from kernelsight.loadgen.arrivals import arrival_times_s
from kernelsight.loadgen.datasets import prefix_repetition_dataset
from kernelsight.loadgen.fastforward import run_fast_forward
from kernelsight.simcore.engine_config import EngineArgs
assert accel.__file__.startswith(sys.argv[1]), accel.__file__
cfg = create_engine_config(EngineArgs(model="meta-llama/Llama-3.1-8B", hardware="h100", seed=3,
                                      num_gpu_blocks_override=3000, max_model_len=8192))
samples = prefix_repetition_dataset(400, 1024, 400, 8, 120, cfg.model.vocab_size, seed=3)
res = run_fast_forward(cfg, samples, arrival_times_s(400, 40.0, 1.0, seed=3).tolist())
h = hashlib.sha256()
for r in res.records:
    h.update(np.array([r.ttft_s, r.latency_s, *r.itl_s], dtype=np.float64).tobytes())
print(len(accel.compiled_modules()), res.num_steps, res.num_preemptions, h.hexdigest())
"""


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("mypyc") is None, reason="needs mypyc: pip install -e '.[accel]'")
@pytest.mark.skipif(shutil.which(sysconfig.get_config_var("CC").split()[0] if sysconfig.get_config_var("CC")
                                 else "cc") is None, reason="needs a C compiler")
def test_a_compiled_copy_simulates_bit_for_bit_what_the_pure_one_does(tmp_path):
    src = os.path.dirname(os.path.dirname(os.path.abspath(accel.__file__)))
    shutil.copytree(os.path.join(src, "kernelsight"), tmp_path / "kernelsight",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", accel.MANIFEST))

    def run() -> list[str]:
        out = subprocess.run([sys.executable, "-c", _FINGERPRINT, str(tmp_path)], check=True, capture_output=True,
                             text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}).stdout
        return out.split()

    pure = run()
    subprocess.run([sys.executable, "-c", "import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'editable' "
                    "not in repr(f).lower()]; sys.path.insert(0, sys.argv[1]); from kernelsight import accel; "
                    "sys.exit(accel.main(['build']))", str(tmp_path)], check=True, capture_output=True)
    compiled = run()
    assert pure[0] == "0" and compiled[0] == str(len(accel.MODULES))
    assert int(compiled[2]) > 0                  # the workload preempts: the KV paths ran
    assert compiled[1:] == pure[1:]
