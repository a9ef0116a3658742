"""Pipeline ranks agree on the step before the first message: a rank that built another schedule is named.

A pipeline trusts its neighbours to post matching sends and receives. If one rank built its schedule for
M=2 microbatches and the others for M=4, or holds two model chunks where the others hold one, nothing
fails at once: some rank waits for a message its neighbour never sends, until the process group's timeout
(120 s by default) ends the job with an error that names nobody. So every rank first says what it is about
to run, in one all-gather of four integers per rank (a checksum of the schedule, its chunk count, the
batch size on the first stage, the target count on the last), and when they disagree, every rank gathers
the whole description and raises the same error, naming the ranks that differ and how.

They also agree on the order of their messages. NCCL runs a rank's sends and receives one at a time, in the
order posted, and a send ends only when its receive runs. Posted in each rank's action order, 1F1B's
steady state crosses: stage s sends an activation to s+1 while s+1 sends a gradient back, and both wait.
`message_order` gives every rank the order in which the messages arrive when sends never wait (as on gloo);
restricted to any one rank it keeps that rank's actions in order, and posted that way nothing can wait in a
cycle. The demo replays both under NCCL's rule (mini_dist/nccl_order.py).

    torchrun --standalone --nproc_per_node=4 mini_dist/pipeline_agreement.py [--mistake microbatches]

Mirrors torch.distributed.pipelining's shape inference (stages exchange metadata before the first step)
and TORCH_DISTRIBUTED_DEBUG=DETAIL's collective fingerprints; mini_dist/pipeline_executor.py calls it every
step.
"""
import functools
import sys
import time
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

if not __package__:  # run as `torchrun mini_dist/x.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist import nccl_order
from mini_dist.kit import launch, wire
from mini_dist.pipeline_actions import COMPUTE, Schedule, route
from mini_dist.pipeline_schedules import SCHEDULES
from mini_dist.pipeline_stages import pipeline_chunks


def agree_on_step(schedule: Schedule, chunks: list, inputs, targets, loss_fn, group=None) -> None:
    """Every rank says what it is about to run: the schedule (name, M, stages, chunks, and a checksum of
    every rank's actions), its chunks, and what only the ends know (the batch on the first stage, targets
    and loss on the last). Every rank finds the same problem and raises the same error, naming ranks,
    instead of waiting for a message that never comes. Four integers per rank in one all-gather (not
    all_gather_object, which is two collectives and a pickle, every step); only when they show a problem
    does every rank gather the whole description, to name it."""
    P = dist.get_world_size(group)
    s = dist.get_rank(group)
    plan = (schedule.name, schedule.n_microbatches, len(schedule.actions), schedule.n_chunks)
    batch = len(inputs) if s == 0 and inputs is not None else -1
    n_targets = len(targets) if s == P - 1 and targets is not None and loss_fn is not None else -1
    crc = zlib.crc32(repr((plan, schedule.actions)).encode())
    mine = torch.tensor([crc, len(chunks), batch, n_targets], device=launch.device())
    everyone = torch.zeros(P * 4, dtype=torch.int64, device=launch.device())
    wire.call(dist.all_gather_single, everyone, mine, group=group)
    everyone = everyone.view(P, 4)
    first_crc = everyone[0, 0].item()
    batch = everyone[0, 2].item()     # the first stage's
    n_targets = everyone[-1, 3].item()  # the last stage's
    same_schedule = (everyone[:, 0] == first_crc).all() and (everyone[:, 1] == plan[3]).all() and plan[2] == P
    if same_schedule and batch >= 0 and batch == n_targets and plan[1] > 0 and batch % plan[1] == 0:
        return  # the same schedule, the chunks it runs, a batch that cuts into M: nothing to name
    name_the_disagreement(plan, schedule, chunks, inputs, targets, loss_fn, group)


