"""NCCL's in-order rule: why a pattern that runs on gloo can hang forever on NCCL, replayed on paper.

gloo moves every send and receive on threads of its own: a rank may post `irecv` from its peer before its
`isend` to it, the peer may do the same, and both complete. NCCL does not. It enqueues a rank's operations
on a CUDA stream and runs them in the order they were issued, each one to its end before the next starts,
and a send ends only when the peer's matching receive runs (NCCL may buffer a small message, but promises
nothing). So under NCCL

    rank 0: irecv(from 1), isend(to 1)        rank 1: irecv(from 0), isend(to 0)

is a cycle: each receive waits for a send queued behind the other receive. So is the classic ring in which
every rank sends to its left before it receives from its right. The cure is to issue the pair as one unit,
`dist.batch_isend_irecv([P2POp(isend, ...), P2POp(irecv, ...)])` (ncclGroupStart/End), whose operations
progress together, or to order them so that one side sends first. A collective is a unit that ends when
every rank of its group has reached it.

`replay()` runs every rank's trace (its units, in the order issued) under that rule: per rank one unit at a
time, in order; a send and its receive (the k-th from a to b in a group: NCCL matches no tags) complete
together, when both are at the head of their ranks' queues. If the replay stops with units left, it names the
cycle: which rank waits in which operation for which rank. mini_dist/nccl_order.py writes the traces down
from real runs; the demo here replays traces written by hand, with no process to wait on:

    torchrun --standalone --nproc_per_node=1 mini_dist/nccl_rule.py [--ranks 4]

Mirrors NCCL's point-to-point semantics (ncclSend/ncclRecv, ncclGroupStart/End) and torch's batch_isend_irecv.
"""
import sys
from dataclasses import dataclass, field
from pathlib import Path

if not __package__:  # run as `torchrun mini_dist/x.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist.kit import launch


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


def replay(traces: list[list[Unit]]) -> list[str]:
    """Run every rank's units in order under NCCL's rules; [] if all complete, else the lines of the cycle."""
    head = [0] * len(traces)  # the unit each rank is in
    done: set = set()         # (rank, unit, op) of the sends and receives that have completed
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
                for k in range(len(u.ops)):  # an op completes when its partner's unit is at its rank's head
                    p, j, q = partner[(r, head[r], k)]
                    if (r, head[r], k) not in done and head[p] == j:
                        done.update({(r, head[r], k), (p, j, q)})
                if not all((r, head[r], k) in done for k in range(len(u.ops))):
                    break
                head[r] += 1
                progress = True
    stuck = {r: units[head[r]] for r, units in enumerate(traces) if head[r] < len(units)}
    return describe(stuck, head, partner, done)


def match(traces: list[list[Unit]]) -> dict:
    """(rank, unit, op) -> its counterpart (rank, unit, op); (rank, unit, None) -> the collective's members.
    The k-th send from a to b in a group meets the k-th receive at b from a in that group (NCCL ignores tags)."""
    sends = {}   # (group, from, to) -> [(rank, unit, op)] in the order issued
    recvs = {}
    colls = {}   # (group, rank) -> the rank's collectives on that group, in order
    partner = {}
    for r, units in enumerate(traces):
        for i, u in enumerate(units):
            if not u.ops:
                colls.setdefault((u.group, r), []).append(i)
            for k, op in enumerate(u.ops):
                if op.kind == "send":
                    sends.setdefault((u.group, r, op.peer), []).append((r, i, k))
                else:
                    recvs.setdefault((u.group, op.peer, r), []).append((r, i, k))
    for key, mine in sends.items():
        theirs = recvs.get(key, [])
        if len(theirs) != len(mine):
            raise ValueError(f"{len(mine)} sends from rank {key[1]} to rank {key[2]} but {len(theirs)} receives: "
                             f"the run on gloo could not have completed")
        for a, b in zip(mine, theirs):
            partner[a] = b
            partner[b] = a
    for (group, r), indices in colls.items():
        for n, i in enumerate(indices):
            partner[(r, i, None)] = [(m, colls[(group, m)][n]) for m in group]
    return partner


