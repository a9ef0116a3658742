"""Why a pattern that runs on gloo can hang forever on NCCL, and a checker that proves it cannot.

gloo moves every send and receive on threads of its own: a rank may post `irecv` from its peer before its
`isend` to it, the peer may do the same, and both complete. NCCL does not. It enqueues a rank's operations
on a CUDA stream and runs them in the order they were issued, each one to its end before the next starts,
and a send ends only when the peer's matching receive runs (NCCL may buffer a small message, but promises
nothing). So under NCCL

    rank 0: irecv(from 1), isend(to 1)        rank 1: irecv(from 0), isend(to 0)

is a cycle: each receive waits for a send queued behind the other receive. The cure is to issue the pair as
one unit, `dist.batch_isend_irecv([P2POp(isend, ...), P2POp(irecv, ...)])` (ncclGroupStart/End), whose
operations progress together, or to order them so that one side sends first. A collective is a unit that
ends when every rank of its group has reached it.

The checker runs the code on gloo, where it completes, while `record()` writes down every rank's operations
in the order issued (with `launch.PRETEND_NCCL` set, so the code takes the paths it would take on NCCL). Then
`replay()` runs those traces under NCCL's rules: per rank, one operation (or one batch, or one collective)
at a time, in order; a send and its receive (the k-th from a to b in a group) complete together, when both
are at the head of their ranks' queues. If the replay stops with operations left, it names the cycle:
which rank waits in which operation for which rank. The rule is stricter than PyTorch needs today (it
gives an unbatched pair of ranks a communicator of its own, with its own stream), so a pattern that passes
here is safe whichever communicator torch picks.

    torchrun --standalone --nproc_per_node=2 mini_dist/nccl_order.py      # the planted cycle, caught; its cure

The tests replay every module that uses point-to-point: the rings and topology (tests/test_nccl_order.py),
ring attention, the expert all-to-all and the pipeline schedules (beside their own properties). Mirrors
NCCL's point-to-point semantics (ncclSend/ncclRecv, ncclGroupStart/End) and torch's batch_isend_irecv.
"""
import contextlib
import inspect
import os
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

if not __package__:  # run as `torchrun mini_dist/x.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mini_dist.kit import launch, wire

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_single", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_single", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "broadcast",
               "barrier", "monitored_barrier", "all_gather_object", "broadcast_object_list", "gather", "scatter",
               "reduce")


@dataclass
class Op:
    """One send or receive: `peer` and `group` in global ranks, `site` the line of mini_dist that issued it."""
    kind: str          # "send" or "recv"
    peer: int
    group: tuple
    nbytes: int
    site: str


@dataclass
class Unit:
    """What NCCL runs as one: a lone send or receive, a batch of them, or a collective (ops empty)."""
    kind: str          # "p2p", "batch" or a collective's name
    group: tuple
    site: str
    ops: list = field(default_factory=list)

    def __str__(self) -> str:
        if self.ops and self.kind != "batch":
            op = self.ops[0]
            return f"{'isend to' if op.kind == 'send' else 'irecv from'} rank {op.peer} ({op.site})"
        if self.kind == "batch":
            parts = ", ".join(f"{'send to' if o.kind == 'send' else 'recv from'} {o.peer}" for o in self.ops)
            return f"batch_isend_irecv [{parts}] ({self.site})"
        return f"{self.kind} on ranks {list(self.group)} ({self.site})"


# ----------------------------------------------------------------------------- the replay under NCCL's rules