@functools.cache
def message_order(schedule: Schedule) -> tuple:
    """NCCL runs a rank's sends and receives one at a time, in the order posted, and a send ends only when its
    receive runs. So every rank posts its messages in one order that all ranks share: the order in which they
    arrive when each rank runs its actions, a send never waits and a receive waits for its send. Then the first
    message not yet through always has both ends at the head of their queues (whatever either rank posted
    before it came earlier in the order), and nothing waits in a cycle. Returns, per rank, its (send|recv,
    peer, message) in that order; a rank's messages to itself stay out."""
    P = len(schedule.actions)
    S = P * schedule.n_chunks
    head = [0] * P  # per rank, its next action
    sent = set()
    order = [[] for _ in range(P)]
    while any(h < len(actions) for h, actions in zip(head, schedule.actions)):
        moved = False
        for r, actions in enumerate(schedule.actions):
            while head[r] < len(actions):
                a = actions[head[r]]
                if a.op not in COMPUTE:
                    peer, message = route(a, r, P, S)
                    if a.op.startswith("recv") and peer != r:
                        if message not in sent:
                            break  # this rank waits here for its peer's send
                        order[peer].append(("send", r, message))
                        order[r].append(("recv", peer, message))
                    sent.add(message)
                head[r] += 1
                moved = True
        if not moved:
            raise ValueError(f"{schedule.name}: ranks wait for messages never sent, at actions {head}")
    return tuple(tuple(mine) for mine in order)


def in_action_order(schedule: Schedule) -> tuple:
    """The naive order: each rank posts its messages as its actions come, in message_order's form."""
    P = len(schedule.actions)
    S = P * schedule.n_chunks
    posted = []
    for r, actions in enumerate(schedule.actions):
        mine = [(a.op[:4], *route(a, r, P, S)) for a in actions if a.op not in COMPUTE]
        posted.append(tuple(m for m in mine if m[1] != r))  # not to itself
    return tuple(posted)


def under_nccls_rule(order: tuple) -> list[str]:
    """Replay per-rank orders of lone sends and receives under NCCL's rule: [] if all complete, else the cycle."""
    group = tuple(range(len(order)))
    traces = []
    for mine in order:
        units = []
        for kind, peer, message in mine:
            said = "{0} of microbatch {1} for stage {2}".format(*message)
            units.append(nccl_order.Unit("p2p", group, said, [nccl_order.Op(kind, peer, group, 0, said)]))
        traces.append(units)
    return nccl_order.replay(traces)


def name_the_disagreement(plan, schedule: Schedule, chunks: list, inputs, targets, loss_fn, group) -> None:
    """The whole description of every rank, gathered, to say which ranks differ and how."""
    P = dist.get_world_size(group)
    s = dist.get_rank(group)
    everyone = [None] * P
    wire.call(dist.all_gather_object, everyone, dict(
        plan=plan, actions=zlib.crc32(repr(schedule.actions).encode()), chunks=len(chunks),
        inputs=len(inputs) if s == 0 and inputs is not None else None,
        targets=len(targets) if s == P - 1 and targets is not None and loss_fn is not None else None), group=group)

    def who(key, say) -> str:
        """Which ranks said what: "rank 0: ...; ranks 1, 2: ..."."""
        values = {}
        for r, e in enumerate(everyone):
            values.setdefault(e[key], []).append(str(dist.get_global_rank(group, r) if group is not None else r))
        return "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(r)}: {say(v)}" for v, r in values.items())

    def schedule_said(p) -> str:
        return "{} with M={}, {} stages x {} chunk(s)".format(*p)

    def checksum_said(crc) -> str:
        return f"checksum {crc}"
    name, M, stages, v = everyone[0]["plan"]
    if len({e["plan"] for e in everyone}) > 1:
        raise ValueError("pipeline ranks disagree on the schedule: " + who("plan", schedule_said)
                         + ": build it with the same arguments on every rank")
    if len({e["actions"] for e in everyone}) > 1:
        raise ValueError(f"pipeline ranks hold different actions under one name, {name}: "
                         + who("actions", checksum_said))
    if stages != P or any(e["chunks"] != v for e in everyone):
        raise ValueError(f"the schedule runs {stages} stages x {v} chunk(s) per rank, but the pipeline group has "
                         f"{P} ranks, holding chunks: {who('chunks', str)}: cut the model with pipeline_chunks(model, "
                         f"group, {v}) on a group of {stages}")
    batch = everyone[0]["inputs"]
    n_targets = everyone[-1]["targets"]
    if batch is None or n_targets is None:
        raise ValueError("the first stage needs `inputs`, the last stage `targets` and `loss_fn`")
    if batch != n_targets or batch % M:
        raise ValueError(f"a batch of {batch} inputs and {n_targets} targets cannot be cut into {M} equal "
                         f"microbatches: pass as many targets as inputs and choose M dividing {batch}")


