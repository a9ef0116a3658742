"""A reference turned into an exercise and back: its marked regions, the blank, and a solution filled in.

Pure text and syntax trees, nothing imported from mini_dist: `./run.sh check` reads these before any process
imports torch. kit/exercise.py says how a region is marked and what the blank says.
"""
import ast
import re
import textwrap
from typing import NamedTuple

START = re.compile(r"^(\s*)# exercise: (.+)$")
MORE = re.compile(r"^\s*# {2,}(\S.*)$")  # the contract's next line
END = re.compile(r"^\s*# end exercise\s*$")
WIDTH = 116


class Region(NamedTuple):
    first: int  # 0-based lines of '# exercise:' and of '# end exercise'
    last: int
    indent: str
    contract: str
    function: str  # the qualified name of the function it sits in: "Class.method"


def functions(source: str) -> list[tuple[int, int, str]]:
    """(first line, last line, qualified name: "Class.method") of every function, 1-based, outer before inner."""
    found = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if not isinstance(child, ast.ClassDef):
                    found.append((child.lineno, child.end_lineno, prefix + child.name))
                visit(child, f"{prefix}{child.name}.")
    visit(ast.parse(source), "")
    return found


def function_at(source: str, line: int, known: list | None = None) -> str | None:
    """The innermost function holding 1-based `line` (known: functions(source), if already read)."""
    inside = [(first, name) for first, last, name in known or functions(source) if first <= line <= last]
    return max(inside)[1] if inside else None


def regions(source: str) -> list[Region]:
    """Every marked region, in order."""
    lines = source.splitlines()
    found = []
    open_at = None
    known = functions(source)
    for i, line in enumerate(lines):
        start = START.match(line)
        if start and open_at is None:
            contract = [start.group(2).strip()]
            j = i + 1
            while j < len(lines) and MORE.match(lines[j]):
                contract.append(MORE.match(lines[j]).group(1).strip())
                j += 1
            open_at = (i, start.group(1), " ".join(contract))
        elif END.match(line):
            if open_at is None:
                raise ValueError(f"'# end exercise' at line {i + 1} closes no '# exercise:'")
            first, indent, contract = open_at
            found.append(Region(first, i, indent, contract, function_at(source, first + 1, known) or "<module>"))
            open_at = None
    if open_at is not None:
        raise ValueError(f"'# exercise:' at line {open_at[0] + 1} has no '# end exercise'")
    return found


def raise_lines(module: str, region: Region) -> list[str]:
    """The blank: one `raise NotImplementedError(...)` that says what must be true, wrapped to the page."""
    text = f"{module}: write {region.function}: {region.contract}"
    pieces = textwrap.wrap(text, WIDTH - len(region.indent) - 6, break_on_hyphens=False, break_long_words=False)
    quoted = ['"' + (p + (" " if k < len(pieces) - 1 else "")).replace("\\", "\\\\").replace('"', '\\"') + '"'
              for k, p in enumerate(pieces)]
    body = [f"{region.indent}    {q}" for q in quoted]
    return [f"{region.indent}raise NotImplementedError(", *body[:-1], body[-1] + ")"]


def answer(source: str, function: str) -> str:
    """The reference's own code in the region of `function`, its contract left out (a bank's wrong solution
    keeps it for the functions it does not get wrong)."""
    region = next(r for r in regions(source) if r.function == function)
    body = source.splitlines()[region.first + 1:region.last]
    while body and MORE.match(body[0]):
        body = body[1:]
    return "\n".join(body)


def planted(body: str, edits: dict) -> str:
    """`body` with a mistake planted, the way a bank writes a wrong solution: each line whose code (indentation
    and a trailing comment aside) is a key of `edits` becomes that key's value, indented as the line was; a value
    of several lines keeps their own indentation below the first, and "" deletes the line. Each key must name
    exactly one line."""
    lines = textwrap.dedent(body).strip("\n").splitlines()
    found = [code(line) for line in lines if code(line) in edits]
    if sorted(found) != sorted(edits):
        raise ValueError(f"each edit must name one line of the body: {sorted(edits)} against {found}")
    written = []
    for line in lines:
        if code(line) not in edits:
            written.append(line)
            continue
        indent = line[:len(line) - len(line.lstrip())]
        written.extend(indent + new for new in edits[code(line)].splitlines())
    return "\n".join(written)


def code(line: str) -> str:
    """A line of a bank's solution without its indentation and its trailing comment (two spaces, then #)."""
    return line.split("  # ")[0].strip()


def blank(source: str, module: str) -> str:
    """The exercise: each region's lines (contract and reference body) replaced by its NotImplementedError."""
    lines = source.splitlines()
    for region in reversed(regions(source)):
        lines[region.first:region.last + 1] = raise_lines(module, region)
    return "\n".join(lines) + "\n"


def blanks(source: str, module: str) -> list[tuple[int, int, str, int]]:
    """(first line, last line (1-based), function, column) of every blank's raise still in the source, in order."""
    found = []

    def visit(node, function):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, f"{function}.{child.name}" if function else child.name)
                continue
            said = child.exc.args[0] if isinstance(child, ast.Raise) and isinstance(child.exc, ast.Call) and getattr(
                child.exc.func, "id", None) == "NotImplementedError" and child.exc.args else None
            if isinstance(said, ast.Constant) and str(said.value).startswith(f"{module}: write "):
                found.append((child.lineno, child.end_lineno, function, child.col_offset))
            visit(child, function)
    visit(ast.parse(source), "")
    return sorted(found)


def fill(blanked: str, module: str, bodies: dict) -> str:
    """A solution written into the blank: bodies[qualified function name] is the code for its blank (a list for a
    function with several, in order), indented freely. The bank expresses every solution this way."""
    spots = blanks(blanked, module)
    unknown = set(bodies) - {name for _, _, name, _ in spots}
    if unknown:
        raise KeyError(f"{module}: no blank in {sorted(unknown)}; the blanks are in {sorted({s[2] for s in spots})}")
    written = []
    count = {}
    for first, last, name, column in spots:
        k = count[name] = count.get(name, -1) + 1
        given = bodies.get(name)
        code = given[k] if isinstance(given, (list, tuple)) else given if k == 0 else None
        if code is not None:
            written.append((first, last, textwrap.indent(textwrap.dedent(code).strip("\n"), " " * column)))
    lines = blanked.splitlines()
    for first, last, code in reversed(written):
        lines[first - 1:last] = code.splitlines()
    return "\n".join(lines) + "\n"
