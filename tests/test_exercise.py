"""The exercise machinery: blanks that hold the contract and never the answer, hints on request, one module graded
at a time, a report that is never cut, and banks of solutions that prove the grading: right ones pass, wrong ones
fail with their mistake named.

Single process (cheap): regions and blanks, fill, the header, hints and their state, the stand-in, the report's
lines, and every bank held against its exercise (functions, names, hints, every declared mistake made by a wrong
solution). Slow (each `check` starts a pytest of its own): a fresh exercise fails and the reference passes, the
planted mistakes fail, a hang is named, another module's broken copy is never used, and every bank entry is
graded: right ones pass, wrong ones fail with their mistake's name in the report.
"""
import ast
import builtins
import importlib
import os
import re
import sys
from types import SimpleNamespace

import pytest

import grading
from harness import command, device, run
from mini_dist.kit import exercise
from mini_dist.kit.stand_in import StandIn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BANKS = sorted(f[5:-3] for f in os.listdir(os.path.join(ROOT, "tests")) if re.fullmatch(r"bank_\w+\.py", f))


def definitions(source: str) -> dict:
    """name -> docstring of every function and class in the source."""
    return {n.name: ast.get_docstring(n) for n in ast.walk(ast.parse(source))
            if isinstance(n, (ast.FunctionDef, ast.ClassDef))}


def bank(module):
    return importlib.import_module(f"bank_{module}")


def blanked_functions(module) -> list[str]:
    return [r.function for r in exercise.regions(exercise.reference(module))]


@pytest.mark.single_process
def test_there_are_at_least_ten_exercises_and_each_blank_keeps_every_signature_and_docstring():
    modules = exercise.exercises()
    assert len(modules) >= 10, modules
    for module in modules:
        source = exercise.reference(module)
        blank = exercise.blank(source, module)
        assert definitions(blank) == definitions(source), module
        assert [f for _, _, f, _ in exercise.blanks(blank, module)] == blanked_functions(module), module
        assert "# exercise:" not in blank and "# end exercise" not in blank
        compile(blank, module, "exec")


@pytest.mark.single_process
def test_every_exercise_is_graded_by_marked_properties_in_files_that_exist():
    for module in exercise.exercises():
        files = exercise.test_files(module)
        assert all(os.path.exists(f) for f in files), (module, files)
        assert exercise.properties(module), module


def test_an_unclosed_region_is_refused_with_its_line():
    with pytest.raises(ValueError, match="line 2 has no '# end exercise'"):
        exercise.regions("def f():\n    # exercise: write it\n    return 1\n")
    with pytest.raises(ValueError, match="line 3 closes no '# exercise:'"):
        exercise.regions("def f():\n    return 1\n    # end exercise\n")


@pytest.mark.single_process
def test_a_blank_says_its_contract_in_full_and_holds_no_line_of_the_answer():
    source = ("class F:\n    def backward(ctx, grad):\n        # exercise: return (dx, None): dx \"summed\" over\n"
              "        #   the ranks, every rank the same\n        dx = grad * 2  # the answer\n"
              "        return dx, None\n        # end exercise\n")
    blank = exercise.blank(source, "m")
    said = ast.literal_eval("(" + re.search(r"NotImplementedError\((.*)\)", blank, re.S).group(1) + ")")
    assert said == 'm: write F.backward: return (dx, None): dx "summed" over the ranks, every rank the same'
    assert "grad * 2" not in blank and "return dx" not in blank
    for module in BANKS:  # brought up to the contract: no line found only in the answer is in the blank or header
        source = exercise.reference(module)
        inside = {i for r in exercise.regions(source) for i in range(r.first, r.last + 1)}
        lines = [line.strip() for line in source.splitlines()]
        answer = {lines[i] for i in inside} - {lines[i] for i in range(len(lines)) if i not in inside}
        written = "\n".join(exercise.header(module)) + exercise.blank(source, module)
        assert not answer & {line.strip() for line in written.splitlines()}, module


