"""Expert parallelism: a mixture-of-experts layer whose tokens travel to their experts by all-to-all.

The mixture-of-experts layer of moe.py holds E expert MLPs and a router (top-k, renormalised weights,
capacity C = ceil(capacity_factor * n * k / E) per expert, Switch's aux loss E * sum_i f_i * P_i). Expert
parallelism gives each of the W ranks of the expert group E/W experts and the router whole. Each rank is one
GShard group (its own tokens, capacity and aux loss). Rows bound for other ranks' experts travel by an
all-to-all with uneven splits; the counts are exchanged first, so every receiver knows what comes:

    counts    all-to-all of E integers          dispatch  my kept rows to their experts' ranks
    experts   E/W local MLPs on what arrived    combine   the reverse all-to-all, then y = sum_j w_j out_j

The backward is the same two trips reversed. Bytes each rank sends, forward and again backward, are its rows
for other ranks' experts (dispatch), then the outputs of the rows other ranks sent it (combine): (rows out +
rows in) * h * bytes per element. Imbalance costs time too: the busiest rank's experts set the pace.

Naive beside optimised: `moe.MoE` loops over every expert in one process (the reference); `ExpertParallelMoE`
shards them and moves rows by `p2p_all_to_all` (isend/irecv) or dist.all_to_all_single (comm.all_to_all_single).

Demo (vs one process, bytes vs formula, balance with and without the aux loss; ./run.sh ask 17: stragglers):

    torchrun --standalone --nproc_per_node=4 mini_dist/expert_parallel.py

Mirrors: Megatron-LM's core/transformer/moe (MoEAlltoAllTokenDispatcher), DeepSpeed-MoE.
"""
import copy
import sys
from collections import namedtuple
from pathlib import Path

import torch
import torch.distributed as dist

if not __package__:  # run as `torchrun mini_dist/x.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist import comm
from mini_dist.kit import launch, measure, trace, wire
from mini_dist.moe import MoE, route, skewed_tokens

Plan = namedtuple("Plan", "token choice sent received")  # the rows' (token, choice), rows to / from each rank


def dispatch(tokens, routing, num_experts, group=None, transport=comm.all_to_all_single):
    """Each kept (token, choice) row of tokens [n, h] to the rank holding its expert (rank q of the W holds
    experts q*E/W .. (q+1)*E/W - 1). Returns (rows, got, plan): plan.token, plan.choice: every kept pair once, in
    the order its row is sent (rank 0's experts' rows first, each rank's by local expert); plan.sent[q] /
    plan.received[q]: rows I send to / receive from rank q (W ints); got [W, E/W] int64: got[q, i] rows from rank
    q for my local expert i; rows [sum(plan.received), h]: what came, rank 0's first, each in its plan's order."""
    # exercise: (rows, got, plan) as the docstring says, exact, on every rank; each all-to-all by `transport`
    W = dist.get_world_size(group)
    t, j = routing.keep.nonzero(as_tuple=True)                            # kept (token, choice) pairs
    order = routing.expert[t, j].argsort(stable=True)                     # by expert = by owner rank
    t = t[order]
    j = j[order]
    sent = torch.bincount(routing.expert[t, j], minlength=num_experts).view(W, -1)  # [W, E/W] rows to rank q
    got = transport(torch.empty_like(sent), sent, [1] * W, [1] * W, group)         # [W, E/W] rows from rank q
    plan = Plan(t, j, sent.sum(1).tolist(), got.sum(1).tolist())
    return comm.all_to_all_rows(tokens[t], plan.sent, plan.received, group, transport), got, plan
    # end exercise


def combine(out, plan, weight, n, group=None, transport=comm.all_to_all_single):
    """out [sum(plan.received), h], row m the expert output of dispatch's rows[m], back to the ranks the rows came
    from; returns y [n, h]: y_t = sum over t's kept choices j of weight[t, j] * (row (t, j)'s output), 0 for a
    token with none; differentiable in out and in weight (the router learns through weight)."""
    # exercise: y as the docstring says, within a sum's rounding, differentiable; rows back by `transport`
    back = comm.all_to_all_rows(out, plan.received, plan.sent, group, transport)  # [kept, h], plan's order
    return out.new_zeros((n, out.shape[1])).index_add(0, plan.token, weight[plan.token, plan.choice, None] * back)
    # end exercise


