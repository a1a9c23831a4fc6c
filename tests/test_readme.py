"""README.md is a front door: at most 150 lines, the two commands at the top where .ci/run reads them, and every
relative link of README.md and the user docs it points to (docs/*.md it owns) resolves to a file and a heading."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ["README.md", *(f"docs/{n}.md" for n in ("CONFIG", "RUNS", "FAST_PATHS", "DISTRIBUTED", "PERFORMANCE"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def command_after(lines: list[str], marker: str) -> str:
    """What .ci/run's awk takes: the line two after the marker (the marker, the opening fence, the command)."""
    i = lines.index(marker)
    assert lines[i + 1] == "```bash" and lines[i + 3] == "```", f"{marker} is not followed by one fenced bash line"
    return lines[i + 2]


def anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^a-z0-9 _-]", "", heading.strip().lower()).replace(" ", "-")


def test_readme_is_short_and_keeps_both_commands():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; move detail to docs/ (at most 150)"
    train = command_after(lines, "<!-- train-command -->")
    test = command_after(lines, "<!-- test-command -->")
    assert train.endswith("&& hybridtune train") and "pip install" in train
    assert test.endswith("python -m pytest -q -n auto") and "'.[test]'" in test  # the fast tier, one worker a core
    assert lines.index("<!-- train-command -->") < lines.index("<!-- test-command -->") < 30  # at the top
    assert "<!-- test-command -->" in (ROOT / ".ci" / "run").read_text()  # what CI reads them by


@pytest.mark.parametrize("rel", DOCS)
def test_relative_links_resolve(rel):
    path = ROOT / rel
    for target in LINK.findall(path.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):
            continue  # a URL
        file, _, frag = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        assert dest.exists(), f"{rel}: link {target!r}: no {dest.relative_to(ROOT)}"
        if frag:
            headings = [m[1] for m in re.findall(r"^(#+) (.+)$", dest.read_text(encoding="utf-8"), re.M)]
            assert frag in {anchor(h) for h in headings}, f"{rel}: link {target!r}: no heading with that anchor"


@pytest.mark.parametrize("rel", DOCS)
def test_code_blocks_open_and_close_in_pairs(rel):
    """A bare fence closes a block, and a fence with a language never appears inside one: a section pasted into the
    middle of an example leaves its opening fences inside the block (which then runs on through the headings)."""
    inside = None
    for n, line in enumerate((ROOT / rel).read_text(encoding="utf-8").splitlines(), 1):
        if not line.startswith("```"):
            assert not (inside and line.startswith("## ")), f"{rel}:{n}: a heading inside the block of line {inside}"
            continue
        if inside is None:
            inside = n
        else:
            assert line == "```", f"{rel}:{n}: a block opens inside the block of line {inside}"
            inside = None
    assert inside is None, f"{rel}: the block of line {inside} is never closed"


def test_config_md_says_once_what_happens_to_images():
    """CONFIG.md trains images on a vision-language checkpoint (its Images section) and nowhere says the data are text
    only (issue 47 defect 18: its Data bullet said rows with images were refused, as hybridtune trained text only)."""
    text = (ROOT / "docs" / "CONFIG.md").read_text(encoding="utf-8")
    assert "text only" not in text and "## Images" in text
    data = text.split("- **Data**", 1)[1].split("\n- **", 1)[0]
    assert "vision-language checkpoint" in data and "text-only model" in data