@pytest.mark.single_process
def test_fill_writes_each_body_into_its_blank_and_refuses_a_function_without_one():
    source = "def f(x):\n    # exercise: double it\n    return 2 * x\n    # end exercise\n\n\ndef g():\n    return 1\n"
    blank = exercise.blank(source, "m")
    filled = exercise.fill(blank, "m", {"f": "\n        y = x + x\n        return y\n"})
    space = {}
    exec(compile(filled, "m", "exec"), space)
    assert space["f"](3) == 6 and "NotImplementedError" not in filled
    with pytest.raises(KeyError, match=r"no blank in \['g'\]"):
        exercise.fill(blank, "m", {"g": "return 2"})


@pytest.mark.single_process
def test_planted_changes_only_the_lines_it_names_and_refuses_a_line_it_cannot_name_once():
    body = """
        total = 0
        for x in xs:
            total += x  # the sum
        return total
    """
    wrong = exercise.planted(body, {"total += x": "if x:\n    total -= x", "return total": "return -total"})
    assert wrong == "total = 0\nfor x in xs:\n    if x:\n        total -= x\nreturn -total"
    assert exercise.planted(body, {"total = 0": ""}).splitlines()[0] == "for x in xs:"
    with pytest.raises(ValueError, match="each edit must name one line"):
        exercise.planted(body, {"total = 1": "total = 0"})
    with pytest.raises(ValueError, match="each edit must name one line"):
        exercise.planted(body + body, {"return total": "return 0"})


@pytest.mark.parametrize("module", exercise.ORDER)
@pytest.mark.single_process
def test_a_blank_filled_with_the_references_answers_is_the_reference_without_its_contracts(module):
    reference = exercise.reference(module)
    filled = exercise.fill(exercise.blank(reference, module), module, exercise.answers(module))
    lines = reference.splitlines()
    marked = set()
    for region in exercise.regions(reference):
        marked.add(region.first)  # '# exercise:'
        i = region.first + 1
        while lines[i].strip().startswith("#  "):  # the contract's next lines
            marked.add(i)
            i += 1
        marked.add(region.last)  # '# end exercise'
    assert filled.splitlines() == [line for i, line in enumerate(lines) if i not in marked]


@pytest.mark.single_process
def test_write_refuses_to_overwrite_work_in_progress_unless_forced_and_heads_the_copy_with_its_judges(tmp_path):
    path = exercise.write("ring_allreduce", workspace=str(tmp_path))
    assert exercise.write("ring_allreduce", workspace=str(tmp_path)) == path  # a fresh copy: nothing lost
    head = open(path).read().split('"""')[0]
    for doc, judges in exercise.properties("ring_allreduce"):
        assert " ".join(doc.split()[:6]) in " ".join(head.replace("#", " ").split()), doc
    assert "./run.sh hint ring_allreduce" in head
    with open(path, "a") as f:
        f.write("# my work\n")
    with pytest.raises(SystemExit, match="holds your work in progress"):
        exercise.write("ring_allreduce", workspace=str(tmp_path))
    exercise.write("ring_allreduce", force=True, workspace=str(tmp_path))
    assert "# my work" not in open(path).read()


@pytest.mark.single_process
def test_hint_shows_the_next_unseen_hint_of_the_first_blank_then_of_where_the_last_check_failed(tmp_path, capsys):
    hints = exercise.hints("comm")
    path = exercise.write("comm", workspace=str(tmp_path))
    exercise.hint("comm", str(tmp_path))
    exercise.hint("comm", str(tmp_path))
    first = hints["CopyToParallelRegion.forward"]
    said = capsys.readouterr().out
    assert f"hint 1 of {len(first)} for CopyToParallelRegion.forward" in said and f"hint 2 of {len(first)}" in said
    assert " ".join(first[0].split()) in " ".join(said.split())
    right = next(iter(bank("comm").RIGHT.values()))
    open(path, "w").write(exercise.fill(exercise.blank(exercise.reference("comm"), "comm"), "comm", right))
    exercise.remember(str(tmp_path), "comm", dict(exercise.state(str(tmp_path), "comm"),
                                                  failed="ReduceFromParallelRegion.backward"))
    exercise.hint("comm", str(tmp_path))
    assert "hint 1 of 2 for ReduceFromParallelRegion.backward" in capsys.readouterr().out
    exercise.write("comm", force=True, workspace=str(tmp_path))  # a fresh start forgets what was seen
    assert exercise.state(str(tmp_path), "comm") == {"seen": {}, "failed": None}


