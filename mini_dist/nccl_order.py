"""A checker that proves a point-to-point pattern cannot hang on NCCL: run it on gloo, record it, replay it.

NCCL runs a rank's operations in the order issued, each to its end (mini_dist/nccl_rule.py): a receive posted
before a send, on both ends, waits forever where gloo completes. So a test on gloo, where such a pattern
passes, proves nothing about NCCL by itself. The checker runs the code on gloo, where it completes, while
`record()` writes down every rank's operations in the order issued: each isend, irecv, send and recv, each
batch_isend_irecv as one unit, each collective as one unit (what a collective calls inside is not recorded
again), with `launch.PRETEND_NCCL` set, so the code takes the paths it would take on NCCL. `check()` gathers
every rank's trace and replays them under NCCL's rule (nccl_rule.replay): [] if NCCL could run them, else the
cycle, each rank's waiting operation named by the line of mini_dist that issued it. The rule is stricter than
PyTorch needs today (it gives an unbatched pair of ranks a communicator of its own, with its own stream), so
a pattern that passes here is safe whichever communicator torch picks.

    torchrun --standalone --nproc_per_node=2 mini_dist/nccl_order.py      # the planted cycle, caught; its cure

The tests replay every module that uses point-to-point: the rings and topology (tests/test_nccl_order.py),
ring attention, the expert all-to-all and the pipeline schedules (beside their own properties). Mirrors
NCCL's point-to-point semantics (ncclSend/ncclRecv, ncclGroupStart/End) and torch's batch_isend_irecv.
"""
import contextlib
import inspect
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

if not __package__:  # run as `torchrun mini_dist/x.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mini_dist.kit import launch, wire
from mini_dist.nccl_rule import Op, Unit, replay

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_single", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_single", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "broadcast",
               "barrier", "monitored_barrier", "all_gather_object", "broadcast_object_list", "gather", "scatter",
               "reduce")


def site() -> str:
    """The line that issued the operation (the first frame outside torch, this recorder and the kit's wire)."""
    frame = sys._getframe(2)
    while frame:
        name = frame.f_code.co_filename
        if (f"{os.sep}torch{os.sep}" not in name and name != wire.__file__
                and not (name == __file__ and frame.f_code.co_name in RECORDER)):
            return f"{os.path.basename(name)}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


RECORDER = ("call", "batch", "record", "check")


def ranks_of(group) -> tuple:
    return tuple(range(dist.get_world_size())) if group is None else tuple(dist.get_process_group_ranks(group))


@contextlib.contextmanager
def record():
    """with record() as units: ...   -> this rank's units, in the order issued, with NCCL's paths taken."""
    units = []
    state = {"depth": 0, "batch": None}  # inside a collective (its own calls are not units); the open batch
    real = {name: getattr(dist, name) for name in ("isend", "irecv", "send", "recv", "batch_isend_irecv",
                                                   *COLLECTIVES) if hasattr(dist, name)}

    def p2p(name):
        signature = inspect.signature(real[name])

        def call(*args, **kwargs):
            a = signature.bind(*args, **kwargs).arguments
            group_peer = a.get("group_dst", a.get("group_src"))
            g = ranks_of(a.get("group"))
            peer = a.get("dst", a.get("src")) if group_peer is None else g[group_peer]
            op = Op("send" if "send" in name else "recv", peer, g, a["tensor"].nbytes, site())
            if state["batch"] is not None:
                state["batch"].ops.append(op)
            elif not state["depth"]:
                units.append(Unit("p2p", g, op.site, [op]))
            return real[name](*args, **kwargs)
        call.__name__ = name
        return call

    def batch(ops):
        state["batch"] = Unit("batch", ranks_of(ops[0].group) if ops else (), site())
        try:
            return real["batch_isend_irecv"](ops)
        finally:
            units.append(state["batch"])
            state["batch"] = None

    def collective(name):
        def call(*args, **kwargs):
            if not state["depth"]:
                group = kwargs.get("group", next((a for a in args if isinstance(a, dist.ProcessGroup)), None))
                units.append(Unit(name, ranks_of(group), site()))
            state["depth"] += 1
            try:
                return real[name](*args, **kwargs)
            finally:
                state["depth"] -= 1
        return call

    wrapped = {n: p2p(n) for n in ("isend", "irecv", "send", "recv")} | {"batch_isend_irecv": batch}
    wrapped |= {n: collective(n) for n in COLLECTIVES if n in real}
    saved = launch.PRETEND_NCCL
    for name, fn in wrapped.items():
        setattr(dist, name, fn)
        setattr(c10d, name, fn)  # P2POp accepts only the isend / irecv it knows by name
    launch.PRETEND_NCCL = True
    try:
        yield units
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
            setattr(c10d, name, fn)
        launch.PRETEND_NCCL = saved


def check(fn, *args, group=None, **kwargs) -> list[str]:
    """Run fn on every rank under record(), gather the traces, replay them: [] if NCCL could run it."""
    with record() as units:
        fn(*args, **kwargs)
    traces = [None] * dist.get_world_size(group)
    dist.all_gather_object(traces, units, group=group)
    return replay(traces)


# ----------------------------------------------------------------------------- demo

def parser():
    return launch.demo_parser(__doc__)


def receive_first(device, batched: bool) -> None:
    """Two ranks swap a tensor, each posting its receive before its send: fine on gloo, a cycle on NCCL
    unless the pair is one batch."""
    peer = 1 - dist.get_rank()
    mine = torch.full((4,), float(dist.get_rank()), device=device)
    theirs = torch.empty(4, device=device)
    if batched:
        works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, theirs, peer), dist.P2POp(dist.isend, mine, peer)])
    else:
        works = [dist.irecv(theirs, peer), dist.isend(mine, peer)]
    for w in works:
        w.wait()
    assert theirs[0].item() == peer


def send_first_ring(device) -> None:
    """Every rank sends to its left before it receives from its right: the classic ring that deadlocks when
    sends wait for their receive (MPI's rendezvous, NCCL's in-order stream)."""
    me = dist.get_rank()
    n = dist.get_world_size()
    outgoing = torch.ones(8, device=device)
    incoming = torch.empty(8, device=device)
    send = dist.isend(outgoing, (me - 1) % n)
    dist.irecv(incoming, (me + 1) % n).wait()
    send.wait()


def demo(args) -> int:
    world = launch.env_world_size()
    launch.require(world >= 2, f"run on 2 or more ranks (got {world}): a cycle needs two ranks")
    env = launch.setup()
    pair = dist.new_group([0, 1], timeout=launch.timeout())
    results = {}
    for name, fn in [("irecv before isend, unbatched", lambda: receive_first(env.device, False)),
                     ("irecv before isend, one batch", lambda: receive_first(env.device, True))]:
        results[name] = check(fn, group=pair) if env.rank < 2 else []
        dist.barrier()
    results["send-first ring, unbatched"] = check(lambda: send_first_ring(env.device))
    for name, cycle in results.items():
        verdict = "deadlock under NCCL:\n    " + "\n    ".join(cycle) if cycle else "completes under NCCL"
        launch.print0(f"{name:<32} ran on gloo; replayed: {verdict}")
    caught = bool(results["irecv before isend, unbatched"]) and bool(results["send-first ring, unbatched"])
    return launch.conclude("nccl_order", caught, "planted cycles named (receive first; send-first ring)",
                           not results["irecv before isend, one batch"], "the batched pair completes")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
