"""The README and docs/ cannot rot: their runnable examples run, every command parses, the numbers they quote are
what the code gives, the README stays short and links each job's page, and the reference generator reads the real
parsers and registry. (``mkdocs build --strict``, in CI, checks links and anchors.)"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import shlex
import sys
from pathlib import Path

import pytest

from tests.docs_blocks import PAGES, ROOT, Block, run_block, runnable_blocks, shell_blocks

DOCS = ROOT / "docs"
JOB_PAGES = ("serving.md", "benchmark-clients.md", "router-testing.md", "fast-forward.md", "planning.md",
             "validate-calibrate.md", "accuracy.md")


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


sys.path.insert(0, str(DOCS / "gen"))
numbers = _load("page_numbers", DOCS / "gen" / "page_numbers.py")
reference = _load("reference", DOCS / "gen" / "reference.py")

RUNNABLE = [b for page in PAGES for b in runnable_blocks(page)]
_RAN: dict[str, tuple[Path, object]] = {}


def ran(block: Block, tmp_path_factory: pytest.TempPathFactory):
    """Run a block once per session; (its directory, the completed process)."""
    if block.id not in _RAN:
        workdir = tmp_path_factory.mktemp(re.sub(r"\W", "_", block.id))
        _RAN[block.id] = (workdir, run_block(block, workdir))
    return _RAN[block.id]


def _param(b: Block):
    return pytest.param(b, id=b.id, marks=[pytest.mark.slow] if b.slow else [])


# -- the examples -------------------------------------------------------------------------------------------
def test_there_are_runnable_examples_on_every_job_page_that_can_run_offline():
    pages = {b.page.name for b in RUNNABLE}
    assert {"fast-forward.md", "planning.md", "validate-calibrate.md"} <= pages


@pytest.mark.parametrize("block", [_param(b) for b in RUNNABLE])
def test_runnable_block_runs_offline_and_writes_what_it_names(block, tmp_path_factory):
    workdir, proc = ran(block, tmp_path_factory)
    assert proc.returncode == 0, f"{block.id} exited {proc.returncode}:\n{block.script}\n{proc.stderr[-3000:]}"
    assert "kernelsight" in block.script
    for out in block.outputs():
        path = workdir / out
        assert path.is_file() and path.stat().st_size > 0, f"{block.id} should have written {out}"


def test_every_kernelsight_command_in_the_readme_and_docs_parses():
    from kernelsight.cli import build_parser

    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    checked = 0
    for page in PAGES:
        for block in shell_blocks(page):
            script = re.sub(r"\\\n\s*", " ", block.text)
            env = {k: shlex.split(v)[0] for k, v in re.findall(r"^([A-Z_]+)=(\S+)$", script, re.M)}
            for line in script.splitlines():
                line = re.sub(r"^(?:[A-Z_]+=\S+\s+)+", "", line.strip())     # VAR=value kernelsight ...
                cmd = re.split(r"\s&&\s|\s\|\s", line)
                for part in cmd:
                    part = part.strip()
                    if not part.startswith("kernelsight "):
                        continue
                    argv = [env.get(a[1:], a) if a.startswith("$") else a for a in shlex.split(part, comments=True)]
                    argv = argv[1:-1] if argv[-1] == "&" else argv[1:]
                    where = f"{block.id}: {part}"
                    assert argv[0] in subs, f"{where}: no such subcommand"
                    try:
                        _, unknown = subs[argv[0]].parse_known_args(argv[1:])
                        assert not unknown, f"{where}: unknown {unknown}"
                        parser.parse_args(argv)
                    except SystemExit as exc:
                        raise AssertionError(f"{where}: rejected by the CLI") from exc
                    checked += 1
    assert checked >= 30


# -- the numbers --------------------------------------------------------------------------------------------
def _pages_with(name: str) -> list[Path]:
    return [p for p in PAGES if name in numbers.blocks(p.read_text())]


@pytest.mark.parametrize("name", sorted(numbers.STATIC))
def test_numbers_from_shipped_files_are_current(name):
    pages = _pages_with(name)
    assert pages, f"no page holds numbers:{name}"
    want = numbers.STATIC[name]()
    for page in pages:
        assert numbers.blocks(page.read_text())[name] == want, (
            f"{page.relative_to(ROOT)}: numbers:{name} is stale; run `python docs/gen/page_numbers.py`")


@pytest.mark.parametrize("name", sorted(numbers.RENDER))
def test_numbers_from_a_pages_example_are_its_output(name, tmp_path_factory):
    render, page, output = numbers.RENDER[name]
    path = DOCS / page
    blocks = runnable_blocks(path)
    made = [ran(b, tmp_path_factory)[0] / output for b in blocks]
    made = [m for m in made if m.is_file()]
    assert made, f"{page}: no runnable example writes {output}"
    want = render(json.loads(made[0].read_text()))
    assert numbers.blocks(path.read_text())[name] == want, (
        f"{page}: numbers:{name} is not what its example gives today; run `python docs/gen/page_numbers.py`")


def test_a_stale_block_is_caught():
    text = "a\n<!-- BEGIN numbers:x (from y) -->\nold\n<!-- END numbers:x -->\nb\n"
    assert numbers.blocks(text) == {"x": "old"}
    new = numbers.replace_block(text, "x", "new")
    assert numbers.blocks(new) == {"x": "new"} and new.startswith("a\n") and new.endswith("b\n")


# -- the README -----------------------------------------------------------------------------------------------
def test_readme_is_short_and_links_every_job_page():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    links = set(re.findall(r"\]\((docs/[^)#]+)(?:#[^)]*)?\)", text))
    for link in links:
        assert (ROOT / link).is_file(), f"README links {link}, which does not exist"
    assert {f"docs/{p}" for p in JOB_PAGES} <= links


def test_readme_keeps_the_two_commands_ci_runs():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    cmd1 = "python -m pip install -e '.[test]' && kernelsight simulate --num-prompts 500 --request-rate 20"
    assert cmd1 in readme and cmd1 in ci
    assert "\npython -m pytest -q\n" in readme and "\npython -m pytest -q\n" in ci
    assert "mkdocs build --strict" in ci


def test_the_examples_ship_with_their_licence():
    notice = (ROOT / "examples" / "LICENSE-LLMServingSim").read_text()
    assert "MIT License" in notice and "CASYS Lab, KAIST" in notice
    for block in RUNNABLE:
        for path in re.findall(r"(examples/[\w./-]+)", block.script):
            assert (ROOT / path).exists(), f"{block.id} reads {path}, which the project does not ship"


# -- the generated reference ------------------------------------------------------------------------------------
def test_the_cli_reference_has_every_subcommand_and_flag():
    from kernelsight.cli import build_parser

    page = reference.cli_page()
    parser = build_parser()

    def walk(p: argparse.ArgumentParser, path: str):
        yield path, p
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sub in a.choices.items():
                    yield from walk(sub, f"{path} {name}".strip())

    for path, p in walk(parser, ""):
        if path:
            assert f"## `kernelsight {path}`" in page
        for a in p._actions:
            for opt in a.option_strings:
                if opt not in ("-h", "--help"):
                    assert f"`{opt}`" in page, f"kernelsight {path}: {opt} missing from the CLI reference"


def test_the_metrics_reference_lists_what_a_server_exposes():
    page = reference.metrics_page()
    fams = {f["name"] for f in reference.metric_families()}
    assert {"vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "kernelsight:release_lateness_seconds",
            "kernelsight:injected_faults_total", "vllm:spec_decode_num_drafts_total",
            "vllm:gpu_cache_usage_perc"} <= fams
    for f in fams:
        assert f"`{f}`" in page


def test_the_profiles_and_bands_references_come_from_the_bundled_files():
    from kernelsight import profiles
    from kernelsight.profiles.accuracy import load_accuracy

    prof = reference.profiles_page()
    for name in profiles.list_hardware():
        assert f"  {name} " in prof
    for mid in profiles.list_models():
        assert mid in prof
    bands = reference.accuracy_page()
    for tier, b in load_accuracy()["run_bands_pct"].items():
        assert f"| {tier} | {b['runs']} | ±{b['ttft']}% |" in bands


# -- the figures ---------------------------------------------------------------------------------------------
sys.path.insert(0, str(ROOT / "benchmarks"))     # docs_figures imports _common beside it
figures = _load("docs_figures", ROOT / "benchmarks" / "docs_figures.py")


def test_the_plan_figure_shows_what_the_planning_example_gives_today(tmp_path_factory):
    blocks = runnable_blocks(DOCS / "planning.md")
    plan = json.loads((ran(blocks[0], tmp_path_factory)[0] / "plan.json").read_text())
    assert figures.png_description(DOCS / "images" / "plan-report.png") == figures.plan_summary(plan), (
        "docs/images/plan-report.png is stale: run `python benchmarks/docs_figures.py --only plan`")


def test_the_validate_figures_show_the_validated_runs_errors():
    from kernelsight.profiles.accuracy import load_accuracy

    runs = {(r["run"], r["tier"]): r for r in load_accuracy()["runs"]}
    pngs = sorted((DOCS / "images").glob("validate-*.png"))
    assert {p.stem.removeprefix("validate-") for p in pngs} == {run for run, _ in runs}
    for png in pngs:
        shown = figures.png_description(png)
        want = runs[(shown["run"], shown["tier"])]
        for m in ("ttft", "tpot", "e2el"):
            assert shown[f"{m}_mean_error_pct"] == round(want[f"{m}_mean"], 1), (
                f"{png.name} is stale: run `python benchmarks/docs_figures.py --only validate`")