@pytest.mark.single_process
def test_only_the_module_under_check_stands_in_for_mini_dists(tmp_path):
    (tmp_path / "comm.py").write_text("raise SyntaxError('a broken copy')\n")
    finder = StandIn(str(tmp_path / "ring_allreduce.py"))
    spec = finder.find_spec("mini_dist.ring_allreduce")
    assert spec.origin == str(tmp_path / "ring_allreduce.py")
    assert finder.find_spec("mini_dist.comm") is None and finder.find_spec("mini_dist.ring_pipelined") is None


@pytest.mark.single_process
def test_the_checks_shrink_bound_is_one_hypothesis_still_reads():
    """The bound is an internal constant of hypothesis': an upgrade that renames it must fail here, not
    leave a learner waiting 300 s for each smallest case."""
    import inspect

    from hypothesis.internal.conjecture import engine
    saved = engine.MAX_SHRINKING_SECONDS
    try:
        grading.pytest_configure(SimpleNamespace(args=[]))
        assert engine.MAX_SHRINKING_SECONDS == grading.SHRINK_S == 10
    finally:
        engine.MAX_SHRINKING_SECONDS = saved
    source = inspect.getsource(engine)
    reads = re.findall(r"^(?!\s*#)(?!MAX_SHRINKING_SECONDS\b).*\bMAX_SHRINKING_SECONDS\b", source, re.M)
    assert reads, "hypothesis no longer reads MAX_SHRINKING_SECONDS: bound the check's shrinking another way"


def logical(lines: list[str]) -> list[str]:
    """The report's lines with their wrapped continuations joined."""
    joined = []
    for line in lines:
        if line.startswith("        ") and joined:
            joined[-1] += " " + line.strip()
        else:
            joined.append(line)
    return joined


def frame(workspace, line, function, code):
    return [f'  File "{workspace}/ring_allreduce.py", line {line}, in {function}', f"    {code}"]


@pytest.mark.single_process
def test_the_report_names_the_rank_whose_own_error_came_first_and_where_only_the_waiting_ranks_waited(
        monkeypatch, tmp_path):
    """Rank 1 raised (the cause); rank 0 then timed out in its send to rank 1, and rank 2 lost rank 0. The
    learner reads rank 1's error and where it raised, and a line for each rank that waited."""
    monkeypatch.setattr(grading, "EXERCISE", f"{tmp_path}/ring_allreduce.py")
    monkeypatch.setattr(grading, "MODULE", "ring_allreduce")
    at = frame(tmp_path, 83, "textbook_reduce_scatter_steps", "send_recv(send, left, incoming, right)")
    lines, line = grading.failure_lines("RankFailure", "\n".join([
        "prop failed on 3 ranks:",
        "rank 0 failed: RuntimeError: [../gloo/pair.cc:81] Timed out waiting 10000ms for send operation", *at,
        "rank 1 failed: Disagreement: rank 1 sends 0 elements to rank 2, which expects 1 (off by one?)", *at,
        "rank 2 failed: PeerLost: all-gather: waited for rank 0 until the group's timeout (Timed out)", *at]), [])
    lines = logical(lines)
    assert lines[0] == ("      yours: rank 1: Disagreement: rank 1 sends 0 elements to rank 2, which expects 1 "
                        "(off by one?)") and line == 83
    assert [x.split(" at ")[0].strip() for x in lines[1:]] == ["rank 0 waited", "rank 1 raised",
                                                               "rank 2 waited for rank 0"]
    lines, line = grading.failure_lines("RankFailure", "\n".join([  # every rank waited: the first timeout
        "prop failed on 3 ranks:",
        "rank 0 failed: RuntimeError: Connection closed by peer [127.0.0.1]:5530", *at,
        "rank 1 failed: PeerLost: recv from rank 0 timed out (Timed out waiting 10000ms)", *at,
        "rank 2: no answer (hung, or blocked waiting for a failed rank)"]), [])
    lines = logical(lines)
    assert lines[0] == "      yours: rank 1: PeerLost: recv from rank 0 timed out (Timed out waiting 10000ms)"
    assert [x.split(" at ")[0].strip() for x in lines[1:]] == ["rank 0 waited", "rank 1 waited for rank 0"]
    assert line == 83  # no rank raised: the hint is for the function where the first rank waited


