"""The grader: the pytest plugin `./run.sh check MODULE` loads (-p grading), and what properties use to teach.

In a check (MINI_DIST_EXERCISE names the learner's file) it prints one line per property as it is decided,
"PASS  <the contract it judges> [its parameters]" or "FAIL  ..." followed by what differed (whole, wrapped),
the mistake where one was recognised, where in the learner's file a rank raised or waited, and the smallest
case hypothesis found; then "@region FUNCTION" for the hints (kit/exercise.py reads it). When every property
passed, the module's demo runs from the learner's copy on the ranks that ran the properties.

Properties use, in the suite and in a check alike:
    optional(ok, claim, found, why)       a claim stricter than the contract (bit-identical to gloo): asserted
                                          in the suite, a "note" line in a check, never the verdict
    mistake(MISTAKES, name, evidence)     the line that names a classic mistake: MISTAKES[name] is
                                          (the function it is in, what to change), declared by the test file
"""
import io
import os
import re
import sys
import textwrap
import threading

import pytest

EXERCISE = os.environ.get("MINI_DIST_EXERCISE")  # the learner's file under check; None in the suite
MODULE = os.path.splitext(os.path.basename(EXERCISE))[0] if EXERCISE else None
SHRINK_S = 10  # a learner waits for the answer: shrinking stops after this long (hypothesis' own limit: 300 s)
WIDTH = 116
NOTES: dict = {}  # property -> the first note it made
NOTED: set = set()  # properties whose note was printed (once per property, not once per parameter)
CURRENT = [None]  # the property running now
MEANINGS: dict = {}  # nodeid -> (the contract it judges, [parameters], the functions it judges)
WAITED = r"|waited for rank|lost rank|no answer"  # beside debug.TIMED_OUT's and debug.LEFT's words


def optional(ok: bool, claim: str, found: str, why: str) -> None:
    """mini_dist's own claim, stricter than the exercise's contract: asserted in the suite, noted in a check."""
    if ok:
        return
    said = f"{claim}: no ({found}); {why}"
    if not EXERCISE:
        raise AssertionError(said)
    NOTES.setdefault(CURRENT[0], said)


def mistake(mistakes: dict, name: str, evidence: str, where: str | None = None) -> str:
    """'mistake in FUNCTION: NAME: evidence; what to change': the line a check prints under a failure. `where`:
    another function than the one MISTAKES names, where the same mistake can be made in several."""
    function, advice = mistakes[name]
    return f"mistake in {where or function}: {name}: {evidence}; {advice}"


# ----- the report: pure functions of what a failure said

def wrapped(label: str, text: str, verdict: str = "") -> list[str]:
    """`      label text` (or `FAIL  label text`), wrapped to the page, never cut: continuation lines align under
    the text (two spaces in, without a label)."""
    first = f"{verdict:<6}{label}"
    return textwrap.wrap(text, WIDTH, initial_indent=first, subsequent_indent=" " * max(len(first), 8),
                         break_long_words=False, break_on_hyphens=False) or [first.rstrip()]


def smallest_case(notes: list[str]) -> str | None:
    """Hypothesis's failing example, whole, on one logical line: its arguments and draws, without its comments."""
    case = next((n for n in notes if n.startswith(("Falsifying example", "Failing test case",
                                                  "Falsifying explicit example", "Failing explicit example"))), None)
    if case is None:
        return None
    args = one_line(case.splitlines()[1:-1]).rstrip(",")
    draws = [one_line(n.splitlines()) for n in notes if re.match(r"Draw \d+", n)]
    return args + ("; " + "; ".join(draws) if draws else "")


def one_line(lines: list[str]) -> str:
    """Lines of a value hypothesis wrote on several, on one, without their comments."""
    text = " ".join(filter(None, (re.sub(r"\s+#.*$", "", line).strip() for line in lines)))
    text = re.sub(r"([(\[{]) ", r"\1", text)
    return re.sub(r",? ([)\]}])", r"\1", re.sub(r"\(([^(),]*), \)", r"(\1,)", text))


