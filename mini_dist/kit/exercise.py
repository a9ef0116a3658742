"""Learn by writing it: a concept's textbook algorithm, blanked, graded by the properties that prove it.

    ./run.sh exercise ring_allreduce [--force]     # write exercises/ring_allreduce.py
    ./run.sh check ring_allreduce [--every]         # grade it: only this file stands in for mini_dist's
    ./run.sh hint ring_allreduce                    # the next hint for the function you are on

How an exercise is declared, in four places:
- **The contract**, in the reference (mini_dist/<module>.py), around the code a learner writes:
        # exercise: what must be true when the function returns, in words and shapes, and the tools to
        #   use (send_recv, all_reduce); never the indices or the steps ('#' and 2+ spaces continue it)
        ...the reference body...
        # end exercise
  `blank` turns it into `raise NotImplementedError("<module>: write <function>: <contract>")`; `write` puts
  the blanked module in exercises/ (ignored by git) under a header listing the properties that judge it.
- **The properties**, `@pytest.mark.exercise(judges=("function", ...))` in tests/test_<module>.py (or the
  files TESTED_BY names). A docstring's first line states what the property holds (its PASS / FAIL line);
  `judges` names the functions whose hints a failure points to. A failure says where the ranks first differ
  (rank, element, expected, got), within a bound that follows from the arithmetic, never one order's
  rounding; a claim stricter than the contract (bit-identical to gloo) is `grading.optional(...)`,
  asserted in the suite, a note in a check (tests/grading.py: the grader, a pytest plugin).
- **The mistakes**, MISTAKES = {name: (function, what to change)} in the same test file; a failure whose
  cause is recognised (from what the learner's code produced) adds `grading.mistake(MISTAKES, name, evidence)`.
- **The bank**, tests/bank_<module>.py: HINTS = {function: [2 or 3 hints, the idea first, nearly the answer
  last]}, RIGHT = {what: {function: body}} (must pass), WRONG = {what: (mistake, {function: body})} (must fail
  with that mistake named); `fill` writes bodies into the blanks. tests/test_exercise.py checks it all.
"""
import argparse
import ast
import json
import os
import re
import subprocess
import sys
import textwrap

if __package__:
    from mini_dist.kit.blanks import answer, blank, blanks, fill, function_at, planted, regions  # noqa: F401  (tests')
else:  # run as a script by run.sh, with this folder on the path: nothing imports mini_dist.kit, nor torch
    from blanks import answer, blank, blanks, fill, function_at, planted, regions  # noqa: F401

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKSPACE = os.path.join(ROOT, "exercises")
WIDTH = 116
# where a concept's marked properties live, when not (only) in tests/test_<module>.py: the bucket hook's
# averages are pinned by DDP against native DDP; resharding's boxes alone, then in checkpoints saved at K, loaded at K'
TESTED_BY = {"reducer": ["reducer", "ddp"], "reshard": ["reshard", "checkpoint"]}
ORDER = ["ring_allreduce", "comm", "tensor_parallel", "reducer", "zero", "fsdp", "checkpoint", "checkpoint_plan",
         "reshard", "loss_scaling", "activation_checkpoint", "pipeline_schedules", "context_parallel",
         "expert_parallel", "mesh", "cost_model", "parallel_gpt"]
ONE_RANK = ("activation_checkpoint", "cost_model")  # demos that run on one rank


def hints(module: str) -> dict:
    """HINTS of tests/bank_<module>.py: function -> its hints, from the idea to nearly the answer (read, not run)."""
    path = os.path.join(ROOT, "tests", f"bank_{module}.py")
    tree = ast.parse(open(path).read()) if os.path.exists(path) else ast.Module(body=[])
    return next((ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                 and getattr(n.targets[0], "id", None) == "HINTS"), {})


def properties(module: str) -> list[tuple[str, tuple]]:
    """(what it checks, the functions it judges) of every property `check` runs, read from the test files."""
    found = []
    for path in test_files(module):
        for node in ast.parse(open(path).read()).body:
            marks = [d for d in getattr(node, "decorator_list", []) if "mark.exercise" in ast.unparse(d)]
            if isinstance(node, ast.FunctionDef) and marks:
                doc = " ".join((ast.get_docstring(node) or node.name[5:].replace("_", " ")).split("\n\n")[0].split())
                judges = next((ast.literal_eval(k.value) for m in marks if isinstance(m, ast.Call)
                               for k in m.keywords if k.arg == "judges"), ())
                found.append((doc, tuple(judges)))
    return found


