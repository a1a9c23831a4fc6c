"""The shape of the package, read from the source with `ast` (nothing is imported).

- No import cycle among hybridtune modules, counting imports inside functions (a function-local import
  hides a cycle from Python, not from a reader).
- No module in src/ over 500 lines; no module docstring over 15 lines.
- The layering of docs/ARCHITECTURE.md (`LAYERS`, top to bottom): a module imports its own package, a package
  of a lower layer, or a leaf; never a package of its own layer or of a layer above. The leaf modules (errors,
  batch, textfile, versions, files, models.anatomy) import nothing of ours and may be imported from anywhere.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "hybridtune"
MAX_LINES = 500
LEAVES = frozenset(
    {
        "hybridtune.errors",
        "hybridtune.batch",
        "hybridtune.textfile",
        "hybridtune.versions",
        "hybridtune.files",
        "hybridtune.models.anatomy",
    }
)
# `python -m hybridtune` runs __main__, whose one job is to call the CLI.
CLI_ENTRY = frozenset({"hybridtune.__main__"})
# The layers, top to bottom (docs/ARCHITECTURE.md). Packages in one layer do not import each other.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("cli",),
    ("bench", "infer"),
    ("train",),
    ("run",),
    ("runtime",),
    ("kernels",),
    ("compiler",),
    ("models", "data"),
    ("mixers",),
    ("ops",),
    ("config",),
)
# The package root holds the version and lazy public entry points (`hybridtune.patch_model`): anyone may read it.
ROOT = PACKAGE


def package_of(module: str) -> str:
    """`hybridtune.run.checkpoint` -> `run`; the root package -> ''."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def layer_of(package: str) -> int | None:
    for i, layer in enumerate(LAYERS):
        if package in layer:
            return i
    return None


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import that runs sideways or back up the layers, as 'a imports b (layer of a -> layer of b)'."""
    bad = []
    for m, targets in graph.items():
        if m in LEAVES or m == ROOT or m in CLI_ENTRY:
            continue
        mine = package_of(m)
        for t in targets:
            theirs = package_of(t)
            if t in LEAVES or t == ROOT or theirs == mine:
                continue
            lm, lt = layer_of(mine), layer_of(theirs)
            if lm is None or lt is None or lt <= lm:
                bad.append(f"{m} imports {t} (layer {mine!r} -> {theirs!r})")
    return sorted(bad)


def module_files(src: Path = SRC) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under src/hybridtune (a package is its __init__.py)."""
    out = {}
    for path in sorted((src / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path, modules: set[str]) -> set[str]:
    """The hybridtune modules `name` imports anywhere in its file: module top, functions, classes, branches.

    `from a.b import c` counts as an import of `a.b.c` when that is a module, else of `a.b`; relative
    imports are resolved against the module's package.
    """
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else base)
    # `import hybridtune.a.b` names the module itself; an unknown dotted name falls back to its nearest module.
    out = set()
    for target in found:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != name:
            out.add(target)
    return out