@pytest.mark.single_process
def test_the_report_is_never_cut_and_its_smallest_case_has_no_comments(monkeypatch):
    """Every word of a long message and of the smallest case appears, wrapped, none cut mid-value; hypothesis'
    '# or any other generated value' comments do not."""
    monkeypatch.setattr(grading, "MODULE", "comm")
    long = "rank 0 element 7: got " + ", ".join(f"{k}.125" for k in range(60))
    lines, _ = grading.failure_lines("AssertionError", f"{long}\n  mistake in f: m: it\nassert False", [
        "Falsifying example: test_x(\n    op='sum',\n    world=2,  # or any other generated value\n"
        f"    shape={tuple(range(40))},\n)", "Draw 1: torch.float16  # or any other generated value"])
    text = " ".join(" ".join(lines).split())
    assert long in text and "mistake in f: m: it" in text and "assert" not in text
    assert f"smallest case: op='sum', world=2, shape={tuple(range(40))}; Draw 1: torch.float16" in text
    assert "#" not in text and all(len(x) <= grading.WIDTH for x in lines)
    lines, _ = grading.failure_lines("AssertionError", "wrong", [  # a value hypothesis wrote over several lines
        "Failing test case: test_x(\n    # The test always failed when commented parts were varied together.\n"
        "    T_world=(\n        2,\n        2,  # or any other generated value\n    ),\n    one=(\n        3,\n"
        "    ),\n    b=1,  # or any other generated value\n)", "Draw 1 (parts): (\n    1,  # or any other generated "
        "value\n    2,\n)"])
    assert "smallest case: T_world=(2, 2), one=(3,), b=1; Draw 1 (parts): (1, 2)" in " ".join(" ".join(lines).split())


@pytest.mark.single_process
def test_an_explicit_example_that_fails_is_the_smallest_case():
    """A property's @example fails before hypothesis draws anything: its note says 'Failing explicit example'
    (older hypothesis: 'Falsifying explicit example'), and the report shows it as the smallest case."""
    for words in ("Failing explicit example", "Falsifying explicit example"):
        case = f"{words}: test_x(\n    depth=2,\n    p=0.3,  # dropout\n)"
        assert grading.smallest_case([case]) == "depth=2, p=0.3", words


@pytest.mark.single_process
def test_a_parametrized_propertys_lines_tell_its_cases_apart():
    def prop():
        """holds the contract

        details"""
    items = [SimpleNamespace(nodeid=f"t.py::test_p[{op}]", name=f"test_p[{op}]", function=prop,
                             callspec=SimpleNamespace(params={"op": op}), get_closest_marker=lambda name: None)
             for op in ("sum", "max")]
    grading.pytest_collection_modifyitems(items)
    assert [grading.MEANINGS[i.nodeid][:2] for i in items] == [("holds the contract", "op=sum"),
                                                                ("holds the contract", "op=max")]


# ----- the banks: every exercise brought up to the contract proves its grading with solutions

def declared_in(path) -> dict:
    return getattr(importlib.import_module(os.path.basename(path)[:-3]), "MISTAKES", {})


