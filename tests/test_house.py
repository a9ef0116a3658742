"""The house holds its shape: files a learner can read in one sitting, a kit below the concepts, no circles.

- every file in mini_dist/ (kit and bench included) is at most 300 lines, demo included;
- every concept file starts with a docstring and ends with a demo runnable under torchrun, the demo after one
  marker line spelled the same everywhere: at most 200 lines of idea above it, at most 80 of demo below;
- nothing anywhere in mini_dist/ is packed to fit (several names from one tuple, named lambdas, statements
  sharing a line, list-times-condition tricks);
- the kit imports no concept; no concept imports bench/ or questions/, nor a name from another concept's demo;
  no import circle among the modules;
- the text speaks to learners about distributed training, never about how the work was commissioned;
- the one line that puts the repo on sys.path stays once per file, without a wall of `noqa: E402`;
- the README stays at most 250 lines (a table row per module, and what every part of the tour promises);
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
    assert not long, f"over the house budget of 300 lines (split the concept in two, or move support out): {long}"


@pytest.mark.single_process
def test_every_concept_opens_with_its_docstring_and_ends_with_a_demo():
    for f in files():
        if os.sep in f or f.startswith("_"):
            continue
        text = open(os.path.join(PACKAGE, f)).read()
        assert ast.get_docstring(ast.parse(text)), f"{f}: no module docstring (the idea, its formula, the command)"
        assert 'if __name__ == "__main__":' in text, f"{f}: no demo"


def concepts() -> list[str]:
    """The concept files: mini_dist/*.py, not the kit, bench/ or questions/ (they live in folders)."""
    return [f for f in files() if os.sep not in f and not f.startswith("_")]


def above_the_demo(rel: str) -> int:
    """How many lines of a concept file come before its demo marker (all of them if it has none)."""
    lines = open(os.path.join(PACKAGE, rel)).read().splitlines()
    return lines.index(MARKER) if MARKER in lines else len(lines)


@pytest.mark.single_process
def test_the_kit_imports_no_concept_and_no_concept_imports_bench_or_questions():
    for f in files():
        mods = imports(f)
        if f.startswith("kit" + os.sep):
            assert all(m.startswith("kit") for m in mods), f"{f} (the kit) imports a concept: {mods}"
        elif not f.startswith(("bench" + os.sep, "questions" + os.sep)):
            above = {m for m in mods if m.split(".")[0] in ("bench", "questions")}
            assert not above, f"{f} imports {above}: a concept imports the kit and the concepts below it only"


MARKER = "# ----------------------------------------------------------------------------- demo"
IDEA_LINES = 200  # docstring, imports and the algorithm: what a learner reads as the concept
DEMO_LINES = 80   # the marker, the command line and the demo


@pytest.mark.parametrize("rel", concepts())
@pytest.mark.single_process
def test_every_concept_is_its_idea_in_200_lines_then_its_demo_in_80(rel):
    lines = open(os.path.join(PACKAGE, rel)).read().splitlines()
    assert lines.count(MARKER) == 1, f"{rel}: the demo starts at one line, exactly {MARKER!r}"
    idea = lines.index(MARKER)
    demo = len(lines) - idea
    assert idea <= IDEA_LINES, (f"{rel}: {idea} lines above the demo marker, over {IDEA_LINES}: move a figure that "
                                f"answers a question to mini_dist/questions/, or split the file into two concepts")
    assert demo <= DEMO_LINES, f"{rel}: the demo has {demo} lines, over {DEMO_LINES}: move its measuring above"


@pytest.mark.parametrize("rel", concepts())
@pytest.mark.single_process
def test_every_demo_opens_with_its_command_line_and_ends_with_demo(rel):
    """Below the marker, parser() is the first function (the flags a learner can turn, then what the demo
    needs) and demo() the last, so every demo reads in the same order."""
    source = open(os.path.join(PACKAGE, rel)).read()
    below = source.splitlines().index(MARKER) + 1
    functions = [n.name for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.lineno > below]
    assert functions[:1] == ["parser"] and functions[-1:] == ["demo"], f"{rel}: the demo section's functions " \
        f"are {functions}; put parser() first and demo() last"


def packed(tree: ast.AST) -> list[str]:
    """The lines of a module that were packed to save lines: three names assigned from a tuple on one line,
    a lambda given a name, a list multiplied by a condition (`[x] * (cond)`)."""
    found = []
    conditions = (ast.Compare, ast.BoolOp, ast.UnaryOp)
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Lambda):
            found.append(f"line {node.lineno}: a named lambda (write a function)")
        elif (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Tuple)
              and isinstance(node.value, ast.Tuple) and len(node.targets[0].elts) >= 3):
            found.append(f"line {node.lineno}: {len(node.targets[0].elts)} names from one tuple (one per line)")
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
            for side, other in ((node.left, node.right), (node.right, node.left)):
                if isinstance(side, (ast.List, ast.Tuple)) and isinstance(other, conditions):
                    found.append(f"line {node.lineno}: a list multiplied by a condition (write the if)")
    return found


@pytest.mark.single_process
def test_nothing_is_packed_to_fit_a_budget():
    found = {f: packed(ast.parse(open(os.path.join(PACKAGE, f)).read())) for f in files()}
    found = {f: lines for f, lines in found.items() if lines}
    assert not found, f"lines packed to save space: {found}"


def test_the_packing_check_sees_each_kind_of_packing():
    sources = ["a, b, c = 1, 2, 3", "square = lambda x: x * x", "args = [\"-x\"] * (not every)", "n = [1] * (k > 0)"]
    for source in sources:
        assert packed(ast.parse(source)), source
    assert not packed(ast.parse("a, b = 1, 2\nq, k, v = qkv.chunk(3)\nxs = [0] * n")), "unpacking is not packing"


def top_level_names(tree: ast.Module) -> dict[str, int]:
    """Every name a module defines at its top level, with the line it is defined on (the first definition)."""
    lines = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names = [node.name]
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [(a.asname or a.name).split(".")[0] for a in node.names]
        else:
            continue
        for name in names:
            lines.setdefault(name, node.lineno)
    return lines


@pytest.mark.single_process
def test_no_concept_imports_a_name_from_another_concepts_demo():
    """A concept builds on what another concept teaches (above its marker), never on its demo's helpers."""
    idea = {}
    for rel in concepts():
        tree = ast.parse(open(os.path.join(PACKAGE, rel)).read())
        idea[module_name(rel)] = {n for n, line in top_level_names(tree).items() if line <= above_the_demo(rel)}
    wrong = []
    for rel in concepts():
        tree = ast.parse(open(os.path.join(PACKAGE, rel)).read())
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mini_dist."):
                source = node.module[len("mini_dist."):]
                if source in idea:
                    wrong += [f"{rel} imports {source}.{a.name}" for a in node.names if a.name not in idea[source]]
            if isinstance(node, ast.ImportFrom) and node.module == "mini_dist":
                aliases.update({a.asname or a.name: a.name for a in node.names if a.name in idea})
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr not in idea[aliases[node.value.id]]):
                wrong.append(f"{rel} uses {aliases[node.value.id]}.{node.attr}")
    assert not wrong, f"names from another concept's demo section (move them above its marker, or to the kit): " \
                      f"{sorted(set(wrong))}"


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
def test_the_readme_is_at_most_250_lines():
    n = sum(1 for _ in open(os.path.join(ROOT, "README.md")))
    assert n <= 250, f"README.md has {n} lines; the house budget is 250"


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


COMMISSIONED = re.compile(r"\b(the issue|issue's|interview notes|target of the issue)\b", re.IGNORECASE)


@pytest.mark.single_process
def test_the_text_speaks_about_training_never_about_how_it_was_commissioned():
    texts = [os.path.join(path, name) for top in ("mini_dist", "tests") for path, _, names in
             os.walk(os.path.join(ROOT, top)) for name in names if name.endswith((".py", ".md"))]
    texts += [os.path.join(ROOT, name) for name in ("README.md", "run.sh", os.path.join(".ci", "run"))]
    found = [f"{os.path.relpath(path, ROOT)}:{n}: {line.strip()[:80]}" for path in texts
             for n, line in enumerate(open(path), 1) if COMMISSIONED.search(line) and path != __file__]
    assert not found, "text about how the work was asked for, not about training (cite papers or PyTorch):\n" + \
        "\n".join(found)
