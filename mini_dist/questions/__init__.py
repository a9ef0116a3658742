"""Questions learners ask about distributed training, each answered by a number measured on the spot.

The questions and their answers are text: mini_dist/questions/questions.md, one section each, naming the demo
that shows the whole story and the measure that settles it: a function that returns the figure, either the
concept's own (the same one its demo calls to print that figure) or, for a figure that is not the demo's
own, one in this package, a file per part of the reading order (mini_dist/questions/<part>.py), so that the
concept's file holds only the concept. A measure returns the figure it
prints and whether it holds (the assertion the demo makes). One that needs several ranks runs on a pool of
RANKS gloo ranks (mini_dist/kit/ranks.py, the test suite's runner), started on the first such question.

    python -m mini_dist.questions                 # list the questions (at once: nothing is measured)
    python -m mini_dist.questions 7 14            # measure them, each as soon as it is ready
    python -m mini_dist.questions --all           # measure every one
    python -m mini_dist.questions --markdown      # the page: question, answer, command, figure measured now
    ./run.sh ask [N ...]                          # the same, through run.sh

tests/test_questions.py runs every measure, so an answer's number cannot drift from the code.
"""
import atexit
import importlib
import os
import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

from mini_dist.kit import launch

RANKS = 4                # the group every multi-rank question runs on
QUESTION_TIMEOUT_S = 90  # a question that takes longer is reported, not waited for
PAGE = Path(__file__).with_name("questions.md")


@dataclass(frozen=True)
class Question:
    number: int
    question: str
    answer: str
    command: str   # the demo that shows it in full
    measure: str   # "module.function" (kit modules as "kit.debug.function"), run on every rank of the group
    ranks: int = 1


def read(text: str) -> dict[int, Question]:
    """questions.md -> {number: Question}. A section: '## N. question', 'demo: ...', 'measure: module.f on R
    ranks', then the answer's paragraph."""
    found = {}
    for block in re.split(r"^## ", text, flags=re.M)[1:]:
        head, *rest = block.strip().split("\n")
        number, question = head.split(". ", 1)
        fields = dict(line.split(": ", 1) for line in rest if re.match(r"^(demo|measure): ", line))
        measure, ranks = re.fullmatch(r"([\w.]+) on (\d+) ranks?", fields["measure"]).groups()
        answer = " ".join(line for line in rest if line and not re.match(r"^(demo|measure): ", line))
        found[int(number)] = Question(int(number), question.strip(), answer, fields["demo"], measure, int(ranks))
    return found


QUESTIONS = read(PAGE.read_text())


def measure(number: int) -> tuple[str, bool]:
    """Question `number`'s figure and whether it holds, on this rank (every rank of its group calls this)."""
    module, function = QUESTIONS[number].measure.rsplit(".", 1)
    figure, holds = getattr(importlib.import_module(f"mini_dist.{module}"), function)()
    return figure, bool(holds)


def combine(replies: list) -> tuple[str, bool]:
    """Every rank's (figure, holds) -> rank 0's figure, and whether it held on every rank."""
    return replies[0][0], all(holds for _, holds in replies)


class Ranks:
    """The pool of RANKS ranks, started on the first question that needs them and kept for the next."""

    def __init__(self):
        self.pool = None

    def ask(self, number: int) -> list:
        from mini_dist.kit.ranks import Pool
        if self.pool is None:
            self.pool = Pool(RANKS, os.environ.get("MINI_DIST_BACKEND", "gloo"), ["mini_dist.questions"])
        return self.pool.run(measure, number, timeout=QUESTION_TIMEOUT_S)

    def stop(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None


def ask(number: int, ranks: Ranks) -> tuple[str, bool]:
    """Measure question `number`: in this process, or on the ranks. A failure is a figure that does not hold."""
    try:
        return combine(ranks.ask(number)) if QUESTIONS[number].ranks > 1 else measure(number)
    except Exception as e:  # noqa: BLE001  a measure that raises is reported as a figure that does not hold
        return f"could not measure: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", False


def wrap(text: str, indent: str = "   ") -> str:
    return textwrap.fill(text, 112, initial_indent=indent, subsequent_indent=indent)


def escape(text: str) -> str:
    """Text as markdown shows it literally: no emphasis from * and _, no tags from <."""
    return text.replace("*", r"\*").replace("_", r"\_").replace("<", "&lt;")


def page(figures: dict) -> str:
    """The markdown page: every question in `figures` ({number: figure}) with its answer and command."""
    out = ["## Questions answered by measurement", "",
           "Each question below has a short answer and the figure that settles it, measured by the modules' own "
           f"functions when this page was printed (`./run.sh ask --markdown`, {RANKS} gloo ranks on the CPU); "
           "`./run.sh ask N` measures question N again, and the demo named with it shows the whole story.", ""]
    for number, figure in sorted(figures.items()):
        q = QUESTIONS[number]
        out += [f"### {number}. {q.question}", "", escape(q.answer), "",
                f"Shown in full by `{q.command}`. Measured (`./run.sh ask {number}`): {escape(figure)}", ""]
    return "\n".join(out)


def parser():
    p = launch.demo_parser(__doc__)
    p.prog = "./run.sh ask"
    p.add_argument("numbers", type=int, nargs="*", help="questions to measure (none: list them)")
    p.add_argument("--all", action="store_true", help="measure every question")
    p.add_argument("--markdown", action="store_true", help="measure, then print the page in markdown")
    return p


def demo(args) -> int:
    launch.require(launch.env_world_size() == 1, "run it as python -m mini_dist.questions (or ./run.sh ask): it "
                                                 f"starts its own {RANKS} ranks, not under torchrun")
    unknown = [n for n in args.numbers if n not in QUESTIONS]
    launch.require(not unknown, f"no question {', '.join(map(str, unknown))}: choose from 1 to {len(QUESTIONS)}")
    numbers = args.numbers or (sorted(QUESTIONS) if args.all or args.markdown else [])
    if not numbers:
        print("\n".join(f"{n:>3}. {q.question}" for n, q in QUESTIONS.items()))
        print(f"\n./run.sh ask N [N ...] measures the figure that answers question N ({RANKS} ranks where needed)")
        return 0
    ranks = Ranks()
    figures = {}
    failed = []
    atexit.register(ranks.stop)
    for i, n in enumerate(numbers, 1):
        q = QUESTIONS[n]
        if args.markdown:
            print(f"measuring {i} of {len(numbers)}: question {n}", file=sys.stderr, flush=True)
        else:
            print(f"{n}. {q.question}\n{wrap(q.answer)}\n   shown in full by: {q.command}\n   measuring "
                  f"({'on ' + str(RANKS) + ' ranks' if q.ranks > 1 else 'in this process'}) ...", flush=True)
        figures[n], holds = ask(n, ranks)
        if not holds:
            failed.append(n)
        if not args.markdown:
            print(f"{wrap(('measured: ' if holds else 'OFF: ') + figures[n])}\n", flush=True)
    ranks.stop()
    if args.markdown:
        print(page(figures))
    if failed:
        print(f"figures off: questions {', '.join(map(str, failed))}", file=sys.stderr)
    return 1 if failed else 0