def p2p_all_to_all(out, x, output_splits, input_splits, group=None):
    """dist.all_to_all_single from isend/irecv: rows x[..input_splits[j]..] go to rank j, rows from rank j
    land in out[..output_splits[j]..]. Round s pairs me with me+s (send) and me-s (receive), so no rank is
    everyone's first peer; empty messages are skipped, which both sides know from the counts. Every send
    and receive is in one batch: under NCCL, unbatched ones run in order on one stream, and a receive
    queued ahead of the send its peer waits for would never finish."""
    W = dist.get_world_size(group)
    me = dist.get_rank(group)
    sends = x.split(input_splits)
    recvs = out.split(output_splits)
    recvs[me].copy_(sends[me])
    ops = []
    for s in range(1, W):
        to = (me + s) % W
        frm = (me - s) % W
        ops.append((wire.SEND, sends[to], to))
        ops.append((wire.RECV, recvs[frm], frm))
    for posted in wire.batch(ops, group, "expert all-to-all", kind=None):  # its payload: counted by the caller
        wire.wait(posted)
    return out


class ExpertParallelMoE(MoE):
    """MoE with E/W experts per rank of `group` (parameter names those of MoE: w1 is [E/W, h, ffn] here).
    The router is replicated: allreduce_router_grads sums its gradient over the group after backward.
    After a call, .sent and .received: the rows this rank sent to / received from each rank."""

    def __init__(self, hidden, ffn_hidden, num_experts, k=2, capacity_factor=None, group=None,
                 transport=p2p_all_to_all, device=None, dtype=None):
        W = dist.get_world_size(group)
        super().__init__(hidden, ffn_hidden, num_experts, k, capacity_factor, W, device, dtype)
        comm.agree("ExpertParallelMoE", (hidden, ffn_hidden, num_experts, k, capacity_factor), group)
        self.group = group
        self.transport = transport
        self.W = W
        self.local = num_experts // W  # experts on this rank

    def forward(self, x):
        """Route my tokens, send each kept row to its expert's rank, run my experts, bring the rows home."""
        comm.agree("ExpertParallelMoE.forward", (x.shape[-1], x.dtype), self.group)
        tokens, r = self.routing(x)
        rows, got, plan = dispatch(tokens, r, self.num_experts, self.group, self.transport)
        self.sent = plan.sent
        self.received = plan.received
        with trace.span("experts", rows=rows.shape[0]):                      # a slice of a trace (kit/trace.py)
            out = self.run_experts(rows, got)                                 # [sum(received), h]
        return combine(out, plan, r.weight, len(tokens), self.group, self.transport).view_as(x)

    def run_experts(self, rows, got):
        """Rows arrive by source rank, then by local expert (got[q, i] of them): regroup them by expert
        so each expert runs once, then put the outputs back in arrival order for the return trip."""
        expert = torch.arange(self.local, device=rows.device).repeat(self.W).repeat_interleave(got.flatten())
        order = expert.argsort(stable=True)
        return self.experts(rows[order], got.sum(0).tolist())[order.argsort()]


def allreduce_router_grads(moe, group=None) -> None:
    """Every rank routed its own tokens through its copy of the router: sum the gradients over the group
    (expert gradients already hold every rank's tokens: the rows came to them)."""
    for p in moe.parameters():
        if not hasattr(p, "ep_dim") and p.grad is not None:
            p.grad.copy_(comm.all_reduce(p.grad, group))


def _pairs(parallel, dense, group):
    """(shard, whole) of each parameter of the parallel layer and the dense one, the shapes checked."""
    full = dict(dense.named_parameters())
    W = dist.get_world_size(group)
    for name, p in parallel.named_parameters():
        want = (p.shape[0] * W, *p.shape[1:]) if hasattr(p, "ep_dim") else tuple(p.shape)
        if name not in full or tuple(full[name].shape) != want:
            raise ValueError(f"the dense layer's {name!r} must have shape {want} for a shard of shape "
                             f"{tuple(p.shape)}: build both with the same sizes")
        yield p, full[name]


@torch.no_grad()
def shard_from_dense(parallel, dense, group=None):
    """Copy `dense`'s router and this rank's E/W experts (same names) into `parallel`; return it."""
    for p, full in _pairs(parallel, dense, group):
        p.copy_(comm.split(full, 0, group) if hasattr(p, "ep_dim") else full)
    return parallel


