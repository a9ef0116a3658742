"""The house holds its shape: files a learner can read in one sitting, a kit below the concepts, no circles.

- every file in mini_dist/ (kit and bench included) is at most 300 lines, demo included;
- every concept file starts with a docstring and ends with a demo runnable under torchrun;
- the kit imports no concept; no concept imports bench/; no import circle among the modules;
- the one line that puts the repo on sys.path stays once per file, without a wall of `noqa: E402`;
- the README stays at most 265 lines (a table row per module, and what every part of the tour promises);
- every `torchrun ... mini_dist/...py` written in the source or the README names a file that exists.
"""
import ast
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "mini_dist")


def files():
    for path, _, names in os.walk(PACKAGE):
        for name in sorted(names):
            if name.endswith(".py"):
                yield os.path.relpath(os.path.join(path, name), PACKAGE)


def module_name(rel: str) -> str:
    name = rel[:-3].replace(os.sep, ".")
    return name[:-len(".__init__")] if name.endswith(".__init__") else name


def imports(rel: str) -> set[str]:
    """The mini_dist modules a file imports (at any depth: a demo's late import counts too)."""
    tree, found = ast.parse(open(os.path.join(PACKAGE, rel)).read()), set()
    known = {module_name(f) for f in files()}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mini_dist"):
            base = node.module[len("mini_dist."):] if node.module != "mini_dist" else ""
            for alias in node.names:
                full = f"{base}.{alias.name}".strip(".")
                found.add(full if full in known else base)
        elif isinstance(node, ast.Import):
            found |= {a.name[len("mini_dist."):] for a in node.names if a.name.startswith("mini_dist.")}
    return {m for m in found if m and m in known} - {module_name(rel)}


@pytest.mark.single_process
def test_every_file_is_at_most_300_lines_demo_included():
    long = {f: n for f in files() if (n := sum(1 for _ in open(os.path.join(PACKAGE, f)))) > 300}
    assert not long, f"over the house budget of 300 lines (split the concept in two, or move support to the kit): {long}"


@pytest.mark.single_process
def test_every_concept_opens_with_its_docstring_and_ends_with_a_demo():
    for f in files():
        if os.sep in f or f.startswith("_"):
            continue
        text = open(os.path.join(PACKAGE, f)).read()
        assert ast.get_docstring(ast.parse(text)), f"{f}: no module docstring (the idea, its formula, the command)"
        assert 'if __name__ == "__main__":' in text, f"{f}: no demo"


@pytest.mark.single_process
def test_the_kit_imports_no_concept_and_no_concept_imports_bench():
    for f in files():
        mods = imports(f)
        if f.startswith("kit" + os.sep):
            assert all(m.startswith("kit") for m in mods), f"{f} (the kit) imports a concept: {mods}"
        elif not f.startswith("bench" + os.sep):
            assert not any(m == "bench" or m.startswith("bench.") for m in mods), f"{f} imports bench/: {mods}"


@pytest.mark.single_process
def test_no_import_circles():
    graph = {module_name(f): imports(f) for f in files()}
    state = {}

    def visit(m, path):
        state[m] = "open"
        for n in graph.get(m, ()):
            if state.get(n) == "open":
                raise AssertionError(f"import circle: {' -> '.join(path[path.index(n):] + [n])}")
            if n not in state:
                visit(n, path + [n])
        state[m] = "done"

    for m in graph:
        if m not in state:
            visit(m, [m])


@pytest.mark.single_process
def test_the_path_line_is_once_per_file_and_no_wall_of_noqa():
    for f in files():
        text = open(os.path.join(PACKAGE, f)).read()
        assert text.count("sys.path.insert") <= 1, f"{f}: sys.path changed more than once"
        assert "noqa: E402" not in text, f"{f}: an `if not __package__:` block before the imports needs no noqa"


@pytest.mark.single_process
def test_the_readme_is_at_most_265_lines():
    n = sum(1 for _ in open(os.path.join(ROOT, "README.md")))
    assert n <= 265, f"README.md has {n} lines; the house budget is 265"


TORCHRUN_PATH = re.compile(r"torchrun\b[^\n`]*?(mini_dist/[\w/.]+\.py)")
PLACEHOLDER = "mini_dist/x.py"  # the comment above each `sys.path.insert`: any concept file, run directly


@pytest.mark.single_process
def test_every_torchrun_command_in_the_source_and_the_readme_names_a_file_that_exists():
    texts = {os.path.relpath(os.path.join(path, name), ROOT): os.path.join(path, name)
             for path, _, names in os.walk(PACKAGE) for name in names if name.endswith((".py", ".md"))}
    texts["README.md"] = os.path.join(ROOT, "README.md")
    named = {(where, m.group(1)) for where, path in texts.items() for m in TORCHRUN_PATH.finditer(open(path).read())}
    missing = sorted(f"{where}: {file}" for where, file in named
                     if file != PLACEHOLDER and not os.path.exists(os.path.join(ROOT, file)))
    assert named and not missing, f"torchrun commands naming files that do not exist (moved into the kit?): {missing}"