def mistakes_of(module) -> dict:
    """The mistakes the module's test files declare in its functions (a file that grades two exercises, as
    test_checkpoint.py grades checkpoint and reshard, declares the other's too)."""
    found = {}
    for path in exercise.test_files(module):
        found.update(declared_in(path))
    every = {f for m in BANKS if set(exercise.test_files(m)) & set(exercise.test_files(module))
             for f in blanked_functions(m)}
    assert all(f in every for f, _ in found.values()), f"{module}: a mistake names a function with no blank"
    return {name: (f, advice) for name, (f, advice) in found.items() if f in blanked_functions(module)}


@pytest.mark.single_process
@pytest.mark.parametrize("module", BANKS)
def test_a_bank_has_hints_for_every_blank_two_right_solutions_and_a_wrong_one_for_every_declared_mistake(module):
    functions = blanked_functions(module)
    hints = exercise.hints(module)
    assert sorted(hints) == sorted(set(functions)), f"{module}: HINTS for {sorted(hints)}, blanks in {functions}"
    assert all(2 <= len(h) <= 3 for h in hints.values()), f"{module}: 2 or 3 hints per function"
    wrong = bank(module).WRONG
    assert len(bank(module).RIGHT) >= 2 and len(wrong) >= 3, f"{module}: at least 2 right and 3 wrong solutions"
    declared = mistakes_of(module)
    made = {name for name, _ in wrong.values()}
    assert made <= set(declared), f"{module}: wrong solutions name undeclared mistakes {made - set(declared)}"
    assert set(declared) <= made, f"{module}: no wrong solution makes {set(declared) - made}: add one, or drop it"
    assert all(f in functions for f, _ in declared.values()), f"{module}: a mistake names a function with no blank"


def function_node(tree, qualified: str):
    """The definition of "Class.method" or "function" in a module's tree."""
    node = tree
    for name in qualified.split("."):
        node = next(n for n in node.body if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name == name)
    return node