def describe(stuck: dict, head, partner, done) -> list[str]:
    """The wait-for cycle among the stuck ranks, one line per rank, starting where the cycle starts."""
    if not stuck:
        return []
    waits = {}  # rank -> the ranks it waits for
    for r, u in stuck.items():
        if u.ops:
            waits[r] = [partner[(r, head[r], k)][0] for k in range(len(u.ops)) if (r, head[r], k) not in done]
        else:
            waits[r] = [m for m, i in partner[(r, head[r], None)] if head[m] != i]
    r = min(stuck)
    seen = []
    while r not in seen and r in waits:
        seen.append(r)
        r = waits[r][0]
    cycle = seen[seen.index(r):] if r in seen else seen
    return [f"rank {a} is in {stuck[a]}, waiting for rank {waits[a][0]}, which is in "
            f"{stuck[waits[a][0]] if waits[a][0] in stuck else 'nothing: it has finished'}" for a in cycle]


# ----------------------------------------------------------------------------- demo

def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("--ranks", type=int, default=4, help="ranks in the ring written down (the swap is of two)")
    return p


def written(kind: str, peer: int, n: int, where: str) -> Unit:
    """One unbatched isend (kind "send") or irecv on a world of n ranks, written by hand (where: its place)."""
    world = tuple(range(n))
    return Unit("p2p", world, where, [Op(kind, peer, world, 4, where)])


def batched(ops: list[tuple[str, int]], n: int, where: str) -> Unit:
    """One batch_isend_irecv of (kind, peer) on a world of n ranks, written by hand."""
    world = tuple(range(n))
    return Unit("batch", world, where, [Op(kind, peer, world, 4, where) for kind, peer in ops])


def traces(n: int) -> dict[str, list[list[Unit]]]:
    """The patterns the docstring names, as every rank's units: a swap of two ranks and a ring of n."""
    return {
        "swap, irecv before isend": [[written("recv", 1 - r, 2, "1st"), written("send", 1 - r, 2, "2nd")]
                                     for r in range(2)],
        "swap, one batch": [[batched([("recv", 1 - r), ("send", 1 - r)], 2, "1st")] for r in range(2)],
        "swap, rank 0 sends first": [[written("send", 1, 2, "1st"), written("recv", 1, 2, "2nd")],
                                     [written("recv", 0, 2, "1st"), written("send", 0, 2, "2nd")]],
        f"ring of {n}, isend left first": [[written("send", (r - 1) % n, n, "1st"),
                                            written("recv", (r + 1) % n, n, "2nd")] for r in range(n)],
        f"ring of {n}, one batch a step": [[batched([("send", (r - 1) % n), ("recv", (r + 1) % n)], n, "1st")]
                                           for r in range(n)],
    }


def demo(args) -> int:
    launch.require(args.ranks >= 2, f"--ranks must be at least 2, got {args.ranks}: a cycle needs two ranks")
    launch.setup()
    cycles = {name: replay(units) for name, units in traces(args.ranks).items()}
    for name, cycle in cycles.items():
        verdict = "deadlock:\n    " + "\n    ".join(cycle) if cycle else "completes"
        launch.print0(f"{name:<32} replayed under NCCL's rule: {verdict}")
    hangs = [name for name, cycle in cycles.items() if cycle]
    caught = hangs == ["swap, irecv before isend", f"ring of {args.ranks}, isend left first"]
    every_rank = len(cycles[f"ring of {args.ranks}, isend left first"]) == args.ranks
    return launch.conclude("nccl_rule", caught, "the receive-first swap and the send-first ring hang; batched, they "
                           "complete", every_rank, f"the ring's cycle names all {args.ranks} ranks")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