def header(module: str) -> list[str]:
    """The top of an exercise file: what to do, and what will judge it."""
    said = [f"Write each `raise NotImplementedError(...)` below: it says what must be true when its function "
            f"returns. `./run.sh check {module}` grades this file (only this one: every other module is "
            f"mini_dist's own) by these properties, on ranks, then runs its demo:"]
    said += [f"- {doc}" + (f" ({', '.join(judges)})" if judges else "") for doc, judges in properties(module)]
    if hints(module):
        said.append(f"Stuck? `./run.sh hint {module}` shows a hint for the function you are on, one at a time.")
    lines = [w for s in said for w in textwrap.wrap(s, WIDTH - 4, subsequent_indent="  " if s[0] == "-" else "")]
    return ["# " + w for w in lines] + [""]


def exercises() -> list[str]:
    """Every module that has marked regions, in the order to do them."""
    have = [f[:-3] for f in os.listdir(os.path.join(ROOT, "mini_dist")) if f.endswith(".py")
            and "# exercise:" in open(os.path.join(ROOT, "mini_dist", f)).read()]
    return sorted(have, key=lambda m: (ORDER.index(m) if m in ORDER else len(ORDER), m))


def reference(module: str) -> str:
    if module not in exercises():
        raise SystemExit(f"exercise: no exercise '{module}'; choose one of: {' '.join(exercises())}")
    return open(os.path.join(ROOT, "mini_dist", f"{module}.py")).read()


def answers(module: str) -> dict:
    """mini_dist's own code for each blanked function (its first region), the contract left out: what a bank's
    wrong solution keeps in the functions it does not get wrong."""
    source = reference(module)
    return {r.function: answer(source, r.function) for r in regions(source)}


def write(module: str, force: bool = False, workspace: str = WORKSPACE) -> str:
    """Write the blanked copy; refuse to overwrite a learner's work in progress unless forced."""
    fresh = "\n".join(header(module)) + blank(reference(module), module)
    path = os.path.join(workspace, f"{module}.py")
    if os.path.exists(path) and open(path).read() != fresh and not force:
        raise SystemExit(f"exercise: {os.path.relpath(path, ROOT)} holds your work in progress; "
                         f"./run.sh check {module} grades it, --force starts again from a blank copy")
    os.makedirs(workspace, exist_ok=True)
    with open(path, "w") as f:
        f.write(fresh)
    remember(workspace, module, None)  # a fresh start: every hint unseen again
    return path


def test_files(module: str) -> list[str]:
    return [os.path.join(ROOT, "tests", f"test_{m}.py") for m in TESTED_BY.get(module, [module])]


# ----- hints: the next unseen one, for the function the learner is on

def state(workspace: str, module: str) -> dict:
    """A module's hint state: hints seen per function, and the function the last failed check pointed at."""
    return dict({"seen": {}, "failed": None}, **everything(workspace).get(module, {}))


def everything(workspace: str) -> dict:
    try:
        return json.load(open(os.path.join(workspace, ".hints.json")))
    except (OSError, ValueError):  # none yet, or not ours to read: start again
        return {}


def remember(workspace: str, module: str, mine: dict | None) -> None:
    kept = dict(everything(workspace), **{module: mine})
    with open(os.path.join(workspace, ".hints.json.tmp"), "w") as f:
        json.dump({k: v for k, v in kept.items() if v}, f, indent=1)
    os.replace(os.path.join(workspace, ".hints.json.tmp"), os.path.join(workspace, ".hints.json"))  # never half


def hint(module: str, workspace: str = WORKSPACE) -> int:
    """Print the next unseen hint for the first function still blank, else for where the last check failed."""
    path = os.path.join(workspace, f"{module}.py")
    if not os.path.exists(path):
        raise SystemExit(f"hint: no {os.path.relpath(path, ROOT)}; ./run.sh exercise {module} writes it")
    mine = state(workspace, module)
    try:
        still = [function for _, _, function, _ in blanks(open(path).read(), module)]
    except SyntaxError as e:
        raise SystemExit(f"hint: {os.path.relpath(path, ROOT)} does not parse (line {e.lineno}: {e.msg})")
    on = still[0] if still else mine["failed"]
    if on is None:
        print(f"hint: every blank of {module} is written and no check has failed since: ./run.sh check {module}")
        return 0
    given = hints(module).get(on, [])
    if not given:
        print(f"hint: none written for {on} yet: its docstring and the blank's contract are what there is; "
              f"mini_dist/{module}.py holds the answer")
        return 0
    seen = mine["seen"].get(on, 0)
    if seen >= len(given):
        print(f"every hint for {on} ({len(given)}), again; mini_dist/{module}.py holds the answer:")
    else:
        mine["seen"][on] = seen + 1
        remember(workspace, module, mine)
        print(f"hint {seen + 1} of {len(given)} for {on}:")
    for text in given[:seen + 1] if seen >= len(given) else given[seen:seen + 1]:
        print(textwrap.fill(text, WIDTH, initial_indent="  ", subsequent_indent="  "))
    return 0