def names_unknown(source: str, function: str, known: set) -> set:
    """Names a filled function reads that are neither its own, nor its module's, nor builtins."""
    node = function_node(ast.parse(source), function)
    own = {n.arg for n in ast.walk(node) if isinstance(n, ast.arg)} | {  # its own and its inner functions' too
        n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)} | {
        n.name for n in ast.walk(node) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    read = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return read - own - known - set(dir(builtins))


@pytest.mark.single_process
@pytest.mark.parametrize("module", BANKS)
def test_every_bank_solution_fills_blanks_of_its_exercise_and_reads_only_names_the_module_has(module):
    """A solution that names a function without a blank, or a helper its module no longer imports (the module was
    re-laid), fails here, before any check runs it."""
    blank = exercise.blank(exercise.reference(module), module)
    known = set(vars(importlib.import_module(f"mini_dist.{module}")))
    entries = {**bank(module).RIGHT, **{what: bodies for what, (_, bodies) in bank(module).WRONG.items()}}
    for what, bodies in entries.items():
        filled = exercise.fill(blank, module, bodies)
        compile(filled, f"{module}: {what}", "exec")
        for function in bodies:
            assert not names_unknown(filled, function, known), (module, what, function)


# ----- slow: check itself, in a pytest of its own

def check(module, workspace, source, every=False):
    os.makedirs(workspace, exist_ok=True)
    with open(os.path.join(workspace, f"{module}.py"), "w") as f:
        f.write(source)
    args = [sys.executable, os.path.join(ROOT, "mini_dist", "kit", "exercise.py"), "check", module,
            "--workspace", str(workspace), *(["--every"] if every else [])]
    env = {k: v for k, v in os.environ.items() if k != "HYPOTHESIS_PROFILE"}
    result = command(args, timeout=300, cwd=ROOT, env=env)
    return result.returncode, result.stdout + result.stderr


PLANTED = {  # module: (the reference's text, the classic mistake, a word the failing property's line says)
    "reducer": ("torch.mul(p.grad, 1.0 / self.world, out=bucket.views[i])", "bucket.views[i].copy_(p.grad)", "FAIL"),
    "fsdp": ('self._before_compute(unit, "backward", self._finished[::-1])', "pass", "FAIL"),
    "pipeline_schedules": ("min(P - s - 1, M)", "min(P - s, M)", "FAIL"),
    # the receive one chunk off: on uneven chunks the pieces differ in size, named by both ends at once
    "ring_allreduce": ("send, mine = chunks[(r + 1 + s) % n], chunks[(r + 2 + s) % n]",
                       "send, mine = chunks[(r + 1 + s) % n], chunks[(r + 1 + s) % n]", "a chunk index off by one"),
}


@pytest.mark.slow
def test_a_fresh_exercise_fails_every_property_with_its_contract_and_the_reference_passes(tmp_path):
    source = exercise.reference("ring_allreduce")
    code, out = check("ring_allreduce", tmp_path / "fresh", exercise.blank(source, "ring_allreduce"), every=True)
    verdicts = [line for line in out.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert code == 1 and len(verdicts) == 11 and all(v.startswith("FAIL") for v in verdicts), out  # 5 + 5 ops + 1
    assert out.count("NotImplementedError: ring_allreduce: write textbook_") == 11, out
    assert "waited at" not in out and "./run.sh hint ring_allreduce (0 of 3 seen)" in out, out
    code, out = check("ring_allreduce", tmp_path / "reference", source)
    assert code == 0 and "PASS" in out and "FAIL" not in out and "note" not in out, out
    assert all(f"[op={op}]" in out for op in ("sum", "avg", "max", "min", "product")), out


@pytest.mark.slow
@pytest.mark.parametrize("module, function", [("tensor_parallel", "column_parallel_linear"),
                                              ("context_parallel", "merge"),
                                              ("pipeline_schedules", "one_f_one_b_stage")])
def test_a_blank_left_in_place_is_reported_in_its_own_words(module, function, tmp_path):
    """A blank still there says what to write: not where it was raised nor what it was called with, the lines
    that locate an error in the learner's own code."""
    code, out = check(module, tmp_path, exercise.blank(exercise.reference(module), module))
    said = " ".join(out.split())
    assert code == 1 and f"raised NotImplementedError: {module}: write {function}: " in said, out
    assert "called with" not in said and f" at {module}.py:" not in said, out


@pytest.mark.slow
@pytest.mark.parametrize("module", sorted(PLANTED))
def test_a_planted_classic_mistake_fails_check(module, tmp_path):
    right, wrong, word = PLANTED[module]
    source = exercise.reference(module)
    assert source.count(right) == 1, f"{module}: the planted line moved; update PLANTED"
    code, out = check(module, tmp_path, source.replace(right, wrong))
    assert code == 1 and word in out, out


@pytest.mark.slow
def test_another_modules_broken_copy_beside_it_is_never_used(tmp_path):
    """tensor_parallel builds on comm: a broken exercises/comm.py left beside a correct tensor_parallel.py stays
    out of its check, which grades tensor_parallel against mini_dist's own comm."""
    (tmp_path / "comm.py").write_text(exercise.blank(exercise.reference("comm"), "comm"))
    code, out = check("tensor_parallel", tmp_path, exercise.reference("tensor_parallel"))
    assert code == 0 and "every property holds" in out, out


@pytest.mark.slow
def test_a_hang_is_named_with_the_line_where_each_rank_waited(tmp_path):
    """Every rank receives first, with blocking calls: each waits for a send that never comes. The check ends
    (the ranks' 10 s timeout) and says where each rank of the learner's code waited."""
    right = 'send_recv(chunks[(r + s) % n], left, chunks[(r + 1 + s) % n], right, group, "all-gather")'
    wrong = ("dist.recv(chunks[(r + 1 + s) % n], group=group, group_src=right)\n"
             "        dist.send(chunks[(r + s) % n], group=group, group_dst=left)")
    source = exercise.reference("ring_allreduce")
    assert source.count(right) == 1, "the planted line moved"
    code, out = check("ring_allreduce", tmp_path, source.replace(right, wrong))
    assert code == 1 and "Timed out" in out, out
    # each rank waits for its right neighbour: a cycle through every rank of the world hypothesis ended with
    # (shrinking stops after 10 s, so not always at the smallest world that hangs, 2 ranks)
    world = int(re.search(r"smallest case: .*\bworld=(\d+)", out).group(1))
    assert "hint: for textbook_all_gather_steps, ./run.sh hint" in out, out
    waits = re.findall(r"rank (\d+) waited for rank (\d+) at ring_allreduce.py:\d+ in textbook_all_gather_steps: "
                       r"dist.recv\(", out)
    assert sorted((int(r), int(s)) for r, s in waits) == [(r, (r + 1) % world) for r in range(world)], out


def entries(kind):
    return [pytest.param(module, what, id=f"{module}: {what}") for module in BANKS for what in getattr(bank(module),
                                                                                                      kind)]


@pytest.mark.slow
@pytest.mark.parametrize("module, what", entries("RIGHT"))
def test_a_right_solution_from_the_bank_passes_check(module, what, tmp_path):
    blank = exercise.blank(exercise.reference(module), module)
    code, out = check(module, tmp_path, exercise.fill(blank, module, bank(module).RIGHT[what]))
    assert code == 0 and f"{module}: every property holds" in out and "FAIL" not in out, out


@pytest.mark.slow
@pytest.mark.parametrize("module, what", entries("WRONG"))
def test_a_wrong_solution_from_the_bank_fails_check_with_its_mistake_named(module, what, tmp_path):
    name, bodies = bank(module).WRONG[what]
    blank = exercise.blank(exercise.reference(module), module)
    code, out = check(module, tmp_path, exercise.fill(blank, module, bodies))
    assert code == 1 and f": {name}: " in " ".join(out.split()), out


def recv_from_a_silent_peer(use_group_src):
    """Rank 0 receives from rank 1, which never sends, in a group with a 1 s timeout; dist.send and dist.recv
    are restored afterwards (the pool's ranks live on)."""
    import datetime

    import torch
    import torch.distributed as dist

    from mini_dist.kit.stand_in import name_peers
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=1))
    real = dist.send, dist.recv
    name_peers()
    try:
        if dist.get_rank() == 0:
            try:
                peer = {"group_src": 1} if use_group_src else {"src": 1}
                dist.recv(torch.zeros(1, device=device()), group=group, **peer)
            except Exception as e:
                return f"{type(e).__name__}: {e}"
        return None
    finally:
        dist.send, dist.recv = real