def rank_failure(text: str) -> tuple[str, list[str], int | None]:
    """From a RankFailure's text: the cause (the first rank's own error, not a wait its peers then timed out),
    where each waiting rank waited in the learner's file, and the line of the learner's file the cause raised at
    (when every rank waited, where the first of them waited: the hint is for that function)."""
    from mini_dist.kit.debug import LEFT, TIMED_OUT
    waited = re.compile(TIMED_OUT.pattern + "|" + LEFT.pattern + WAITED)
    said = re.findall(r"^\s*(rank \d+)(?: failed: |: )(.*)$", text, re.M)
    cause = (next((r for r in said if not waited.search(r[1])), None)
             or next((r for r in said if TIMED_OUT.search(r[1])), said[0] if said else ("", text.split("\n")[0])))
    error = re.sub(r"\[\S*\.cc:\d+\] ", "", ": ".join(filter(None, cause)))  # gloo's source line: no help
    blocks = dict(re.findall(r"^\s*rank (\d+)(?: failed|:)(.*?)(?=^\s*rank \d+(?: failed|:)|\Z)", text, re.M | re.S))
    frame = re.compile(r'File "' + re.escape(EXERCISE or "") + r'", line (\d+), in (\w+)\n\s*(.+)')
    where = []
    at = None
    first_wait = None
    hung = any(TIMED_OUT.search(line) for _, line in said)
    for rank, block in blocks.items():
        frames = frame.findall(block)
        if not frames:
            continue
        line, function, code = frames[-1]
        if f"rank {rank}" == cause[0] and not waited.search(block.split("\n", 1)[0]):
            at = int(line)
            if not code.startswith("raise NotImplementedError("):  # a blank: its own words say where
                where.append(f"rank {rank} raised at {MODULE}.py:{line} in {function}: {code.strip()}")
        elif hung and waited.search(block.split("\n", 1)[0]):
            peer = re.search(r"(?:recv from|send to|waited for) (rank \d+|any rank)", block)
            whom = f" for {peer.group(1)}" if peer else ""
            where.append(f"rank {rank} waited{whom} at {MODULE}.py:{line} in {function}: {code.strip()}")
            if first_wait is None:
                first_wait = int(line)
    return error, where, (at if at is not None else first_wait)


def failure_lines(kind: str, message: str, notes: list[str]) -> tuple[list[str], int | None]:
    """What a check prints under a FAIL, and the line of the learner's file the failure points at (if any)."""
    if kind == "RankFailure":
        error, where, at = rank_failure(message)
        said = [error, *dict.fromkeys(re.findall(r"^mistake in .*$", message, re.M))]  # each rank's, said once
    else:
        said = [line.strip() for line in re.split(r"\nassert ", message, maxsplit=1)[0].splitlines() if line.strip()]
        said = said or [kind]
        where = []
        at = None
    out = wrapped("yours: ", said[0])
    for line in said[1:] + where:
        out += wrapped("", line)
    case = smallest_case(notes)
    if case:
        out += wrapped("smallest case: ", case)
    return out, at


def region_of(message: str, at: int | None, judges: tuple) -> str | None:
    """The function a failure points at: a named mistake's, a blank's, the learner's line's, else the first judged
    that the learner's file defines (a property may judge functions of two exercises: checkpoint's and reshard's)."""
    named = re.search(r"mistake in (\S+): ", message) or re.search(rf"{MODULE}: write ([\w.]+): ", message)
    if named:
        return named.group(1)
    from mini_dist.kit.blanks import function_at, functions
    try:
        source = open(EXERCISE).read()
        if at is not None:
            return function_at(source, at)
        defined = {name for _, _, name in functions(source)}
    except SyntaxError:
        return None
    return next((f for f in judges if f in defined), judges[0] if judges else None)


# ----- the plugin's hooks

def pytest_configure(config):
    from hypothesis.internal.conjecture import engine  # an internal constant: without it, shrinking takes longer
    engine.MAX_SHRINKING_SECONDS = SHRINK_S


# ----- a check's time: the ranks' fork server imports torch while this process does, and the pools start together

WARM_WORLDS = range(1, 6)  # the world sizes the properties draw (an unused pool costs its ranks' start)
WARMING: list = []


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config, parser, args):
    """Before this process imports torch (conftest imports harness): the ranks' fork server starts importing
    torch and the test modules (the learner's module with them) beside it, not after it."""
    if EXERCISE:
        import multiprocessing.forkserver
        from multiprocessing import get_context
        tests = [os.path.splitext(os.path.basename(a))[0] for a in args if a.endswith(".py")]
        get_context("forkserver").set_forkserver_preload(["torch", "torch.distributed", "mini_dist.kit.launch",
                                                          "harness", "grading", *tests])
        multiprocessing.forkserver.ensure_running()


def pytest_collection_finish(session):
    """Every pool starts now, side by side (each waits for its ranks to meet), while the first property waits."""
    if EXERCISE and session.items:
        for world in WARM_WORLDS:
            WARMING.append(threading.Thread(target=warm, args=(world,), daemon=True))
            WARMING[-1].start()


def warm(world: int) -> None:
    from harness import RankFailure, run
    try:
        run(world, ready)
    except RankFailure:
        pass  # the first property that needs this pool starts it again, and says what failed


def ready() -> None:
    return None


EXIT: list = []


def pytest_sessionfinish(session, exitstatus):
    EXIT.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Everything a check started is closed by now (the pools at the session's end; the fork server leaves with
    this process): skip the interpreter's teardown of torch, a second a learner would wait for."""
    if EXERCISE and EXIT:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT[-1])


