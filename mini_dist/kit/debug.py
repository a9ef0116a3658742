"""When ranks disagree or vanish: name the rank, instead of a hang or a silently wrong answer.

A collective trusts every rank to call it with matching tensors. When one rank does not, three things can
happen, and only one of them is loud:

    same number of elements, other shape ([3,2,6] vs [2,3,6])   the sum runs and mixes unrelated tokens:
                                                                silent garbage
    other number of elements                                    gloo aborts ("Received data size doesn't
                                                                match") or the ranks wait until the timeout
    a rank that exited (even with status 0)                     its neighbours get "Connection reset by peer";
                                                                torchrun may blame a victim

The cure for the first two is to agree before communicating, as TORCH_DISTRIBUTED_DEBUG=DETAIL does for
torch's collectives: with MINI_DIST_DEBUG=1, every mini_dist collective first all-gathers a small record
(operation, shape, dtype, call site) from each rank of its group; if any differs from rank 0's, every rank
raises a `Disagreement` naming both ranks, both shapes and the line that called. It costs one extra
latency-bound collective per collective, so it is off by default, and then costs one `if`. (A pipeline
agrees on its schedule once per step, always: a wrong microbatch count would otherwise hang.) The cure for
the third: a send or receive that fails (kit/wire.py), or a collective (`failed`), raises `PeerLost` naming
the rank that failed first, however it ended, and not the peer it was talking to (kit/fates.py).
`check_collective` is the ring collectives' guard: agreement (under debug) and input every rank refuses alike.

    torchrun --standalone --nproc_per_node=3 mini_dist/kit/debug.py      # the silent sum, then the named error

Mirrors TORCH_DISTRIBUTED_DEBUG=DETAIL (torch.distributed's collective fingerprints) and gloo's
monitored_barrier, which names the ranks that never arrived.
"""
import contextlib
import datetime
import os
import re
import sys

import torch
import torch.distributed as dist

if not __package__:  # run as `torchrun mini_dist/kit/debug.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from mini_dist.kit import fates, launch

DEBUG = os.environ.get("MINI_DIST_DEBUG") == "1"


class Disagreement(RuntimeError):
    """Ranks of one group called different collectives, or the same one with different shapes."""


class PeerLost(RuntimeError):
    """A send to or a receive from one peer failed: it died, was killed, or stopped answering."""


