"""The exercise machinery: blanking is faithful, a learner's work is never overwritten, and grading can fail.

Single process (cheap): every marked region is closed; blanking keeps every function and class (and their
docstrings) and replaces each region by one NotImplementedError that says what to write; the copy compiles;
`write` refuses to overwrite work in progress unless forced. Slow (each `check` starts ranks in a pytest of
its own): a fresh exercise fails, the reference copied into the workspace passes, and each classic mistake
planted in the reference fails `check`.
"""
import ast
import os
import re
import sys
from types import SimpleNamespace

import pytest

from harness import command, device, run
from mini_dist.kit import exercise

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def definitions(source: str) -> dict:
    """name -> docstring of every function and class in the source."""
    return {n.name: ast.get_docstring(n) for n in ast.walk(ast.parse(source))
            if isinstance(n, (ast.FunctionDef, ast.ClassDef))}


@pytest.mark.single_process
def test_there_are_at_least_ten_exercises_and_each_blank_keeps_every_signature_and_docstring():
    modules = exercise.exercises()
    assert len(modules) >= 10, modules
    for module in modules:
        source = exercise.reference(module)
        blank = exercise.blank(source, module)
        assert definitions(blank) == definitions(source), module
        assert blank.count("raise NotImplementedError(") - source.count("raise NotImplementedError(") == len(
            exercise.regions(source)), module
        assert "# exercise:" not in blank and "# end exercise" not in blank


@pytest.mark.single_process
def test_every_exercise_is_graded_by_marked_properties_in_files_that_exist():
    for module in exercise.exercises():
        files = exercise.test_files(module)
        assert all(os.path.exists(f) for f in files), (module, files)
        assert any("@pytest.mark.exercise" in open(f).read() for f in files), module


def test_an_unclosed_region_is_refused_with_its_line():
    with pytest.raises(ValueError, match="line 2 has no '# end exercise'"):
        exercise.regions("def f():\n    # exercise: write it\n    return 1\n")


@pytest.mark.single_process
def test_write_refuses_to_overwrite_work_in_progress_unless_forced(tmp_path):
    path = exercise.write("ring_allreduce", workspace=str(tmp_path))
    assert exercise.write("ring_allreduce", workspace=str(tmp_path)) == path  # a fresh copy: nothing lost
    with open(path, "a") as f:
        f.write("# my work\n")
    with pytest.raises(SystemExit, match="holds your work in progress"):
        exercise.write("ring_allreduce", workspace=str(tmp_path))
    exercise.write("ring_allreduce", force=True, workspace=str(tmp_path))
    assert "# my work" not in open(path).read()


@pytest.mark.single_process
def test_the_checks_shrink_bound_is_one_hypothesis_still_reads():
    """The bound is an internal constant of hypothesis': an upgrade that renames it must fail here, not
    leave a learner waiting 300 s for each smallest case."""
    import inspect

    from hypothesis.internal.conjecture import engine
    saved = engine.MAX_SHRINKING_SECONDS
    try:
        exercise.pytest_configure(None)
        assert engine.MAX_SHRINKING_SECONDS == exercise.SHRINK_S == 10
    finally:
        engine.MAX_SHRINKING_SECONDS = saved
    source = inspect.getsource(engine)
    reads = re.findall(r"^(?!\s*#)(?!MAX_SHRINKING_SECONDS\b).*\bMAX_SHRINKING_SECONDS\b", source, re.M)
    assert reads, "hypothesis no longer reads MAX_SHRINKING_SECONDS: bound the check's shrinking another way"


def failing(lines: list[str]) -> SimpleNamespace:
    """A failed property's report as pytest hands it to the check's plugin: the pool's RankFailure."""
    return SimpleNamespace(when="call", nodeid="tests/test_ring_allreduce.py::test_x", passed=False,
                           longreprtext="\n".join(["E   mini_dist.kit.ranks.RankFailure: prop failed on 3 ranks:",
                                                   *[f"E   {line}" for line in lines]]))


def frame(workspace, line, function, code):
    return [f'  File "{workspace}/ring_allreduce.py", line {line}, in {function}', f"    {code}"]