def import_graph(src: Path = SRC) -> dict[str, set[str]]:
    files = module_files(src)
    modules = set(files)
    return {name: imports_of(name, path, modules) for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None when it has none (iterative depth-first search)."""
    WHITE, GREY, BLACK = 0, 1, 2
    color = dict.fromkeys(graph, WHITE)
    for start in sorted(graph):
        if color[start] != WHITE:
            continue
        stack: list[tuple[str, list[str]]] = [(start, sorted(graph[start]))]
        path = [start]
        color[start] = GREY
        while stack:
            node, todo = stack[-1]
            if not todo:
                color[node] = BLACK
                stack.pop()
                path.pop()
                continue
            nxt = todo.pop(0)
            state = color.get(nxt, BLACK)  # a name outside the graph has no edges
            if state == GREY:
                return path[path.index(nxt) :] + [nxt]
            if state == WHITE:
                color[nxt] = GREY
                stack.append((nxt, sorted(graph.get(nxt, ()))))
                path.append(nxt)
    return None


def _in(module: str, layer: str) -> bool:
    prefix = f"{PACKAGE}.{layer}"
    return module == prefix or module.startswith(prefix + ".")


# ---------------------------------------------------------------------------------------------------------
# The finder itself


@pytest.mark.parametrize(
    "graph, cycle",
    [
        ({"a": {"b"}, "b": {"c"}, "c": set()}, None),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
        ({"a": {"b", "d"}, "b": set(), "d": {"e"}, "e": {"d"}}, ["d", "e", "d"]),
        ({"a": {"b"}, "b": {"c"}, "c": {"b"}, "z": set()}, ["b", "c", "b"]),
        ({"a": {"b"}, "b": {"c"}, "c": {"x"}}, None),  # x is not a module of the graph
        ({"a": {"b", "c"}, "b": {"c"}, "c": set()}, None),  # a diamond is not a cycle
    ],
)
def test_find_cycle(graph, cycle):
    assert find_cycle(graph) == cycle


def test_function_local_and_relative_imports_are_edges(tmp_path):
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("def f():\n    from hybridtune.sub import b\n    return b\n")
    (pkg / "sub" / "b.py").write_text("from . import c\n")
    (pkg / "sub" / "c.py").write_text("class C:\n    def m(self):\n        import hybridtune.sub.a\n")
    graph = import_graph(tmp_path)
    assert graph["hybridtune.sub.a"] == {"hybridtune.sub.b"}
    assert graph["hybridtune.sub.b"] == {"hybridtune.sub.c"}
    assert graph["hybridtune.sub.c"] == {"hybridtune.sub.a"}
    assert find_cycle(graph) == ["hybridtune.sub.a", "hybridtune.sub.b", "hybridtune.sub.c", "hybridtune.sub.a"]


def test_from_package_import_name_is_an_edge_to_the_package(tmp_path):
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from hybridtune.sub.a import f\n")
    (pkg / "sub" / "a.py").write_text("def f(): ...\n")
    (pkg / "sub" / "rel.py").write_text("from .. import user\nfrom ..sub import a\n")
    (pkg / "user.py").write_text("from hybridtune.sub import f\n")
    graph = import_graph(tmp_path)
    assert graph["hybridtune.user"] == {"hybridtune.sub"}
    assert graph["hybridtune.sub"] == {"hybridtune.sub.a"}
    assert graph["hybridtune.sub.rel"] == {"hybridtune.user", "hybridtune.sub.a"}


# ---------------------------------------------------------------------------------------------------------
# The package


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


def test_no_import_cycle(graph):
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle (imports inside functions count): " + " -> ".join(cycle)


def test_no_module_over_500_lines():
    long = {
        str(p.relative_to(SRC)): n
        for p in module_files().values()
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines (split them by job): {long}"


def test_leaves_import_nothing_of_ours_but_leaves(graph):
    bad = sorted(f"{m} imports {t}" for m in LEAVES & set(graph) for t in graph[m] if t not in LEAVES)
    assert not bad, bad


def test_every_package_has_a_layer():
    packages = {package_of(m) for m in module_files()} - {""}
    leaves = {package_of(m) for m in LEAVES if m.count(".") == 1}
    missing = sorted(packages - leaves - {p for layer in LAYERS for p in layer} - {"__main__"})
    assert not missing, f"packages with no layer in LAYERS (add them, and to docs/ARCHITECTURE.md): {missing}"


def test_no_import_runs_sideways_or_back_up(graph):
    bad = layering_violations(graph)
    assert not bad, "imports against the layering of docs/ARCHITECTURE.md: " + "; ".join(bad)


@pytest.mark.parametrize(
    "planted",
    [
        ("hybridtune.ops.loss", "hybridtune.train.trainer"),  # the bottom reaching the top
        ("hybridtune.runtime.step", "hybridtune.run.checkpoint"),  # one layer back up
        ("hybridtune.models.loading", "hybridtune.data.formats"),  # sideways within a layer
        ("hybridtune.mixers.gdn.ops", "hybridtune.models.patching"),  # a mixer reaching the model adapters
    ],
)
def test_a_planted_back_edge_is_found(graph, planted):
    source, target = planted
    assert source in graph and target in graph, planted
    assert not layering_violations(graph)  # the real graph is clean, so the planted edge is what is found
    planted_graph = {m: set(t) for m, t in graph.items()}
    planted_graph[source].add(target)
    assert layering_violations(planted_graph) == [
        f"{source} imports {target} (layer {package_of(source)!r} -> {package_of(target)!r})"
    ]


def test_nothing_imports_the_cli(graph):
    bad = sorted(
        f"{m} imports {t}"
        for m, targets in graph.items()
        if m not in CLI_ENTRY
        for t in targets
        if t == "hybridtune.cli"
    )
    assert not bad, bad


def module_docstring_lines(path: Path) -> int:
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")), clean=False)
    return len(doc.splitlines()) if doc else 0


def test_no_module_docstring_over_15_lines():
    long = {str(p.relative_to(SRC)): n for p in module_files().values() if (n := module_docstring_lines(p)) > 15}
    assert not long, f"module docstrings over 15 lines (reasoning belongs in docs/): {long}"


# A benchmark row id ("row 97", "rows 87-88"), a note number ("NOTES 46", "benchmarks/NOTES.md 47"), a session or a
# date of work ("2026-12-02"). Only .py files are read: mixers/gdn/tuned/*.json are data and may carry their dates.
# Allowed, by the lookbehind: `file:row N`, how a data error locates a row of the user's file (data/sources.py).
CITATION = re.compile(r"(?<!:)\b[Rr]ows? \d+|\bNOTES?(\.md)? \d+|\bnotes? \d+|\b20\d\d-\d\d\b|\b[Ss]ession \d+")


def test_citation_pattern_finds_each_form():
    cited = ["rows 87-88 hold it", "Row 97", "benchmarks/NOTES.md 47", "NOTES 46", "on 2026-12-02", "session 15"]
    assert all(CITATION.search(s) for s in cited)
    assert not any(CITATION.search(s) for s in ["a.csv:row 3: bad", "the row's id", "rows numbered from 1"])


def test_no_row_note_or_date_citations_in_src():
    """Figures keep their sources in docs/ (docs/INTERNALS.md, benchmarks/), never in src/: no benchmark row id,
    note number, session or date in a module's docstrings, comments, help strings or error messages."""
    found = [
        f"{p.relative_to(SRC)}:{i}: {m.group(0)!r}"
        for p in module_files().values()
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if (m := CITATION.search(line))
    ]
    assert not found, "row/note/date citations in src/ (move them, with the figure, to docs/): " + "; ".join(found)