def replay(traces: list[list[Unit]]) -> list[str]:
    """Run every rank's units in order under NCCL's rules; [] if all complete, else the lines of the cycle."""
    head = [0] * len(traces)
    done: set = set()
    partner = match(traces)
    progress = True
    while progress:
        progress = False
        for r, units in enumerate(traces):
            while head[r] < len(units):
                u = units[head[r]]
                if not u.ops:  # a collective: every member at its matching collective, or nobody moves
                    members = partner[(r, head[r], None)]
                    if not all(head[m] == i for m, i in members):
                        break
                    for m, _ in members:
                        head[m] += 1
                    progress = True
                    continue
                for k in range(len(u.ops)):
                    p, j, q = partner[(r, head[r], k)]
                    if (r, head[r], k) not in done and head[p] == j:
                        done.update({(r, head[r], k), (p, j, q)})
                if not all((r, head[r], k) in done for k in range(len(u.ops))):
                    break
                head[r] += 1
                progress = True
    stuck = {r: units[head[r]] for r, units in enumerate(traces) if head[r] < len(units)}
    return describe(stuck, traces, head, partner, done)


def match(traces: list[list[Unit]]) -> dict:
    """(rank, unit, op) -> its counterpart (rank, unit, op); (rank, unit, None) -> the collective's members.
    The k-th send from a to b in a group meets the k-th receive at b from a in that group (NCCL ignores tags)."""
    sends, recvs, colls, partner = {}, {}, {}, {}
    for r, units in enumerate(traces):
        for i, u in enumerate(units):
            if not u.ops:
                colls.setdefault((u.group, r), []).append(i)
            for k, op in enumerate(u.ops):
                key = (u.group, r, op.peer) if op.kind == "send" else (u.group, op.peer, r)
                (sends if op.kind == "send" else recvs).setdefault(key, []).append((r, i, k))
    for key, mine in sends.items():
        theirs = recvs.get(key, [])
        if len(theirs) != len(mine):
            raise ValueError(f"{len(mine)} sends from rank {key[1]} to rank {key[2]} but {len(theirs)} receives: "
                             f"the run on gloo could not have completed")
        for a, b in zip(mine, theirs):
            partner[a], partner[b] = b, a
    for (group, r), indices in colls.items():
        for n, i in enumerate(indices):
            partner[(r, i, None)] = [(m, colls[(group, m)][n]) for m in group]
    return partner


def describe(stuck: dict, traces, head, partner, done) -> list[str]:
    """The wait-for cycle among the stuck ranks, one line per rank, starting where the cycle starts."""
    if not stuck:
        return []
    waits = {}
    for r, u in stuck.items():
        if u.ops:
            waits[r] = [partner[(r, head[r], k)][0] for k in range(len(u.ops)) if (r, head[r], k) not in done]
        else:
            waits[r] = [m for m, i in partner[(r, head[r], None)] if head[m] != i]
    r, seen = min(stuck), []
    while r not in seen and r in waits:
        seen.append(r)
        r = waits[r][0]
    cycle = seen[seen.index(r):] if r in seen else seen
    return [f"rank {a} is in {stuck[a]}, waiting for rank {waits[a][0]}, which is in "
            f"{stuck[waits[a][0]] if waits[a][0] in stuck else 'nothing: it has finished'}" for a in cycle]


# ----------------------------------------------------------------------------- recording a run on gloo

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
    units, state = [], {"depth": 0, "batch": None}
    real = {name: getattr(dist, name) for name in ("isend", "irecv", "send", "recv", "batch_isend_irecv",
                                                   *COLLECTIVES) if hasattr(dist, name)}

    def p2p(name):
        signature = inspect.signature(real[name])

        def call(*args, **kwargs):
            a = signature.bind(*args, **kwargs).arguments
            group, group_peer = a.get("group"), a.get("group_dst", a.get("group_src"))
            g = ranks_of(group)
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

def receive_first(device, batched: bool) -> None:
    """Two ranks swap a tensor, each posting its receive before its send: fine on gloo, a cycle on NCCL
    unless the pair is one batch."""
    peer = 1 - dist.get_rank()
    mine, theirs = torch.full((4,), float(dist.get_rank()), device=device), torch.empty(4, device=device)
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
    me, n = dist.get_rank(), dist.get_world_size()
    out, inc = torch.ones(8, device=device), torch.empty(8, device=device)
    send = dist.isend(out, (me - 1) % n)
    dist.irecv(inc, (me + 1) % n).wait()
    send.wait()


def parser():
    return launch.demo_parser(__doc__)


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
