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
the third is `wait_for`: a send or receive that fails says which peer it was talking to, so the chain of
"look at rank X's log" leads to the rank that died first.

    torchrun --standalone --nproc_per_node=3 mini_dist/debug.py      # the silent sum, then the named error

Mirrors TORCH_DISTRIBUTED_DEBUG=DETAIL (torch.distributed's collective fingerprints) and gloo's
monitored_barrier, which names the ranks that never arrived.
"""
import os
import sys

import torch
import torch.distributed as dist

if not __package__:  # run as `torchrun mini_dist/debug.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from mini_dist.kit import launch

DEBUG = os.environ.get("MINI_DIST_DEBUG") == "1"


class Disagreement(RuntimeError):
    """Ranks of one group called different collectives, or the same one with different shapes."""


class PeerLost(RuntimeError):
    """A send to or a receive from one peer failed: it died, was killed, or stopped answering."""


def call_site() -> str:
    """Where the collective was asked for: the mini_dist layer or function that asked (the first frame
    outside comm.py, this check and torch), and the user's line that called it (the first outside mini_dist)."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # mini_dist/, the kit included
    comm_py, ours = os.path.join(here, "comm.py"), (call_site.__code__, agree.__code__)
    frame, sites = sys._getframe(1), []
    while frame and len(sites) < 2:
        name = os.path.abspath(frame.f_code.co_filename)
        inside = name.startswith(here + os.sep)
        if (name != comm_py and frame.f_code not in ours and f"{os.sep}torch{os.sep}" not in name
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
    dist.all_gather_object(everyone, mine, group=group)
    global_rank = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
    for rank, theirs in enumerate(everyone):
        if theirs != everyone[0]:
            raise Disagreement(f"ranks disagree before a collective: rank {global_rank(0)} calls {everyone[0][0]} "
                               f"{everyone[0][1]} at {everyone[0][2]}, rank {global_rank(rank)} calls {theirs[0]} "
                               f"{theirs[1]} at {theirs[2]}; every rank of the group must pass the same "
                               f"shapes to the same layers")


def wait_for(work, peer: int, what: str) -> None:
    """work.wait() for a send to / receive from global rank `peer`; if the peer vanished, name it."""
    try:
        work.wait()
    except RuntimeError as e:  # gloo: "Connection reset by peer" or a timeout; NCCL: its own report
        raise PeerLost(f"{what}: lost rank {peer} ({str(e).splitlines()[0]}); look for the first error in "
                       f"rank {peer}'s log: it died, was killed, or stopped answering") from e


# ----- demo: the silent sum, then the same mistake named -----

def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("--bad-rank", type=int, default=1, help="the rank that passes its tokens in another shape")
    return p


def demo(args) -> int:
    from mini_dist import comm  # this module as the library sees it (run as a script, it is __main__)
    from mini_dist.kit import debug
    world = launch.env_world_size()
    launch.require(world >= 2 and 0 <= args.bad_rank < world,
                   f"--bad-rank {args.bad_rank} on {world} ranks: run on 2 or more ranks, with 0 <= --bad-rank < {world}")
    env = launch.setup()
    shape = (3, 2, 6) if env.rank == args.bad_rank else (2, 3, 6)  # [batch, seq, hidden], same number of tokens
    b, t = torch.meshgrid(torch.arange(shape[0]), torch.arange(shape[1]), indexing="ij")
    x = (10.0 * b + t).unsqueeze(-1).expand(shape).to(env.device)  # token (b, t) holds 10b + t on every rank
    before, debug.DEBUG = debug.DEBUG, False
    silent = comm.g(x)  # debug off: row k of the bad rank is another token than row k of the others
    wrong = not torch.equal(silent, world * x)  # the right sum: each token `world` times itself
    b, t = (silent != world * x).any(-1).nonzero()[0].tolist() if wrong else (0, 0)
    launch.print0(f"debug off: rank {args.bad_rank} passed [3, 2, 6], the others [2, 3, 6]; the all-reduce ran, "
                  f"no error, and rank 0's token ({b}, {t}) reads {silent[b, t, 0].item():g} instead of "
                  f"{world * x[b, t, 0].item():g}")
    debug.DEBUG, named = True, ""
    try:
        comm.g(x)
    except debug.Disagreement as e:
        named = str(e)
    debug.DEBUG = before
    launch.print0(f"debug on (MINI_DIST_DEBUG=1): every rank raised Disagreement:\n  {named}")
    everyone = torch.tensor([f"rank {args.bad_rank} calls" in named], device=env.device)
    dist.all_reduce(everyone, op=dist.ReduceOp.MIN)
    return launch.conclude("debug", bool(everyone.item()), f"rank {args.bad_rank} named on every rank",
                           wrong, "debug off: the mismatched sum completes, silently wrong")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
