"""Bundled hardware and model profiles, and the loaders that read them (all file I/O lives here).

simcore stays pure: it parses dicts (``hardware_spec_from_dict``, ``model_spec_from_hf_config``);
this module finds the files (package data, local paths, the local HuggingFace cache) and reads them.
Nothing here touches the network.
"""

from __future__ import annotations

import functools
import json
import os
import re
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

from kernelsight.simcore.calibration import Calibration, calibration_from_dict, default_calibration, vllm_release
from kernelsight.simcore.hardware import HardwareSpec, hardware_spec_from_dict
from kernelsight.simcore.model_spec import ModelSpec, model_spec_from_hf_config

__all__ = [
    "UnknownHardwareError",
    "UnknownModelError",
    "hf_hub_cache_dir",
    "list_hardware",
    "list_models",
    "load_hardware",
    "load_model",
    "load_preprocessor_config",
    "load_video_preprocessor_config",
    "model_config_path",
]


class UnknownHardwareError(ValueError):
    """No bundled hardware profile (or JSON file) matches the requested name."""


class UnknownModelError(ValueError):
    """The model is neither bundled, a local directory with config.json, nor in the local HF cache."""


def _package_dir(sub: str) -> Traversable:
    return resources.files(__name__).joinpath(sub)


def _read_json(source: Traversable | Path) -> dict[str, Any]:
    try:
        data = json.loads(source.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{source}: not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{source}: expected a JSON object")
    return data


# ----------------------------------------------------------------------------------------- hardware

def _hw_key(name: str) -> str:
    # Case-, '-'/'_'- and space-insensitive, so "H100_SXM", "h100-sxm" and "NVIDIA H100 80GB HBM3" all work.
    return re.sub(r"[\s_\-]+", "", name.strip().lower())


@functools.cache
def _bundled_hardware() -> dict[str, dict[str, Any]]:
    """canonical name -> raw profile dict, for every bundled hardware/*.json."""
    out: dict[str, dict[str, Any]] = {}
    for entry in _package_dir("hardware").iterdir():
        if entry.name.endswith(".json"):
            data = _read_json(entry)
            out[data["name"]] = data
    return out


@functools.cache
def _hardware_lookup() -> dict[str, str]:
    """normalised name / alias / display name -> canonical name."""
    lookup: dict[str, str] = {}
    for name, data in _bundled_hardware().items():
        for key in (name, data.get("display_name", ""), *data.get("aliases", ())):
            norm = _hw_key(key)
            if not norm:
                continue
            if lookup.get(norm, name) != name:
                # Two profiles claiming one alias would make lookups order-dependent: refuse.
                raise ValueError(f"hardware alias {key!r} is claimed by both {lookup[norm]!r} and {name!r}")
            lookup[norm] = name
    return lookup


def list_hardware() -> list[str]:
    """Canonical names of the bundled hardware profiles, sorted."""
    return sorted(_bundled_hardware())


def bundled_hardware_name(name: str) -> str | None:
    """The canonical name of the bundled profile a name, alias or CUDA device name (``NVIDIA H100 80GB HBM3``) or
    folder name (``h100_sxm``) stands for; None when no bundled profile has it."""
    return _hardware_lookup().get(_hw_key(name))


def load_hardware(name_or_path: str) -> HardwareSpec:
    """Load a bundled GPU profile by name/alias (case-, '-'/'_'-insensitive) or a JSON file path."""
    canonical = bundled_hardware_name(name_or_path)
    if canonical is not None:
        return hardware_spec_from_dict(_bundled_hardware()[canonical])
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return hardware_spec_from_dict(_read_json(path))
    hint = "no such file; " if name_or_path.endswith(".json") else ""
    raise UnknownHardwareError(
        f"unknown hardware {name_or_path!r} ({hint}not a bundled profile or a JSON file). "
        f"Bundled: {', '.join(list_hardware())}"
    )


# ------------------------------------------------------------------------------------------- models

@functools.cache
def _model_index() -> dict[str, Any]:
    return _read_json(_package_dir("models").joinpath("index.json"))


@functools.cache
def _model_lookup() -> dict[str, tuple[str, str, dict[str, Any]]]:
    """lower-cased id/alias -> (name to report, bundled file, config overrides).

    Aliases name the same repo, so they report the canonical id; variants (e.g. -Instruct) are other
    repos with the same architecture, so they report their own id and may override a few keys (eos).
    """
    lookup: dict[str, tuple[str, str, dict[str, Any]]] = {}
    for entry in _model_index()["models"]:
        target = (entry["id"], entry["file"], {})
        for key in (entry["id"], *entry.get("aliases", ())):
            lookup[key.lower()] = target
        for vid, variant in entry.get("variants", {}).items():
            vtarget = (vid, entry["file"], dict(variant.get("overrides", {})))
            for key in (vid, *variant.get("aliases", ())):
                lookup[key.lower()] = vtarget
    return lookup


def list_models() -> list[str]:
    """Canonical ids of the bundled model configs (aliases and -Instruct variants not listed)."""
    return sorted(entry["id"] for entry in _model_index()["models"])


def hf_hub_cache_dir() -> Path:
    """The local HF hub cache, resolved the way huggingface_hub does (without importing it)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def _hf_cache_config(model_id: str) -> Path | None:
    """config.json of ``org/name`` in the local HF cache, preferring the snapshot refs/main points to."""
    parts = model_id.split("/")
    if len(parts) != 2 or not all(parts) or any(p in (".", "..") for p in parts):
        return None
    hub = hf_hub_cache_dir()
    repo_dir = hub / f"models--{parts[0]}--{parts[1]}"
    if not repo_dir.is_dir() and hub.is_dir():
        # Hub ids are case-insensitive; the cache directory keeps whatever casing was downloaded.
        wanted = repo_dir.name.lower()
        repo_dir = next((d for d in hub.iterdir() if d.name.lower() == wanted and d.is_dir()), repo_dir)
    snapshots = repo_dir / "snapshots"
    if not snapshots.is_dir():
        return None
    ref = repo_dir / "refs" / "main"
    if ref.is_file():
        candidate = snapshots / ref.read_text(encoding="utf-8").strip() / "config.json"
        if candidate.is_file():
            return candidate
    # No (valid) refs/main, e.g. a revision-pinned download: take the newest snapshot that has a config.
    found = [p for p in snapshots.glob("*/config.json") if p.is_file()]
    return max(found, key=lambda p: (p.stat().st_mtime, str(p))) if found else None


def _local_config(model: str) -> Path | None:
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path / "config.json"
    if path.is_file() and path.suffix == ".json":
        return path
    return None


def model_config_path(model: str) -> Path | None:
    """Where load_model would read the config from (tokenizer files may sit next to it), else None.

    Bundled configs return their package-data path (no tokenizer next to those).
    """
    hit = _model_lookup().get(model.strip().lower())
    if hit is not None:
        bundled = _package_dir("models").joinpath(hit[1])
        return bundled if isinstance(bundled, Path) else Path(str(bundled))
    return _local_config(model) or _hf_cache_config(model.strip())


def _merge_hf_quant_config(config: dict[str, Any], config_path: Path) -> dict[str, Any]:
    """Fold a ModelOpt ``hf_quant_config.json`` beside config.json into ``quantization_config``."""
    hq_path = config_path.with_name("hf_quant_config.json")
    if "quantization_config" in config or not hq_path.is_file():
        return config
    quant = _read_json(hq_path).get("quantization", {})
    algo = quant.get("quant_algo")
    if not algo:
        return config
    return {**config, "quantization_config": {"quant_method": str(algo).lower(), **quant}}


def load_model(model: str) -> ModelSpec:
    """Resolve a model id or path to a ModelSpec. Never touches the network.

    Order: (1) bundled id/alias (case-insensitive); (2) a local directory holding config.json (or a
    config JSON file); (3) ``org/name`` in the local HF cache. Raises UnknownModelError otherwise, and
    UnsupportedArchitectureError for configs the kernel model cannot simulate.
    """
    hit = _model_lookup().get(model.strip().lower())
    if hit is not None:
        name, fname, overrides = hit
        config = {**_read_json(_package_dir("models").joinpath(fname)), **overrides}
        return model_spec_from_hf_config(config, name)
    path = _local_config(model) or _hf_cache_config(model.strip())
    if path is not None:
        return model_spec_from_hf_config(_merge_hf_quant_config(_read_json(path), path), model)
    raise UnknownModelError(
        f"unknown model {model!r}: not bundled, not a local directory with config.json, and not in the "
        f"local HuggingFace cache ({hf_hub_cache_dir()}). Bundled: {', '.join(list_models())}"
    )


def load_preprocessor_config(model: str) -> dict[str, Any] | None:
    """The model's image processor config (HF ``preprocessor_config.json``): bundled beside its config, or next to
    the config.json of a local directory / the HF cache; None when there is none (a text-only model, or a VLM whose
    processor defaults then apply). Never touches the network."""
    for entry in _model_index()["models"]:
        ids = {entry["id"].lower(), *(a.lower() for a in entry.get("aliases", ()))}
        for vid, variant in entry.get("variants", {}).items():
            ids |= {vid.lower(), *(a.lower() for a in variant.get("aliases", ()))}
        if model.strip().lower() in ids:
            return _read_json(_package_dir("models").joinpath(entry["preprocessor"])) if entry.get("preprocessor") \
                else None
    path = _local_config(model) or _hf_cache_config(model.strip())
    if path is not None and path.with_name("preprocessor_config.json").is_file():
        return _read_json(path.with_name("preprocessor_config.json"))
    return None


def load_video_preprocessor_config(model: str) -> dict[str, Any] | None:
    """The model's video processor config (HF ``video_preprocessor_config.json``): bundled beside its config, or
    next to a local directory's / the HF cache's config.json; None when there is none (transformers then falls back to
    the image processor's config). Never touches the network."""
    for entry in _model_index()["models"]:
        ids = {entry["id"].lower(), *(a.lower() for a in entry.get("aliases", ()))}
        for vid, variant in entry.get("variants", {}).items():
            ids |= {vid.lower(), *(a.lower() for a in variant.get("aliases", ()))}
        if model.strip().lower() in ids:
            name = entry.get("video_preprocessor")
            return _read_json(_package_dir("models").joinpath(name)) if name else None
    path = _local_config(model) or _hf_cache_config(model.strip())
    if path is not None and path.with_name("video_preprocessor_config.json").is_file():
        return _read_json(path.with_name("video_preprocessor_config.json"))
    return None


# -- calibrations ---------------------------------------------------------------------------------
# A calibration belongs to a GPU *and* a software stack: a kernel library picks its kernels per release, so the same
# GPU timed under two vLLM releases gives two calibrations. ``calibration/<gpu>.json`` is the GPU's default (the
# newest release it was timed under); ``calibration/<gpu>@vllm-<version>.json`` holds another release's.
_STACK_SEP = "@vllm-"


def calibration_file_name(hardware: str, vllm_version: str | None = None) -> str:
    """The bundled file of a GPU's calibration: its default (``None``), or the one timed under ``vllm_version``."""
    return f"{hardware}{_STACK_SEP}{vllm_version}.json" if vllm_version else f"{hardware}.json"


def list_calibrations() -> list[str]:
    """Hardware names that ship a fitted calibration table."""
    return sorted({p.name[: -len(".json")].split(_STACK_SEP)[0] for p in _package_dir("calibration").iterdir()
                   if p.name.endswith(".json")})


@functools.cache
def _calibration_header(file_name: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    """(tier, software) of a bundled calibration file."""
    data = _read_json(_package_dir("calibration").joinpath(file_name))
    return str(data["tier"]), tuple(sorted((str(k), str(v)) for k, v in data.get("software", {}).items()))


def calibration_stacks(hardware: str) -> list[tuple[str, str]]:
    """(vLLM version its kernels were timed under — ``""`` when not recorded —, bundled file name) of every bundled
    calibration of a GPU, the default first (empty for a GPU with none)."""
    canonical = load_hardware(hardware).name
    default = calibration_file_name(canonical)
    names = sorted(p.name for p in _package_dir("calibration").iterdir()
                   if p.name == default or (p.name.startswith(canonical + _STACK_SEP) and p.name.endswith(".json")))
    names.sort(key=lambda n: n != default)
    return [(dict(_calibration_header(n)[1]).get("vllm", ""), n) for n in names]


def pick_calibration_stack(stacks: list[tuple[str, str]], vllm_version: str | None) -> tuple[str, str] | None:
    """Which of a GPU's bundled calibrations (:func:`calibration_stacks`) prices a run under ``vllm_version``: the one
    timed under that release; else the newest timed under an older release (the kernels it dispatched were there
    already); else the oldest; a calibration that names no single release (cross-generation) only when it is the
    GPU's only one. None: the default (no version asked, or no bundled calibration)."""
    if not stacks or not vllm_version:
        return stacks[0] if stacks else None
    wanted = vllm_release(vllm_version)
    for stack in stacks:
        if stack[0] == vllm_version or (wanted is not None and vllm_release(stack[0]) == wanted):
            return stack
    releases = sorted((r, s) for s in stacks if (r := vllm_release(s[0])) is not None)
    if not releases or wanted is None:
        return stacks[0]
    older = [s for r, s in releases if r < wanted]
    return older[-1] if older else releases[0][1]


def read_calibration_file(path: str | os.PathLike[str]) -> Calibration:
    """A calibration JSON (``kernelsight calibrate fit``'s output or a bundled table); a file that is not one is a
    ValueError naming the file and what is wrong with it."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"calibration file not found: {p}")
    data = _read_json(p)
    try:
        return calibration_from_dict(data)
    except KeyError as exc:
        raise ValueError(f"{p}: not a kernelsight calibration file (no {exc.args[0]!r} entry)") from None
    except (TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"{p}: not a kernelsight calibration file ({exc})") from None


def bundled_calibration_summaries(hardware: str) -> list[tuple[str, dict[str, str]]]:
    """(tier, software) of each of a GPU's bundled calibrations, the default first (:func:`calibration_stacks`), read
    without building their η models (what ``kernelsight profiles`` lists); empty when the GPU ships none."""
    return [(_calibration_header(file)[0], dict(_calibration_header(file)[1]))
            for _, file in calibration_stacks(hardware)]


def load_calibration(hardware: str, path: str | os.PathLike[str] | None = None,
                     vllm_version: str | None = None) -> Calibration:
    """The calibration for a GPU: ``path`` if given, else the bundled table of the software stack that prices a run
    under ``vllm_version`` (:func:`pick_calibration_stack`; default: the GPU's default, its newest), else documented
    defaults. :func:`kernelsight.simcore.calibration.stack_note` says when it was timed under another release."""
    if path is not None:
        return read_calibration_file(path)
    canonical = load_hardware(hardware).name
    if vllm_version:
        stack = pick_calibration_stack(calibration_stacks(canonical), vllm_version)
        file = stack[1] if stack is not None else None
    else:   # the default file: no other stack's header to read (a start-up path)
        file = calibration_file_name(canonical)
    bundled = _package_dir("calibration") / file if file else None
    if bundled is not None and bundled.is_file():
        return calibration_from_dict(_read_json(bundled))
    return default_calibration(canonical)