@pytest.mark.single_process
def test_a_learners_blocking_call_whose_peer_left_names_that_peer(monkeypatch):
    """A peer that timed out first, or failed, closes its end: gloo says "Connection closed by peer" and names
    no rank, so the check names the one this rank waited for. Any other error is the learner's own, untouched."""
    import torch
    import torch.distributed as dist

    from mini_dist.kit.debug import PeerLost
    from mini_dist.kit.stand_in import name_peers

    def closed(tensor, *args, **kwargs):
        raise RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:5530")

    def mismatched(tensor, *args, **kwargs):
        raise RuntimeError("the sizes do not match")
    monkeypatch.setattr(dist, "recv", closed)
    monkeypatch.setattr(dist, "send", mismatched)
    name_peers()
    with pytest.raises(PeerLost, match=r"^recv from rank 1 failed \(\[\S+\] Connection closed by peer "
                                       r"\[127.0.0.1\]:5530\): rank 1 left while this rank waited for it; its own "
                                       r"error says why$"):
        dist.recv(torch.zeros(1, device="cpu"), src=1)  # never sent: the stand-ins raise
    with pytest.raises(RuntimeError, match="^the sizes do not match$"):
        dist.send(torch.zeros(1, device="cpu"), 2)


@pytest.mark.parametrize("use_group_src", [False, True])
def test_a_learners_blocking_recv_that_times_out_names_the_rank_it_waited_for(use_group_src):
    said, nothing = run(2, recv_from_a_silent_peer, use_group_src)
    assert nothing is None and said.startswith("PeerLost: recv from rank 1 timed out ("), said
    assert "rank 1 never posted the matching send" in said, said
