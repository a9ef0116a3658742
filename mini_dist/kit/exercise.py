"""Learn by writing it: a concept's textbook algorithm, blanked, graded by the properties that prove it.

The reference source marks, once, each region a learner writes:

        # exercise: the N-1 steps of the reduce-scatter: ...
        ...the reference body...
        # end exercise

`write(module)` copies mini_dist/<module>.py into exercises/<module>.py (ignored by git) with each region
replaced by `raise NotImplementedError("<what to write>")`: signatures, docstrings and shape comments stay.
`check(module)` runs the concept's properties marked @pytest.mark.exercise against that copy (mini_dist's
package path puts exercises/ first while MINI_DIST_EXERCISES is set, on every rank), on ranks as always,
with short timeouts, and prints one line per property: passed, or failed with what the property means, the
first line of what differed, and the smallest case hypothesis found. Then the demo, from the copy. The exit
status is 0 only when every property passed.

    ./run.sh exercise ring_allreduce [--force]     # write exercises/ring_allreduce.py
    ./run.sh check ring_allreduce                   # grade it
"""
import argparse
import os
import re
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKSPACE = os.path.join(ROOT, "exercises")
START, END = re.compile(r"^(\s*)# exercise: (.+)$"), re.compile(r"^\s*# end exercise\s*$")
# where a concept's marked properties live, when not (only) in tests/test_<module>.py: the bucket hook's
# averages are pinned by DDP against native DDP; resharding by the checkpoints saved at K, loaded at K'
TESTED_BY = {"reducer": ["reducer", "ddp"], "reshard": ["checkpoint"]}
ORDER = ["ring_allreduce", "comm", "tensor_parallel", "reducer", "zero", "fsdp", "checkpoint", "reshard",
         "loss_scaling", "activation_checkpoint", "pipeline_schedules", "context_parallel", "expert_parallel",
         "mesh", "cost_model", "parallel_gpt"]


def regions(source: str) -> list[tuple[int, int, str, str]]:
    """(first line, last line, indentation, what to write) of every marked region, 0-based, inclusive."""
    found, open_at = [], None
    for i, line in enumerate(source.splitlines()):
        if (m := START.match(line)) and open_at is None:
            open_at = (i, m.group(1), m.group(2).strip())
        elif END.match(line) and open_at is not None:
            found.append((open_at[0], i, open_at[1], open_at[2]))
            open_at = None
    if open_at is not None:
        raise ValueError(f"'# exercise:' at line {open_at[0] + 1} has no '# end exercise'")
    return found


def blank(source: str, module: str) -> str:
    """The exercise: each region's lines replaced by one NotImplementedError that says what to write."""
    lines = source.splitlines()
    for first, last, indent, what in reversed(regions(source)):
        lines[first:last + 1] = [f"{indent}raise NotImplementedError({f'{module}: write {what}'!r})"]
    return "\n".join(lines) + "\n"


def exercises() -> list[str]:
    """Every module that has marked regions, in the order to do them."""
    have = [f[:-3] for f in os.listdir(os.path.join(ROOT, "mini_dist")) if f.endswith(".py")
            and regions(open(os.path.join(ROOT, "mini_dist", f)).read())]
    return sorted(have, key=lambda m: (ORDER.index(m) if m in ORDER else len(ORDER), m))


def reference(module: str) -> str:
    if module not in exercises():
        raise SystemExit(f"exercise: no exercise '{module}'; choose one of: {' '.join(exercises())}")
    return open(os.path.join(ROOT, "mini_dist", f"{module}.py")).read()


def write(module: str, force: bool = False, workspace: str = WORKSPACE) -> str:
    """Write the blanked copy; refuse to overwrite a learner's work in progress unless forced."""
    fresh, path = blank(reference(module), module), os.path.join(workspace, f"{module}.py")
    if os.path.exists(path) and open(path).read() != fresh and not force:
        raise SystemExit(f"exercise: {os.path.relpath(path, ROOT)} holds your work in progress; "
                         f"./run.sh check {module} grades it, --force starts again from a blank copy")
    os.makedirs(workspace, exist_ok=True)
    with open(path, "w") as f:
        f.write(fresh)
    return path


# ----- grading: a pytest plugin that prints one line per property

SHRINK_S = 10  # a learner waits for the answer: shrinking stops after this long (hypothesis' own limit: 300 s)