@torch.no_grad()
def gather_to_dense(parallel, dense, group=None):
    """The inverse: all-gather the experts, and their gradients, into `dense` (the router is copied)."""
    for p, full in _pairs(parallel, dense, group):
        expert = hasattr(p, "ep_dim")  # every rank's E/W experts, along dim 0; the router: the same everywhere
        full.copy_(comm.all_gather(p, 0, group) if expert else p)
        full.grad = None if p.grad is None else (comm.all_gather(p.grad, 0, group) if expert else p.grad).clone()
    return dense


def parallel_like(dense, group=None, transport=p2p_all_to_all):
    """An ExpertParallelMoE holding dense's router and this rank's E/W experts."""
    moe = ExpertParallelMoE(dense.hidden, dense.ffn_hidden, dense.num_experts, dense.k, dense.capacity_factor,
                            group, transport, launch.device(), torch.float64)
    return shard_from_dense(moe, dense, group)


# ----- the check: the layer against the one-process MoE, and its bytes against the formula

def against_one_process(dense, transport, xs, dys, group=None):
    """My tokens through the parallel layer, every rank's through `dense` (one call, one group, per rank),
    loss = <y, dy> + aux. Returns the largest relative difference (outputs, aux, drops, input, router and
    expert gradients), the all-to-all bytes this rank sent, and the ledger's formula for them."""
    me = dist.get_rank(group)
    moe = parallel_like(dense, group, transport)
    x = xs[me].clone().requires_grad_()
    comm.COUNTER.reset()
    y = moe(x)
    ((y * dys[me]).sum() + moe.aux_loss).backward()
    nbytes = comm.COUNTER.bytes["all_to_all"]
    allreduce_router_grads(moe, group)
    ref = copy.deepcopy(dense)
    for q, (xq, dy) in enumerate(zip(xs, dys)):
        xq = xq.clone().requires_grad_()
        yq = ref(xq)
        ((yq * dy).sum() + ref.aux_loss).backward()
        if q == me:
            pairs = [(y, yq), (x.grad, xq.grad), (moe.aux_loss, ref.aux_loss),
                     (torch.tensor(moe.dropped + 0.0), torch.tensor(ref.dropped + 0.0))]  # cpu: two counts
    gathered = gather_to_dense(moe, copy.deepcopy(dense), group)
    pairs += [(p.grad, q.grad) for p, q in zip(gathered.parameters(), ref.parameters())]
    diff = max(((a - b).abs().max() / b.abs().max().clamp_min(1)).item() if b.numel() else 0.0 for a, b in pairs)
    off_rank = sum(moe.sent) - moe.sent[me] + sum(moe.received) - moe.received[me]
    return diff, nbytes, 2 * off_rank * dense.hidden * 8  # forward, then the same rows back in backward


# ----------------------------------------------------------------------------- demo

def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("--experts", type=int, default=8, help="E, spread E/W per rank")
    p.add_argument("--k", type=int, default=2, help="experts per token")
    p.add_argument("--hidden", type=int, default=16, help="h (each expert is h -> 2h -> h)")
    p.add_argument("--tokens", type=int, default=64, help="tokens on rank 0; rank r has tokens + 3r")
    p.add_argument("--capacity-factor", type=float, default=1.25)
    p.add_argument("--steps", type=int, default=30, help="Adam steps on skewed tokens, without and with aux")
    p.add_argument("--aux", type=float, default=0.1, help="weight of the auxiliary loss in the second run")
    p.add_argument("--seed", type=int, default=0)
    return p


