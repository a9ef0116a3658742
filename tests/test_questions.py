"""The questions page cannot drift from the code: every answer's figure is measured and asserted here.

Each question's measure runs as `./run.sh ask N` runs it (on the rank pool of the harness when it needs
ranks, in this process when not) and must hold: the same assertion its demo makes. Then the command line
itself: `./run.sh ask` for a question with ranks and one without prints the answer and the measured figure,
an unknown question is one line and exit status 2, a figure that does not hold (or a measure that raises) is
exit status 1, a rank pool that fails or runs out of time is reported rather than waited for, and the
markdown page lists every question with its command.
"""
import importlib
import os

import pytest

from harness import command, run
from mini_dist import questions
from mini_dist.kit import launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("number", sorted(questions.QUESTIONS))
def test_every_answer_holds_its_figure(number):
    q = questions.QUESTIONS[number]
    replies = run(q.ranks, questions.measure, number) if q.ranks > 1 else [questions.measure(number)]
    figure, holds = questions.combine(replies)
    assert holds, f"question {number}: {figure}"
    assert any(c.isdigit() for c in figure), figure


def test_the_questions_are_numbered_1_to_n_and_each_names_a_demo_that_exists():
    assert sorted(questions.QUESTIONS) == list(range(1, len(questions.QUESTIONS) + 1))
    assert len(questions.QUESTIONS) >= 28
    for q in questions.QUESTIONS.values():
        words = q.command.split()
        assert words[:2] == ["./run.sh", "demo"] and os.path.exists(os.path.join(ROOT, "mini_dist", f"{words[2]}.py"))
        module, function = q.measure.rsplit(".", 1)
        assert callable(getattr(importlib.import_module(f"mini_dist.{module}"), function)), q.measure
        assert 50 <= len(q.answer.split()) <= 120, (q.number, q.answer)  # a few sentences, not an essay


def run_sh(*args):
    environment = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                  "MASTER_PORT", "MASTER_ADDR")}
    return command([os.path.join(ROOT, "run.sh"), "ask", *args], env=environment)


def test_run_sh_ask_prints_each_answer_and_its_measured_figure():
    result = run_sh("14", "4")  # one question in this process, one on the ranks
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert out.index("14. GPipe vs 1F1B") < out.index("4. What does each rank hold")
    assert "(P-1)/(M+P-1) = 0.273" in out and "[10, 20, 30, 40] on every rank" in out.replace("\n   ", " ")
    assert out.count("   measured: ") == 2 and "shown in full by: ./run.sh demo pipeline_bubble" in out
    assert "Warning" not in result.stderr, result.stderr


def test_an_unknown_question_is_one_line_and_exit_status_2():
    result = run_sh("99")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("./run.sh ask: error: no question 99") and str(len(questions.QUESTIONS)) in lines[0]


def command_line(argv, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    return launch.main(questions.parser(), questions.demo, argv)


def test_without_a_number_every_question_is_listed(monkeypatch, capsys):
    assert command_line([], monkeypatch) == 0
    out = capsys.readouterr().out
    for n, q in questions.QUESTIONS.items():
        assert f"{n:>3}. {q.question}" in out


def test_a_figure_that_does_not_hold_or_a_measure_that_fails_is_exit_status_1(monkeypatch, capsys):
    real = questions.measure
    monkeypatch.setattr(questions, "measure", lambda n: ("0.5", False) if n == 14 else real(n))
    assert command_line(["14"], monkeypatch) == 1
    assert "OFF: 0.5" in capsys.readouterr().out

    def broken(n):
        if n == 14:
            raise ZeroDivisionError("a formula divides by zero")
        return real(n)
    monkeypatch.setattr(questions, "measure", broken)
    assert command_line(["14", "15"], monkeypatch) == 1
    captured = capsys.readouterr()
    assert "could not measure: ZeroDivisionError: a formula divides by zero" in captured.out
    assert "measured: " in captured.out and "figures off: questions 14" in captured.err


def test_ranks_that_fail_or_run_out_of_time_are_reported_not_waited_for(monkeypatch):
    ranks = questions.Ranks()
    try:
        with pytest.raises(RuntimeError, match="rank 0 failed: KeyError: 99"):
            ranks.ask(99)  # every rank raises: a number with no question
        monkeypatch.setattr(questions, "QUESTION_TIMEOUT_S", 0.01)
        with pytest.raises(RuntimeError, match="rank 0: no answer"):
            ranks.ask(4)
        monkeypatch.setattr(questions, "QUESTION_TIMEOUT_S", 90)
        figure, holds = questions.combine(ranks.ask(4))  # the pool started afresh and answers
        assert holds, figure
    finally:
        ranks.stop()


def test_the_markdown_page_lists_every_question_with_its_answer_command_and_figure(monkeypatch, capsys):
    page = questions.page({n: f"figure {n} of 2(N-1)/N*D" for n in questions.QUESTIONS})
    for n, q in questions.QUESTIONS.items():
        assert f"### {n}. {q.question}" in page
        assert f"Shown in full by `{q.command}`. Measured (`./run.sh ask {n}`): figure {n} of 2(N-1)/N\\*D" in page
    assert command_line(["--markdown", "15"], monkeypatch) == 0
    out = capsys.readouterr().out
    assert out.startswith("## Questions answered by measurement") and "### 15. How much do interleaving" in out
    assert "interleaved v = 2 0.158 (0.158)" in out and "### 14." not in out