# ----- grading: the properties by pytest with the grader plugin (tests/grading.py), in a process of its own

def grading(module: str, workspace: str, demo: bool = True) -> tuple[dict, list[str]]:
    """The environment a check runs in (short timeouts: a hang is named in seconds) and its test files."""
    torchrun = re.compile(r"(RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|GROUP_RANK|GROUP_WORLD_SIZE|ROLE_\w+"
                          r"|MASTER_\w+|TORCHELASTIC_\w+|TORCH_NCCL_ASYNC_ERROR_HANDLING)$")  # the check starts ranks
    paths = [ROOT, os.path.join(ROOT, "tests"), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = dict({k: v for k, v in os.environ.items() if not torchrun.match(k)},
               MINI_DIST_EXERCISE=os.path.abspath(os.path.join(workspace, f"{module}.py")),
               MINI_DIST_DEMO_RANKS=str((1 if module in ONE_RANK else 2) if demo else 0),
               PYTHONPATH=os.pathsep.join(paths),
               # a rank that lags its peers (a busy machine) still reports its own timeout within the grace
               MINI_DIST_RANK_TIMEOUT="10", MINI_DIST_CALL_TIMEOUT="20", MINI_DIST_GRACE="3",
               HYPOTHESIS_PROFILE=os.environ.get("HYPOTHESIS_PROFILE", "exercise"))
    return env, test_files(module)


def check(module: str, workspace: str = WORKSPACE, demo: bool = True, every: bool = False) -> int:
    """Grade the learner's copy: the properties, each line printed as it is decided, then the demo (on the
    ranks that ran them). It stops at the first failing property unless `every`. 0 only when all passed."""
    reference(module)
    path = os.path.join(workspace, f"{module}.py")
    if not os.path.exists(path):
        raise SystemExit(f"check: no {os.path.relpath(path, ROOT)}; ./run.sh exercise {module} writes it")
    print(f"check: grading {os.path.relpath(path, ROOT)} (every other module is mini_dist's own)", flush=True)
    env, tests = grading(module, workspace, demo)
    stop = [] if every else ["-x"]
    result = subprocess.Popen([sys.executable, "-m", "pytest", *stop, "-m", "exercise", "-p", "no:cacheprovider",
                               "-p", "grading", "-p", "no:terminal", *tests],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    said = []
    mine = state(workspace, module)
    for line in result.stdout:
        said.append(line)
        if line.startswith(("PASS  ", "FAIL  ", "note  ", "      ")):  # a verdict and its own lines
            print(line, end="", flush=True)
        elif line.startswith("@region "):  # where the failure points: the hints' function
            mine["failed"] = line.split()[1]
            remember(workspace, module, mine)
            given = hints(module).get(mine["failed"], [])
            if given:
                seen = min(mine["seen"].get(mine["failed"], 0), len(given))
                print(f"      hint: for {mine['failed']}, ./run.sh hint {module} ({seen} of {len(given)} seen)",
                      flush=True)
    status = 0 if result.wait() == 0 else 1
    if not any(line.startswith(("PASS", "FAIL")) for line in said):
        print("".join(said)[-4000:], flush=True)  # pytest itself failed: its own words
    if result.returncode == 5:
        print(f"check: no property of {module} is marked @pytest.mark.exercise", flush=True)
    print(f"{module}: {'every property holds' if status == 0 else 'not yet'}", flush=True)
    return status


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="./run.sh exercise|check|hint", description=__doc__.split("\n\n")[0])
    p.add_argument("verb", choices=["exercise", "check", "hint"])
    p.add_argument("module", nargs="?", help="the concept (none: list them in the order to do them)")
    p.add_argument("--force", action="store_true", help="exercise: overwrite your work in progress")
    p.add_argument("--every", action="store_true", help="check: every property, not only up to the first failure")
    p.add_argument("--workspace", default=WORKSPACE, help="the folder of your exercises")
    args = p.parse_args(argv)
    if not args.module:
        print(textwrap.fill("exercises, in order: " + " ".join(exercises()), 100))
        return 0
    reference(args.module)
    if args.verb == "exercise":
        path = write(args.module, args.force, args.workspace)
        print(f"wrote {os.path.relpath(path, ROOT)}: write each NotImplementedError, then ./run.sh check {args.module}")
        return 0
    if args.verb == "hint":
        return hint(args.module, args.workspace)
    return check(args.module, args.workspace, every=args.every)


if __name__ == "__main__":  # run as a script (run.sh): nothing here imports torch, the grader's process does
    raise SystemExit(main())
