"""ZeRO stages 1 and 2: each of K data-parallel ranks keeps the optimizer state (stage 1) and the averaged
gradient (stage 2) of only its 1/K of the parameters, and all ranks still take the same step as DDP.

Flatten the parameters into one vector, pad it to Psi = K*S elements, and give rank r the shard
[r*S, (r+1)*S) (Rajbhandari et al., 2020):

    flat    = [p_0 | p_1 | ... | p_n-1 | 0 padding]     K*S elements, S = ceil(N / K)
    shard r = flat[r*S : (r+1)*S]                       the only part rank r steps (and, in FSDP, stores)

Padding keeps the shards equal, which all-gather and reduce-scatter need; a parameter may fall into one
shard or be split between several. One step:

    ZeRO-1    all-reduce the gradient -> step my shard (Adam state for it alone) -> all-gather the shards
    ZeRO-2    reduce-scatter the gradient (rank r receives the mean of shard r only) -> step -> all-gather

fp32 Adam: 16N bytes per rank for DDP, 8N + 8N/K for ZeRO-1, 4N + 12N/K for ZeRO-2, and ZeRO-2 sends
exactly what DDP sends (mini_dist/zero_ledger.py measures both). The same layout, unit by unit, is how
FSDP stores parameters (mini_dist/flat_param.py); ZeroOptimizer (mini_dist/zero_optimizer.py) wraps
these steps as a torch.optim.Optimizer; checkpoints: mini_dist/sharded_state.py.

    torchrun --standalone --nproc_per_node=4 mini_dist/zero.py [--steps 3] [--widths 19 60 60]

Mirrors DeepSpeed's ZeRO stages 1 and 2 (flat, padded, equal shards, as here);
torch.distributed.optim.ZeroRedundancyOptimizer is stage 1 sharded by whole parameters.
"""
import sys
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

if not __package__:  # run as `torchrun mini_dist/zero.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist.kit import flags, launch, models
from mini_dist.kit.wire import collective
from mini_dist.ring_pipelined import ring_all_gather, ring_reduce_scatter


# ----------------------------------------------------------------------------- the layout