def name_peers() -> None:
    """In a check, a learner's blocking dist.send / dist.recv that outlives the group's timeout says which rank
    it waited for: gloo's own words name no peer, and a hang is named by who waits for whom."""
    import torch.distributed as dist

    def named(fn, way, ends):  # ends: the peer's keywords, global and group rank (src, group_src or dst, ...)
        def call(tensor, *args, **kwargs):
            try:
                return fn(tensor, *args, **kwargs)
            except RuntimeError as e:
                from mini_dist.kit.debug import TIMED_OUT, PeerLost  # not at install: a rank's fork server runs it
                if not TIMED_OUT.search(str(e)):
                    raise
                peer = args[0] if args else kwargs.get(ends[0])
                group = args[1] if len(args) > 1 else kwargs.get("group")
                if peer is None and kwargs.get(ends[1]) is not None:
                    peer = dist.get_global_rank(group or dist.group.WORLD, kwargs[ends[1]])
                who = "any rank" if peer is None else f"rank {peer}"
                raise PeerLost(f"{way} {who} timed out ({str(e).splitlines()[0]}): {who} never posted the "
                               f"matching {'recv' if way.startswith('send') else 'send'}; is it waiting too?") from e
        return call
    dist.send = named(dist.send, "send to", ("dst", "group_dst"))
    dist.recv = named(dist.recv, "recv from", ("src", "group_src"))


def pytest_configure(config):
    from hypothesis.internal.conjecture import engine  # an internal constant: without it, shrinking takes longer
    engine.MAX_SHRINKING_SECONDS = SHRINK_S


def pytest_runtest_logreport(report):
    if report.when != "call" and not (report.when == "setup" and report.failed):
        return
    name = report.nodeid.split("::")[-1]
    meaning = MEANINGS.get(report.nodeid.split("[")[0], name.replace("_", " "))
    if report.passed:
        print(f"PASS  {meaning}", flush=True)
        return
    from mini_dist.kit.debug import TIMED_OUT
    waited = re.compile(TIMED_OUT.pattern + WAITED)
    text = report.longreprtext
    plain = re.sub(r"^E ", "", text, flags=re.M)  # pytest's prefix on the lines of the error
    error = next((line[1:].strip() for line in text.splitlines() if line.startswith("E ")), "failed")
    case = re.search(r"(?:Falsifying example|Failing test case): \w+\((.*?)\n\s*\)((?:\n\s*Draw \d+: [^\n]*)*)", plain,
                     re.S)
    said = re.findall(r"^\s*(rank \d+)(?: failed: |: )(.*)$", plain, re.M)  # each rank's own first line
    if "RankFailure" in error and said:  # the cause: an error of its own, before a wait its peers then timed out
        error = ": ".join(next((r for r in said if not waited.search(r[1])), None)  # (a timeout, before the
                          or next((r for r in said if TIMED_OUT.search(r[1])), said[0]))  # connections it closed)
    error = re.sub(r"\[\S*\.cc:\d+\] ", "", error)  # gloo's source line, no help to a learner
    print(f"FAIL  {meaning}\n      yours: {error[:200]}", flush=True)
    blocks = re.findall(r"^\s*rank (\d+)(?: failed|:)(.*?)(?=^\s*rank \d+(?: failed|:)|\Z)", plain, re.M | re.S)
    for rank, block in blocks if any(TIMED_OUT.search(line) for _, line in said) else ():  # a hang: where each
        frames = re.findall(r'File "' + re.escape(os.environ.get("MINI_DIST_EXERCISES", WORKSPACE)) +  # rank waited
                            r'/([^"]+)", line (\d+), in (\w+)\n\s*(.+)', block)
        if frames and waited.search(block.split("\n", 1)[0]):
            file, line, function, code = frames[-1]
            peer = re.search(r"(?:recv from|send to|waited for) (rank \d+|any rank)", block)
            whom = f" for {peer.group(1)}" if peer else ""
            print(f"      rank {rank} waited{whom} at {file}:{line} in {function}: {code.strip()}", flush=True)
    if case:
        drawn = " ".join(case.group(2).split())
        smallest = " ".join(case.group(1).split()).rstrip(",")[:200]
        print(f"      smallest case: {smallest}{'; ' + drawn if drawn else ''}", flush=True)


MEANINGS: dict[str, str] = {}
WAITED = r"|waited for rank|lost rank|no answer|[Cc]onnection (closed|reset)"  # beside debug.TIMED_OUT's words


def pytest_collection_modifyitems(items):
    for item in items:
        doc = (getattr(item, "function", None).__doc__ or "").strip().split("\n")[0]
        MEANINGS[item.nodeid.split("[")[0]] = doc or item.name.split("[")[0][5:].replace("_", " ")