def pytest_collection_modifyitems(items):
    for item in items:
        doc = " ".join((getattr(item, "function", None).__doc__ or "").strip().split("\n\n")[0].split())
        params = getattr(getattr(item, "callspec", None), "params", {})
        marker = item.get_closest_marker("exercise")
        judges = tuple(marker.kwargs.get("judges", ())) if marker else ()
        MEANINGS[item.nodeid] = (doc or item.name.split("[")[0][5:].replace("_", " "),
                                 ", ".join(f"{k}={v}" for k, v in params.items()), judges)


def pytest_runtest_setup(item):
    CURRENT[0] = item.nodeid.split("[")[0]
    while WARMING:
        WARMING.pop().join()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.excinfo is not None and EXERCISE:
        error = call.excinfo.value
        report.graded = (type(error).__name__, str(error), list(getattr(error, "__notes__", [])))


def pytest_runtest_logreport(report):
    if not EXERCISE or report.when != "call" and not (report.when == "setup" and report.failed):
        return
    meaning, params, judges = MEANINGS.get(report.nodeid, (report.nodeid, "", ()))
    line = f"{meaning} [{params}]" if params else meaning
    if report.passed:
        print("\n".join(wrapped("", line, "PASS")), flush=True)
    else:
        kind, message, notes = getattr(report, "graded", ("failed", report.longreprtext, []))
        said, at = failure_lines(kind, message, notes)
        print("\n".join([*wrapped("", line, "FAIL"), *said]), flush=True)
        region = region_of(message, at, judges)
        if region:
            print(f"@region {region}", flush=True)
    prop = report.nodeid.split("[")[0]
    if NOTES.get(prop) and prop not in NOTED:
        NOTED.add(prop)
        print("\n".join(wrapped("", NOTES[prop], "note")), flush=True)


def pytest_collectreport(report):
    if EXERCISE and report.failed:
        error = [line[2:].strip() for line in report.longreprtext.splitlines() if line.startswith("E ")]
        print(f"FAIL  {MODULE}.py could not be imported", flush=True)
        print("\n".join(wrapped("yours: ", " ".join(error[-3:]) or report.longreprtext[-500:])), flush=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtestloop(session):
    yield
    ranks = int(os.environ.get("MINI_DIST_DEMO_RANKS", "0"))
    if EXERCISE and ranks and session.testscollected and not session.testsfailed:
        if not demo(ranks):
            session.testsfailed += 1


# ----- the demo, from the learner's copy, on the pool's ranks

def demo(ranks: int) -> bool:
    """Run the module's demo on `ranks` ranks of the pool that ran the properties (no torchrun, no new imports).
    Its exit status is the verdict only when it crashed or hung: a demo checks mini_dist's own claims, some
    stricter than the exercise's contract (bit for bit with gloo), and a FAIL among them is a note."""
    from harness import RankFailure, run
    where = f"the demo, run from your copy on {ranks} rank{'s' if ranks > 1 else ''}"
    try:
        code, said = run(ranks, demo_on_rank, MODULE, timeout=120)[0]
    except RankFailure as e:
        print("\n".join([f"FAIL  {where}", *failure_lines("RankFailure", str(e), [])[0]]), flush=True)
        return False
    summary = [line.split("|", 2)[2] for line in said.splitlines() if line.startswith("SUMMARY|")]
    if code == 0 or code == 1 and summary:
        verdict = "PASS" if code == 0 else "note"
        print("\n".join(wrapped("", f"{where}: {summary[0] if summary else 'ok'}", verdict)), flush=True)
        if code:
            print("\n".join(wrapped("", "(the demo checks mini_dist's own claims, some stricter than this exercise's "
                                        "contract: a note, not the verdict)")), flush=True)
        return True
    print("\n".join([f"FAIL  {where}", *wrapped("yours: ", (said.strip().splitlines() or ["?"])[-1])]), flush=True)
    return False


def demo_on_rank(module: str) -> tuple[int, str]:
    """On a rank: the module's demo with its default flags, its output kept. A collective the learner's copy
    calls on torch.distributed directly is counted in mini_dist's ledger (collectives.COUNTER), as comm's own
    are, so that the demo's byte figures count it."""
    import contextlib
    import importlib

    import torch.distributed as dist

    from mini_dist.kit import debug, launch
    concept = importlib.import_module(f"mini_dist.{module}")
    debug.DEBUG = False  # as under torchrun: the pools check agreement, a demo's own figures count every message
    real = dist.all_reduce

    def all_reduce(tensor, *args, **kwargs):
        group = args[1] if len(args) > 1 else kwargs.get("group")
        if sys._getframe(1).f_code.co_filename == EXERCISE and dist.get_world_size(group) > 1:
            from mini_dist.collectives import COUNTER
            COUNTER.record("all_reduce", tensor.nbytes)
        return real(tensor, *args, **kwargs)
    said = io.StringIO()
    dist.all_reduce = all_reduce
    try:
        with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
            code = launch.main(concept.parser(), concept.demo, [])
    finally:
        dist.all_reduce = real
    return code, said.getvalue()