@dataclass(frozen=True)
class Partition:
    """Where each parameter sits in the flat vector, and which slice [lo, hi) of it each rank owns."""
    names: tuple
    shapes: tuple
    world_size: int

    @property
    def spans(self) -> list:
        """[a, b) of each parameter in the flat vector."""
        ends = list(accumulate(s.numel() for s in self.shapes))
        return [(end - s.numel(), end) for end, s in zip(ends, self.shapes)]

    @property
    def numel(self) -> int:
        return sum(s.numel() for s in self.shapes)

    @property
    def shard_size(self) -> int:
        return -(-self.numel // self.world_size)  # S = ceil(N / K)

    @property
    def padded_numel(self) -> int:
        return self.world_size * self.shard_size  # Psi: at most K-1 zeros of padding at the end

    def shard(self, rank: int) -> tuple:
        return rank * self.shard_size, (rank + 1) * self.shard_size

    def owned(self, rank: int) -> list:
        """Each parameter's span clamped to rank's shard, [a, b) in the flat vector (a == b: none of it)."""
        lo, hi = self.shard(rank)
        return [(min(max(a, lo), hi), min(max(b, lo), hi)) for a, b in self.spans]

    def pieces(self, rank: int) -> list:
        """(name, start, stop) of every parameter slice that falls into rank's shard, in its own elements."""
        return [(n, a - span[0], b - span[0])
                for n, span, (a, b) in zip(self.names, self.spans, self.owned(rank)) if b > a]

    def __str__(self) -> str:
        pad = self.padded_numel - self.numel
        lines = [f"partition of N = {self.numel:,} elements over K = {self.world_size} ranks: "
                 f"shard S = {self.shard_size:,}, padding {pad}"]
        for r in range(self.world_size):
            lo, hi = self.shard(r)
            tail = f" + {min(pad, hi - lo)} padding" if hi > self.numel else ""
            parts = " ".join(f"{n}[{a}:{b}]" for n, a, b in self.pieces(r))
            lines.append(f"  rank {r}: [{lo:,}, {hi:,}) {parts}{tail}")
        return "\n".join(lines)


def flatten_into_buffer(params: list, partition: Partition) -> torch.Tensor:
    """One padded flat vector; each parameter becomes a view of it: writing the vector updates the model."""
    flat = torch.zeros(partition.padded_numel, dtype=params[0].dtype, device=params[0].device)
    for p, (a, b) in zip(params, partition.spans):
        flat[a:b].copy_(p.detach().reshape(-1))
        p.data = flat[a:b].view_as(p)
    return flat


# ----------------------------------------------------------------------------- the step


def zero1_step(flat: torch.Tensor, grad: torch.Tensor, step_shard, group=None, collectives: str = "native"):
    """One ZeRO-1 step. flat: the parameters as one vector of K*S elements, the same on every rank; grad:
    this rank's gradient of it, divided by K; step_shard(shard, shard_grad) updates my S elements of flat
    in place, keeping optimizer state for them alone. Returns the mean gradient, whole (as DDP keeps it)."""
    # exercise: every rank returns the mean gradient, whole (K*S elements: the sum over the K ranks of their
    #   grad, each already divided by K), and flat ends the same on every rank: shard q (the q-th of K equal
    #   slices of flat) moved by one step_shard call, made on rank q alone, with a view of flat's shard q (so
    #   that the step lands in flat) and the mean gradient's shard q. Collectives: c = COLLECTIVES[collectives]
    #   (c.all_reduce(t, group) sums t over the ranks in place, c.all_gather(flat, group) fills each slice q of
    #   flat with rank q's). Judged exactly on integers, then against native DDP within fp64's rounding.
    c = COLLECTIVES[collectives]
    K = dist.get_world_size(group)
    r = dist.get_rank(group)
    S = flat.numel() // K
    mine = slice(r * S, (r + 1) * S)
    c.all_reduce(grad, group)              # (K*S,) the sum of the ranks' grad / K: the mean gradient
    step_shard(flat[mine], grad[mine])     # (S,) only my shard moves; its Adam state is all I keep
    c.all_gather(flat, group)              # (K*S,) shard q from rank q, for every q: the same model again
    return grad
    # end exercise


def zero2_step(flat: torch.Tensor, grad: torch.Tensor, step_shard, group=None, collectives: str = "native"):
    """ZeRO-2: the same step with a reduce-scatter for the all-reduce. Rank r receives the mean of its own
    shard only, so no rank ever holds the whole mean gradient. Returns that shard."""
    c = COLLECTIVES[collectives]
    K = dist.get_world_size(group)
    r = dist.get_rank(group)
    S = flat.numel() // K
    shard = c.reduce_scatter(grad, group)  # (S,) the mean of my shard; half an all-reduce's bytes
    step_shard(flat[r * S:(r + 1) * S], shard)
    c.all_gather(flat, group)              # the other half, spent on the parameters instead
    return shard


# ----------------------------------------------------------------------------- the collectives


def _my_shard(flat: torch.Tensor, group) -> torch.Tensor:  # (S,) a view of slice r of the K*S elements
    return flat.chunk(dist.get_world_size(group))[dist.get_rank(group)]


def _native_all_reduce(grad: torch.Tensor, group) -> None:
    with collective("all_reduce", grad.nbytes, group):  # counted in the kit's ledger, a slice of a trace
        dist.all_reduce(grad, group=group)


def _native_reduce_scatter(grad: torch.Tensor, group) -> torch.Tensor:
    with collective("reduce_scatter", grad.nbytes, group):
        if dist.get_backend(group) == "gloo":  # gloo's reduce_scatter is an all-reduce and a copy: same bits
            dist.all_reduce(grad, group=group)
            return _my_shard(grad, group).clone()
        shard = grad.new_empty(grad.numel() // dist.get_world_size(group))
        dist.reduce_scatter_single(shard, grad, group=group)
    return shard


def _native_all_gather(flat: torch.Tensor, group) -> None:
    # K broadcasts, each shard from its owner, as ZeroRedundancyOptimizer does: the bytes of
    # all_gather_single, which gloo runs slower (mini_dist/bench/data_parallel.py prints both)
    S = flat.numel() // dist.get_world_size(group)
    with collective("all_gather", flat.nbytes, group):
        works = [dist.broadcast(flat[q * S:(q + 1) * S], group=group, group_src=q, async_op=True)
                 for q in range(dist.get_world_size(group))]
        for work in works:
            work.wait()


def _ring_reduce_scatter(grad: torch.Tensor, group) -> torch.Tensor:
    shard = grad.new_empty(grad.numel() // dist.get_world_size(group))
    ring_reduce_scatter(shard, grad, group=group)
    return shard


def _ring_all_gather(flat: torch.Tensor, group) -> None:  # a copy: the input must not alias the output
    ring_all_gather(flat, _my_shard(flat, group).clone(), group=group)


def _ring_all_reduce(grad: torch.Tensor, group) -> None:  # reduce-scatter + all-gather: stage 2's bits
    _my_shard(grad, group).copy_(_ring_reduce_scatter(grad, group))
    _ring_all_gather(grad, group)


COLLECTIVES = {  # "ring": mini_dist/ring_pipelined.py, every byte counted in the kit's wire LEDGER
    "native": SimpleNamespace(all_reduce=_native_all_reduce, reduce_scatter=_native_reduce_scatter,
                              all_gather=_native_all_gather),
    "ring": SimpleNamespace(all_reduce=_ring_all_reduce, reduce_scatter=_ring_reduce_scatter,
                            all_gather=_ring_all_gather)}


# ----------------------------------------------------------------------------- demo

def parser():
    return flags.adam_check(launch.demo_parser(__doc__))


def sharded_adam(stage: int, widths: list, steps: int):
    """An MLP trained by zero1_step or zero2_step, torch.optim.Adam over my shard alone, on the batches of
    models.random_batch_steps. -> (model, Adam, partition, the last step's mean gradient)"""
    model = models.mlp(widths, torch.float64)
    named = list(model.named_parameters())
    partition = Partition(tuple(n for n, _ in named), tuple(p.shape for _, p in named), dist.get_world_size())
    flat = flatten_into_buffer([p for _, p in named], partition)
    lo, hi = partition.shard(dist.get_rank())
    shard = flat[lo:hi]  # the tensor Adam steps: my S elements of flat
    adam = torch.optim.Adam([shard], lr=1e-2)
    means = []

    def step_shard(own: torch.Tensor, own_grad: torch.Tensor) -> None:  # own: the same S elements as shard
        shard.grad = own_grad
        adam.step()

    def step() -> None:
        grad = torch.zeros_like(flat)  # the padding's gradient stays 0
        for p, (a, b) in zip(model.parameters(), partition.spans):
            grad[a:b] = p.grad.reshape(-1) / partition.world_size  # DDP's 1/K, on the way in
        means.append((zero1_step if stage == 1 else zero2_step)(flat, grad, step_shard))

    models.random_batch_steps(model, model, SimpleNamespace(zero_grad=model.zero_grad, step=step), steps)
    return model, adam, partition, means[-1]


def demo(args) -> int:
    from torch.nn.parallel import DistributedDataParallel as DDP
    launch.require(args.steps >= 1 and len(args.widths) >= 2 and min(args.widths) >= 1,
                   "--steps must be >= 1 and --widths two or more numbers >= 1")
    K = launch.setup().world_size
    ddp = models.mlp(args.widths, torch.float64)
    models.random_batch_steps(ddp, DDP(ddp), torch.optim.Adam(ddp.parameters(), lr=1e-2), args.steps)
    runs = {stage: sharded_adam(stage, args.widths, args.steps) for stage in (1, 2)}
    diff = {s: max((p - q).abs().max().item() for p, q in zip(m.parameters(), ddp.parameters()))
            for s, (m, *_) in runs.items()}
    worst = max(diff.values())  # fp64: only the order in which the K gradients are summed differs (~1e-16)
    _, adam, partition, _ = runs[1]
    state = sum(v.numel() for s in adam.state.values() for v in s.values() if v.dim() > 0)
    S = partition.shard_size
    N = partition.numel
    gradient = runs[2][3].numel()
    launch.print0(f"{partition}\n{args.steps} Adam steps, fp64, K = {K}; max |parameter difference| from native "
                  f"DDP + Adam: ZeRO-1 {diff[1]:.1e}, ZeRO-2 {diff[2]:.1e}\nper rank (rank 0): Adam state for "
                  f"{state:,} elements = 2S (DDP: 2N = {2 * N:,}); ZeRO-2 keeps a mean gradient of {gradient:,} "
                  f"elements = S (DDP, ZeRO-1: N = {N:,})")
    return launch.conclude("zero", worst <= 1e-12, f"ZeRO-1 and ZeRO-2 = DDP + Adam ({worst:.0e})",
                           state == 2 * S and gradient == S, "per rank: Adam state 2S, ZeRO-2 gradient S elements")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