def grading(module: str, workspace: str) -> tuple[dict, list[str]]:
    """The environment a check runs in (short timeouts: a hang is named in seconds) and its test files."""
    torchrun = re.compile(r"(RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|GROUP_RANK|GROUP_WORLD_SIZE|ROLE_\w+"
                          r"|MASTER_\w+|TORCHELASTIC_\w+|TORCH_NCCL_ASYNC_ERROR_HANDLING)$")  # the check starts ranks
    env = dict({k: v for k, v in os.environ.items() if not torchrun.match(k)}, MINI_DIST_EXERCISES=workspace,
               PYTHONPATH=os.pathsep.join([ROOT, *filter(None, [os.environ.get("PYTHONPATH")])]),
               # a rank that lags its peers (a busy machine) still reports its own timeout within the grace
               MINI_DIST_RANK_TIMEOUT="10", MINI_DIST_CALL_TIMEOUT="20", MINI_DIST_GRACE="3",
               HYPOTHESIS_PROFILE=os.environ.get("HYPOTHESIS_PROFILE", "exercise"))
    return env, test_files(module)


def test_files(module: str) -> list[str]:
    return [os.path.join(ROOT, "tests", f"test_{m}.py") for m in TESTED_BY.get(module, [module])]


def check(module: str, workspace: str = WORKSPACE, demo: bool = True, every: bool = False) -> int:
    """Grade the learner's copy: the properties, each line printed as it is decided, then the demo. It stops
    at the first failing property unless `every`. 0 only when everything passed."""
    reference(module)
    path = os.path.join(workspace, f"{module}.py")
    if not os.path.exists(path):
        raise SystemExit(f"check: no {os.path.relpath(path, ROOT)}; ./run.sh exercise {module} writes it")
    env, tests = grading(module, workspace)
    result, said = subprocess.Popen([sys.executable, "-m", "pytest", *["-x"] * (not every), "-m", "exercise", "-p",
                                     "no:cacheprovider", "-p", "mini_dist.kit.exercise", "-p", "no:terminal", *tests],
                                    cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), []
    for line in result.stdout:
        said.append(line)
        if line.startswith(("PASS", "FAIL")) or re.match(r" {6}\S", line):  # a verdict and its own lines
            print(line, end="", flush=True)
    status = 0 if result.wait() == 0 else 1
    if not any(line.startswith(("PASS", "FAIL")) for line in said):
        print("".join(said)[-4000:], flush=True)  # pytest itself failed: its own words
    if result.returncode == 5:
        print(f"check: no property of {module} is marked @pytest.mark.exercise", flush=True)
    if demo and status == 0:
        # two ranks: a 2-core laptop runs them side by side (the properties drew 1 to 5 ranks already)
        ranks = "1" if module in ("activation_checkpoint", "cost_model") else "2"
        run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                              f"--nproc_per_node={ranks}", path], cwd=ROOT, capture_output=True, text=True,
                             env=dict(env, MINI_DIST_TIMEOUT=env["MINI_DIST_RANK_TIMEOUT"]))  # a hang: 10 s
        summary = [line for line in run.stdout.splitlines() if line.startswith("SUMMARY|")]
        print(f"{'PASS' if run.returncode == 0 else 'FAIL'}  the demo, run from your copy on {ranks} rank(s): "
              f"{summary[0].split('|', 2)[2] if summary else (run.stderr.strip().splitlines() or ['?'])[-1]}")
        status = status or (run.returncode != 0)
    print(f"{module}: {'every property holds' if status == 0 else 'not yet'}", flush=True)
    return status


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="./run.sh exercise|check", description=__doc__.split("\n\n")[0])
    p.add_argument("verb", choices=["exercise", "check"])
    p.add_argument("module", nargs="?", help="the concept (none: list them in the order to do them)")
    p.add_argument("--force", action="store_true", help="exercise: overwrite your work in progress")
    p.add_argument("--every", action="store_true", help="check: every property, not only up to the first failure")
    args = p.parse_args(argv)
    if not args.module:
        print(textwrap.fill("exercises, in order: " + " ".join(exercises()), 100))
        return 0
    if args.verb == "exercise":
        path = write(args.module, args.force)
        print(f"wrote {os.path.relpath(path, ROOT)}: write each NotImplementedError, then ./run.sh check {args.module}")
        return 0
    return check(args.module, every=args.every)


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    raise SystemExit(main())