@pytest.mark.single_process
def test_the_report_names_the_rank_whose_own_error_came_first_and_where_only_the_waiting_ranks_waited(
        monkeypatch, capsys, tmp_path):
    """Rank 1 raised (the cause); rank 0 then timed out in its send to rank 1, and rank 2 lost rank 0. The
    learner reads rank 1's error, and a hang line for each rank that waited (not for rank 1, which raised)."""
    monkeypatch.setenv("MINI_DIST_EXERCISES", str(tmp_path))
    at = frame(tmp_path, 83, "textbook_reduce_scatter_steps", "send_recv(send, left, incoming, right)")
    exercise.pytest_runtest_logreport(failing([
        "rank 0 failed: RuntimeError: [../gloo/pair.cc:81] Timed out waiting 10000ms for send operation", *at,
        "rank 1 failed: Disagreement: rank 1 sends 0 elements to rank 2, which expects 1 (off by one?)", *at,
        "rank 2 failed: PeerLost: all-gather: waited for rank 0 until the group's timeout (Timed out)", *at]))
    out = capsys.readouterr().out.splitlines()
    assert out[1] == ("      yours: rank 1: Disagreement: rank 1 sends 0 elements to rank 2, which expects 1 "
                      "(off by one?)")
    assert [line.split(" at ")[0].strip() for line in out[2:]] == ["rank 0 waited", "rank 2 waited for rank 0"]
    exercise.pytest_runtest_logreport(failing([  # every rank waited: the first timeout, not the closed connection
        "rank 0 failed: RuntimeError: Connection closed by peer [127.0.0.1]:5530", *at,
        "rank 1 failed: PeerLost: recv from rank 0 timed out (Timed out waiting 10000ms)", *at,
        "rank 2: no answer (hung, or blocked waiting for a failed rank)"]))
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "      yours: rank 1: PeerLost: recv from rank 0 timed out (Timed out waiting 10000ms)"
    assert [line.split(" at ")[0].strip() for line in out[2:]] == ["rank 0 waited", "rank 1 waited for rank 0"]


def check(module, workspace, source, every=False):
    os.makedirs(workspace, exist_ok=True)
    with open(os.path.join(workspace, f"{module}.py"), "w") as f:
        f.write(source)
    code = (f"import sys; sys.path.insert(0, {ROOT!r}); from mini_dist.kit import exercise; "
            f"raise SystemExit(exercise.check({module!r}, {str(workspace)!r}, demo=False, every={every}))")
    result = command([sys.executable, "-c", code], timeout=300, cwd=ROOT,
                     env={k: v for k, v in os.environ.items() if k != "HYPOTHESIS_PROFILE"})
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
def test_a_fresh_exercise_fails_and_the_reference_passes(tmp_path):
    source = exercise.reference("ring_allreduce")
    code, out = check("ring_allreduce", tmp_path / "fresh", exercise.blank(source, "ring_allreduce"), every=True)
    verdicts = [line for line in out.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert code == 1 and len(verdicts) == 11 and all(v.startswith("FAIL") for v in verdicts), out  # 5 + 5 ops + 1
    assert out.count("NotImplementedError: ring_allreduce: write N-1 steps") == 11, out
    assert "waited at" not in out, out  # an error, not a hang: no rank waited
    code, out = check("ring_allreduce", tmp_path / "reference", source)
    assert code == 0 and "PASS" in out and "FAIL" not in out, out


@pytest.mark.slow
@pytest.mark.parametrize("module", sorted(PLANTED))
def test_a_planted_classic_mistake_fails_check(module, tmp_path):
    right, wrong, word = PLANTED[module]
    source = exercise.reference(module)
    assert source.count(right) == 1, f"{module}: the planted line moved; update PLANTED"
    code, out = check(module, tmp_path, source.replace(right, wrong))
    assert code == 1 and word in out, out


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
    waits = re.findall(r"rank (\d+) waited for rank (\d+) at ring_allreduce.py:\d+ in textbook_all_gather_steps: "
                       r"dist.recv\(", out)
    assert sorted((int(r), int(s)) for r, s in waits) == [(r, (r + 1) % world) for r in range(world)], out


def recv_from_a_silent_peer(use_group_src):
    """Rank 0 receives from rank 1, which never sends, in a group with a 1 s timeout; dist.send and dist.recv
    are restored afterwards (the pool's ranks live on)."""
    import datetime

    import torch
    import torch.distributed as dist
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=1))
    real = dist.send, dist.recv
    exercise.name_peers()
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


@pytest.mark.parametrize("use_group_src", [False, True])
def test_a_learners_blocking_recv_that_times_out_names_the_rank_it_waited_for(use_group_src):
    said, nothing = run(2, recv_from_a_silent_peer, use_group_src)
    assert nothing is None and said.startswith("PeerLost: recv from rank 1 timed out ("), said
    assert "rank 1 never posted the matching send" in said, said