def call_site() -> str:
    """Where the collective was asked for: the mini_dist layer or function that asked (the first frame
    outside comm.py, these checks and torch), and the user's line that called it (the first outside mini_dist)."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # mini_dist/, the kit included
    comm_py = {os.path.join(here, f) for f in ("comm.py", "collectives.py")}
    ours = (call_site.__code__, agree.__code__, check_collective.__code__)
    frame, sites = sys._getframe(1), []
    while frame and len(sites) < 2:
        name = os.path.abspath(frame.f_code.co_filename)
        inside = name.startswith(here + os.sep)
        if (name not in comm_py and frame.f_code not in ours and f"{os.sep}torch{os.sep}" not in name
                and (not sites or not inside)):
            sites.append(f"{os.path.basename(name)}:{frame.f_lineno} in {frame.f_code.co_name}")
            if not inside:
                break
        frame = frame.f_back
    return " called from ".join(sites) or "?"


def agree(operation: str, signature, group=None) -> None:
    """Under MINI_DIST_DEBUG=1: raise on every rank of `group` unless all of them are about to run the same
    `operation` on tensors with the same `signature` (shape, dtype: what must match) from the same place."""
    if not DEBUG or dist.get_world_size(group) == 1:
        return
    mine = (operation, str(signature), call_site())
    everyone = [None] * dist.get_world_size(group)
    try:
        dist.all_gather_object(everyone, mine, group=group)
    except RuntimeError as e:
        named = failed(e, f"agreeing before {operation}")
        if named is None:
            raise
        raise named from e
    global_rank = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
    for rank, theirs in enumerate(everyone):
        if theirs != everyone[0]:
            raise Disagreement(f"ranks disagree before a collective: rank {global_rank(0)} calls {everyone[0][0]} "
                               f"{everyone[0][1]} at {everyone[0][2]}, rank {global_rank(rank)} calls {theirs[0]} "
                               f"{theirs[1]} at {theirs[2]}; every rank of the group must pass the same "
                               f"shapes to the same layers")


OPS = {dist.ReduceOp.SUM: "SUM", dist.ReduceOp.AVG: "AVG", dist.ReduceOp.MAX: "MAX", dist.ReduceOp.MIN: "MIN",
       dist.ReduceOp.PRODUCT: "PRODUCT"}
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
          torch.int32, torch.int64, torch.bool]


def check_collective(tensor: torch.Tensor, op, group, name: str, also: str = "") -> None:
    """Ranks that disagree are named on every rank (debug mode); bad input shared by all fails on all."""
    if DEBUG:  # (one more latency-bound collective per call: only under MINI_DIST_DEBUG=1)
        agree(name, f"shape {tuple(tensor.shape)} dtype {tensor.dtype} op {OPS.get(op, op)} on "
                    f"{tensor.device.type}{also}", group)
    if op not in OPS:
        raise ValueError(f"{name}: unsupported op {op}; use SUM, AVG, MAX, MIN or PRODUCT")
    if tensor.dtype not in DTYPES:
        raise ValueError(f"{name}: unsupported dtype {tensor.dtype}; use one of {DTYPES}")
    if tensor.device.type != launch.device().type:
        raise ValueError(f"{name}: a tensor on {tensor.device.type} cannot travel over "
                         f"{dist.get_backend(group)}; create it on mini_dist.kit.launch.device()")
    if op == dist.ReduceOp.AVG and not tensor.is_floating_point():
        raise ValueError(f"{name}: AVG of {tensor.dtype} tensors would round; use SUM and divide")


TIMED_OUT = re.compile(r"[Tt]imed out|[Tt]imeout")  # gloo's words for a wait that outlived the group's timeout
LEFT = re.compile(r"[Cc]onnection (closed|reset)")  # gloo's words for a peer that closed its end while one waited


def lost_rank() -> str:
    """'lost rank r (how it ended). Rank me stopped after ...' for the rank of the world that failed first
    (it raised, left, or vanished), this rank recorded as its victim; '' if no rank failed."""
    return fates.blame()[1]


def failed(error: BaseException, what: str) -> PeerLost | None:
    """The error to raise when torch's collective `what` raised `error`: if a connection was lost or a wait
    outlived the timeout, a PeerLost naming the rank that failed first; None for any other error (raise it)."""
    if isinstance(error, (PeerLost, Disagreement)) or not fates.broken(error):
        return None
    cause = lost_rank()
    first = str(error).splitlines()[0] if str(error) else type(error).__name__
    if cause:
        return PeerLost(f"{what}: {cause} ({first})")
    if TIMED_OUT.search(str(error)):
        return PeerLost(f"{what}: waited until the group's timeout ({first}): a rank of the group never joined "
                        f"it, and none failed; is it waiting for this rank?")
    return PeerLost(f"{what} failed ({first}); the first rank to fail says why in its own log")


# ----- demo: the silent sum, then the same mistake named; a rank that never arrives, named -----

def checked_all_reduce(x: torch.Tensor, group=None) -> torch.Tensor:
    """dist.all_reduce of a copy, agreed on first (under DEBUG): what every mini_dist collective does."""
    agree("all_reduce", f"shape {tuple(x.shape)} dtype {x.dtype}", group)
    out = x.clone()
    dist.all_reduce(out, group=group)
    return out


@contextlib.contextmanager
def fd2_to(file):
    """gloo logs its errors from C++ straight to file descriptor 2: point it at `file` for a while."""
    saved = os.dup(2)
    os.dup2(file.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def dead_or_disagreeing(bad_rank: int = 1) -> tuple[str, bool]:
    """Rank `bad_rank` passes its tokens as [3, 2, 6], the others as [2, 3, 6] (the same number of elements):
    unchecked the sum runs and is wrong; checked, every rank names it. Then the last rank never reaches a
    barrier: a monitored barrier with a 1 s timeout names it instead of waiting forever. -> (figure, holds)."""
    global DEBUG
    n, r = dist.get_world_size(), dist.get_rank()
    shape = (3, 2, 6) if r == bad_rank else (2, 3, 6)  # [batch, seq, hidden]: the same number of tokens
    b, t = torch.meshgrid(torch.arange(shape[0]), torch.arange(shape[1]), indexing="ij")  # cpu: token ids
    x = (10.0 * b + t).unsqueeze(-1).expand(shape).to(launch.device())  # token (b, t) holds 10b + t on every rank
    before, named = DEBUG, ""
    try:
        DEBUG = False
        silent = checked_all_reduce(x)
        DEBUG = True
        try:
            checked_all_reduce(x)
        except Disagreement as e:
            named = str(e)
    finally:
        DEBUG = before
    wrong = (silent != n * x).any(-1).nonzero()
    at = tuple(wrong[0].tolist()) if len(wrong) else (0, 0)
    group, missing = dist.new_group(list(range(n)), timeout=datetime.timedelta(seconds=1), backend="gloo"), ""
    if r < n - 1:
        with open(os.devnull, "w") as quiet, contextlib.redirect_stderr(quiet), fd2_to(quiet):
            try:
                dist.monitored_barrier(group, timeout=datetime.timedelta(seconds=1), wait_all_ranks=True)
            except RuntimeError as e:
                missing = str(e).split("]: ")[-1]
    dist.barrier()
    late = re.search(r"Ranks? ([\d, ]+) failed", missing)  # a busy machine may make another rank late too
    found = torch.tensor([f"rank {bad_rank} calls" in named and "(3, 2, 6)" in named
                          and (r > 0 or bool(late) and str(n - 1) in late.group(1).split(", "))],
                         device=launch.device())
    dist.all_reduce(found, op=dist.ReduceOp.MIN)
    return (f"rank {bad_rank} passes its tokens as [3, 2, 6], the others as [2, 3, 6]: unchecked, the all-reduce "
            f"runs and rank 0's token {at} reads {silent[at][0].item():g} instead of {n * x[at][0].item():g}; "
            f"checked (MINI_DIST_DEBUG=1), every rank raises a Disagreement naming rank {bad_rank} and both shapes; "
            f"rank {n - 1} never reaching a barrier with a 1 s timeout: rank 0 raises '{missing}'"), \
        len(wrong) > 0 and bool(found.item())


def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("--bad-rank", type=int, default=1, help="the rank that passes its tokens in another shape")
    return p


def demo(args) -> int:
    world = launch.env_world_size()
    launch.require(world >= 2 and 0 <= args.bad_rank < world,
                   f"--bad-rank {args.bad_rank} on {world} ranks: run on 2 or more ranks, with 0 <= --bad-rank "
                   f"< {world}")
    launch.setup()
    from mini_dist.kit import debug  # this module as the library sees it (run as a script, it is __main__)
    figure, holds = debug.dead_or_disagreeing(args.bad_rank)
    launch.print0(figure)
    return launch.conclude("debug", holds, f"rank {args.bad_rank} named on every rank; the missing rank named",
                           holds, "debug off: the mismatched sum completes, silently wrong")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