# ----------------------------------------------------------------------------- demo

MISTAKES = ("microbatches", "schedule", "chunks", "batch")


def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("--mistake", choices=MISTAKES, default="microbatches",
                   help="what rank --rank gets wrong: its M, its schedule's name, its chunk count, or the batch")
    p.add_argument("--rank", type=int, default=1, help="the rank that makes the mistake")
    return p


def demo(args) -> int:
    P = launch.env_world_size()
    bad = args.rank
    launch.require(P >= 2 and 0 <= bad < P, f"needs at least 2 ranks and --rank in 0..{P - 1}")
    launch.setup()
    M = 4
    wrong = dist.get_rank() == bad
    torch.manual_seed(0)  # the same model on every rank
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(2 * P)]).to(launch.device())
    chunks = pipeline_chunks(model, None, 2 if wrong and args.mistake == "chunks" else 1)
    name = "gpipe" if wrong and args.mistake == "schedule" else "1f1b"
    schedule = SCHEDULES[name](P, M // 2 if wrong and args.mistake == "microbatches" else M)
    batch = 2 * M + 1 if args.mistake == "batch" else 2 * M  # the first stage's batch (the last's targets, alike)
    x = torch.randn(batch, 4, device=launch.device())
    start = time.perf_counter()
    said = None
    try:
        agree_on_step(schedule, chunks, x, x, nn.MSELoss())
    except ValueError as e:
        said = str(e)
    seconds = time.perf_counter() - start
    everyone = [None] * P
    dist.all_gather_object(everyone, said)
    batch_only = args.mistake == "batch"
    what = f"a batch of {batch} does not cut into M={M}" if batch_only else f"rank {bad} gets the {args.mistake} wrong"
    launch.print0(f"{what}; rank 0 raised after {seconds * 1e3:.1f} ms, before any message (waiting instead, the "
                  f"group's timeout would take {launch.timeout().total_seconds():.0f} s and name nobody):\n"
                  f"  ValueError: {said}")
    named = said is not None and (batch_only or f"rank {bad}" in said)
    launch.print0(f"\nthe messages of one step, M={2 * P}, replayed under NCCL's rule (mini_dist/nccl_order.py):")
    safe = True
    for name in SCHEDULES:
        schedule = SCHEDULES[name](P, 2 * P, 2 if name in ("interleaved", "zero_bubble") else 1)
        naive = under_nccls_rule(in_action_order(schedule))
        ours = under_nccls_rule(message_order(schedule))
        safe = safe and not ours
        launch.print0(f"  {name:<12} in each rank's action order: {naive[0] if naive else 'completes'}\n"
                      f"  {'':<12} in message_order: {ours[0] if ours else 'completes'}")
    naming = "" if batch_only else f", naming rank {bad}"
    return launch.conclude("pipeline_agreement", len(set(everyone)) == 1 and named,
                           f"every rank raised the same error{naming}",
                           safe, "every schedule's message_order completes under NCCL's rule")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