def train(dense, alpha, args):
    """Adam steps on skewed tokens, task loss + alpha * aux. Then, on fresh tokens, summed over ranks:
    choices per expert, and [aux, choices dropped at capacity factors 1.0 and 1.25, expert rows] per rank."""
    h = dense.hidden
    moe = parallel_like(dense)
    teacher = skewed_tokens(h, h, args.seed + 1, 0) / h
    opt = torch.optim.Adam(moe.parameters(), lr=1e-2)
    for step in range(args.steps):
        x = skewed_tokens(args.tokens, h, args.seed, dist.get_rank(), step + 1)
        loss = ((moe(x) - torch.tanh(x @ teacher)) ** 2).mean() + alpha * moe.aux_loss
        opt.zero_grad()
        loss.backward()
        allreduce_router_grads(moe)
        opt.step()
    x = skewed_tokens(args.tokens, h, args.seed, dist.get_rank(), args.steps + 1)
    with torch.no_grad():
        moe(x)
        logits = moe.router(x)
        r = route(logits, dense.k)
        drops = [(~route(logits, dense.k, cf).keep).sum().item() for cf in (1.0, 1.25)]
    mine = torch.tensor([[r.aux.item(), *drops, sum(moe.received)]], dtype=torch.float64, device=launch.device())
    choices = comm.all_reduce(torch.bincount(r.expert.flatten(), minlength=dense.num_experts)).cpu()
    return choices, comm.all_gather(mine, 0).cpu()


def demo(args) -> int:
    W = launch.env_world_size()
    E = args.experts
    h = args.hidden
    launch.require(E % W == 0, f"--experts {E} is not divisible by {W} ranks: each rank holds E/W whole experts")
    launch.require(1 <= args.k <= E, f"--k must be between 1 and --experts ({E})")
    launch.require(min(h, args.tokens, args.steps + 1) >= 1 and args.capacity_factor > 0,
                   "--hidden and --tokens must be >= 1, --steps >= 0, --capacity-factor > 0")
    env = launch.setup(seed=args.seed)
    counts = [args.tokens + 3 * q for q in range(W)]
    dense = MoE(h, 2 * h, E, args.k, args.capacity_factor, device=env.device, dtype=torch.float64)
    xs = [skewed_tokens(n, h, args.seed, q) for q, n in enumerate(counts)]
    dys = [skewed_tokens(n, h, args.seed + 1, q) for q, n in enumerate(counts)]
    p2p, nbytes, want = against_one_process(dense, p2p_all_to_all, xs, dys)
    native, _, _ = against_one_process(dense, comm.all_to_all_single, xs, dys)
    ledger = comm.all_gather(torch.tensor([[nbytes, want]], device=env.device), 0).tolist()
    launch.print0(f"MoE: E={E} experts ({E // W} per rank), top-{args.k}, h={h}, ffn={2 * h}, capacity factor "
                  f"{args.capacity_factor:g}, fp64, {W} ranks holding {', '.join(map(str, counts))} tokens")
    launch.print0(f"  vs the same MoE in one process (outputs, aux, drops, input/router/expert grads): max relative "
                  f"diff {p2p:.1e} over p2p_all_to_all, {native:.1e} over dist.all_to_all_single")
    launch.print0(f"  all-to-all bytes each rank sent, fwd + bwd: {', '.join(f'{b:,}' for b, _ in ledger)} "
                  f"= 2(rows out + rows in)*h*8: {', '.join(f'{w:,}' for _, w in ledger)}")
    launch.print0(f"after {args.steps} Adam steps on skewed tokens, then fresh ones (all ranks together):\n  {'':18}"
                  f"{'choices per expert':<20}{'aux':>5}  {'busiest rank, % of rows':>23}  dropped at cf 1.0 / 1.25")
    aux = []
    for name, alpha in (("no aux loss", 0.0), (f"+ {args.aux:g} x aux", args.aux)):
        choices, ranks = train(dense, alpha, args)  # ranks: [W, 4]
        drop1, drop125 = (ranks[:, 1:3].sum(0) / choices.sum()).tolist()  # % of the choices
        busiest = ranks[:, 3].max() / ranks[:, 3].sum()  # the share of the expert rows on the busiest rank
        aux.append(ranks[:, 0].mean().item())
        launch.print0(f"  {name:<18}{measure.bars(choices.tolist(), choices.max().item(), E):<20}{aux[-1]:>5.2f}  "
                      f"{busiest:>22.0%}   {drop1:>6.0%} / {drop125:.0%}")
    launch.print0(f"  (balanced: aux 1.00, busiest rank {1 / W:.0%} of the rows, nothing dropped at cf 1.0)")
    figure_ok = all(b == w for b, w in ledger) and aux[1] < aux[0]
    return launch.conclude("expert_parallel", max(p2p, native) <= 1e-12, f"MoE = one process ({max(p2p, native):.0e})",
                           figure_ok, f"bytes = formula; aux {aux[0]:.2f} -> {aux[1]:.2f}")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
