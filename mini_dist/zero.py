"""ZeRO stages 1 and 2: each of K data-parallel ranks keeps the optimizer state (stage 1) and the averaged
gradient (stage 2) of only its 1/K of the parameters, and all ranks still take the same step as DDP.

Flatten the parameters into one vector, pad it to Psi = K*S elements, and give rank r the shard
[r*S, (r+1)*S) (Rajbhandari et al., 2020). One step:

    ZeRO-1    all-reduce the gradient -> step my shard (Adam state for it alone) -> all-gather the shards
    ZeRO-2    reduce-scatter the gradient (rank r receives the mean of shard r only) -> step -> all-gather

fp32 Adam: 16N bytes per rank for DDP, 8N + 8N/K for ZeRO-1, 4N + 12N/K for ZeRO-2, and ZeRO-2 sends
exactly what DDP sends (mini_dist/zero_ledger.py measures both). Checkpoints: mini_dist/sharded_state.py.

    torchrun --standalone --nproc_per_node=4 mini_dist/zero.py [--steps 3] [--widths 19 60 60]

Mirrors torch.distributed.optim.ZeroRedundancyOptimizer (stage 1, sharded by whole parameters) and
DeepSpeed's ZeRO stages 1 and 2 (flat, padded, equal shards, as here).
"""
import sys
from itertools import accumulate
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

if not __package__:  # run as `torchrun mini_dist/zero.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist.flat_param import Partition, flatten_into_buffer
from mini_dist.kit import launch, models, wire
from mini_dist.ring_pipelined import ring_all_gather, ring_reduce_scatter

def zero1_step(flat: torch.Tensor, grad: torch.Tensor, step_shard, group=None, collectives: str = "native"):
    """One ZeRO-1 step. flat: the parameters as one vector of K*S elements, the same on every rank; grad:
    this rank's gradient of it, divided by K; step_shard(shard, shard_grad) updates my S elements of flat
    in place, keeping optimizer state for them alone. Returns the mean gradient, whole (as DDP keeps it)."""
    # exercise: all-reduce grad, step_shard(my slice [r*S, (r+1)*S) of flat, of grad), all-gather the slices
    c = COLLECTIVES[collectives]
    K, r = dist.get_world_size(group), dist.get_rank(group)
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
    K, r = dist.get_world_size(group), dist.get_rank(group)
    S = flat.numel() // K
    shard = c.reduce_scatter(grad, group)  # (S,) the mean of my shard; half an all-reduce's bytes
    step_shard(flat[r * S:(r + 1) * S], shard)
    c.all_gather(flat, group)              # the other half, spent on the parameters instead
    return shard


# ----------------------------------------------------------------------------- the collectives


def _my_shard(flat: torch.Tensor, group) -> torch.Tensor:  # (S,) a view of slice r of the K*S elements
    return flat.chunk(dist.get_world_size(group))[dist.get_rank(group)]


def _native_reduce_scatter(grad: torch.Tensor, group) -> torch.Tensor:
    if dist.get_backend(group) == "gloo":  # gloo's reduce_scatter is an all-reduce and a copy: same bits
        wire.call(dist.all_reduce, grad, group=group)
        return _my_shard(grad, group).clone()
    shard = grad.new_empty(grad.numel() // dist.get_world_size(group))
    wire.call(dist.reduce_scatter_single, shard, grad, group=group)
    return shard


def _native_all_gather(flat: torch.Tensor, group) -> None:
    # K broadcasts, each shard from its owner, as ZeroRedundancyOptimizer does: the bytes of
    # all_gather_single, which gloo runs slower (mini_dist/bench/data_parallel.py prints both)
    S = flat.numel() // dist.get_world_size(group)
    works = [wire.call(dist.broadcast, flat[q * S:(q + 1) * S], group=group, group_src=q, async_op=True)
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
    "native": SimpleNamespace(all_reduce=lambda grad, group: wire.call(dist.all_reduce, grad, group=group),
                              reduce_scatter=_native_reduce_scatter, all_gather=_native_all_gather),
    "ring": SimpleNamespace(all_reduce=_ring_all_reduce, reduce_scatter=_ring_reduce_scatter,
                            all_gather=_ring_all_gather)}


# ----------------------------------------------------------------------------- the optimizer


def settings(group: dict) -> dict:
    """A param group's settings (lr, betas, ...): everything but the parameters themselves."""
    return {k: v for k, v in group.items() if k not in ("params", "param_names")}


def copy_settings(src: list, dst: list) -> None:
    for s, d in zip(src, dst):
        d.update(settings(s))


class ZeroOptimizer(torch.optim.Optimizer):
    """Any element-wise torch.optim optimizer (SGD, Adam, AdamW, ...), sharded: stage 0 = plain data
    parallel, 1 shards its state (zero1_step), 2 also the gradients (zero2_step). A torch.optim.Optimizer
    itself: parameter groups and LR schedulers work, as with ZeroRedundancyOptimizer.

    The parameters that require grad (one dtype and device) become views of one flat padded vector, group
    after group: each rank's shard is one slice of it, and the updated shards are gathered straight into
    the model. Replacing a parameter's .data later (model.to(...)) would detach it, so step() refuses it.
    Half-precision parameters get an fp32 master copy of the own shard, which the optimizer steps. A
    missing gradient counts as zeros. collectives: "native" (torch.distributed) or "ring". Wrap the bare
    model, not a DDP one. Stage 2 frees the full gradients once backward has made them all (real ZeRO-2
    reduce-scatters bucket by bucket during backward).
    """

    def __init__(self, params, optimizer_class, stage: int = 1, group=None, collectives: str = "native",
                 **defaults):
        super().__init__(params, defaults)
        if dist.get_rank(group) < 0:
            raise ValueError("this rank is not in `group`: create the ZeroOptimizer only on its ranks")
        self.stage, self.group, self.collectives = stage, group, collectives
        self.rank, world = dist.get_rank(group), dist.get_world_size(group)
        named = [(n, p) for g in self.param_groups
                 for n, p in zip(g.get("param_names") or [None] * len(g["params"]), g["params"])]
        named = [(n or f"p{i}", p) for i, (n, p) in enumerate(named) if p.requires_grad]
        self.params = [p for _, p in named]
        sizes = [sum(p.numel() for p in g["params"] if p.requires_grad) for g in self.param_groups]
        _agree(self.params, stage, collectives, (sum(sizes), len(named), stage, sizes), group)
        self.partition = Partition(tuple(n for n, _ in named), tuple(p.shape for p in self.params), world)
        self.span = dict(zip(self.params, self.partition.spans))
        self.flat = flatten_into_buffer(self.params, self.partition)
        self.lo, self.hi = (0, self.partition.padded_numel) if stage == 0 else self.partition.shard(self.rank)
        own = self.flat[self.lo:self.hi]
        self.has_master = own.dtype in (torch.float16, torch.bfloat16)  # fp32 master weights of the shard
        self.master = own.float() if self.has_master else own
        # Each group is one stretch of the flat vector (the padding joins the last): its part of my shard
        # is one slice, which the inner optimizer steps with the group's settings.
        ends = [*accumulate(sizes)][:-1] + [self.partition.padded_numel]
        clip = lambda x: min(max(x, self.lo), self.hi) - self.lo
        self.ranges = [(clip(a), clip(b)) for a, b in zip([0] + ends[:-1], ends)]
        self.slices = [self.master[a:b] for a, b in self.ranges]
        self.optimizer = optimizer_class([{**settings(g), "params": [s]} for g, s in zip(self.param_groups,
                                                                                        self.slices)], **defaults)
        self.defaults.update(self.optimizer.defaults)  # the inner optimizer's defaults: schedulers read them
        copy_settings(self.optimizer.param_groups, self.param_groups)
        self.grad = None  # the mean gradient kept after a step: whole (stages 0, 1) or my shard (2)

    def add_param_group(self, param_group: dict) -> None:
        if hasattr(self, "partition"):  # torch.optim.Optimizer's constructor calls this for every group
            raise RuntimeError("ZeroOptimizer cannot add a param group after construction: every rank's "
                               "shard would move; build a new ZeroOptimizer over all the groups")
        super().add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self.grad = None

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad = self._flat_gradient()
        if self.stage == 0:  # DDP: every rank steps every element
            COLLECTIVES[self.collectives].all_reduce(grad, self.group)
            self._step_own(self.flat, grad)
        elif self.stage == 1:
            zero1_step(self.flat, grad, self._step_own, self.group, self.collectives)
        else:
            self.grad = zero2_step(self.flat, grad, self._step_own, self.group, self.collectives)
        for p, (a, b) in zip(self.params, self.partition.spans):  # ZeRO-2 keeps no full gradient
            p.grad = grad[a:b].view_as(p) if self.stage < 2 else None
        if self.stage < 2:
            self.grad = grad[self.lo:self.hi]
        return loss

    def _flat_gradient(self) -> torch.Tensor:
        """This rank's gradients side by side in one padded vector, divided by K on the way in as DDP does
        (a sum of K gradients then cannot overflow); a missing gradient counts as zeros."""
        grad = torch.empty_like(self.flat)  # every element written below: no separate pass of zeros
        grad[self.partition.numel:].zero_()  # the padding
        for name, p, (a, b) in zip(self.partition.names, self.params, self.partition.spans):
            if p.untyped_storage().data_ptr() != self.flat.untyped_storage().data_ptr():
                raise RuntimeError(f"parameter {name}'s .data was replaced after the ZeroOptimizer was built: "
                                   f"it no longer lives in the flat vector that the optimizer steps; cast or "
                                   f"move the model first, then build the optimizer")
            if p.grad is None:
                grad[a:b].zero_()
            else:
                torch.mul(p.grad.reshape(-1), 1.0 / self.partition.world_size, out=grad[a:b])
        return grad

    def _step_own(self, own: torch.Tensor, grad: torch.Tensor) -> None:
        """The inner optimizer steps my slice `own` of the flat vector with `grad`, my slice of the mean."""
        grad = grad.to(self.master.dtype)  # a copy only for half params (fp32 master)
        for s, (a, b) in zip(self.slices, self.ranges):
            s.grad = grad[a:b]
        copy_settings(self.param_groups, self.optimizer.param_groups)  # an LR scheduler's changes
        self.optimizer.step()
        copy_settings(self.optimizer.param_groups, self.param_groups)
        for s in self.slices:
            s.grad = None
        if self.has_master:
            own.copy_(self.master)

    def state_dict(self):  # torch.optim's would hold none of the shards' state: say where it is instead
        raise RuntimeError(SHARDED)

    def load_state_dict(self, state_dict) -> None:
        raise RuntimeError(SHARDED)


SHARDED = ("a ZeroOptimizer's state is sharded over the ranks: mini_dist.sharded_state's consolidated_state_dict"
           "(optimizer, to) and load_consolidated_state_dict(optimizer, state, src) gather it and cut it again")


def _agree(params: list, stage: int, collectives: str, model: tuple, group) -> None:
    """Every rank learns every rank's problems and model size first, so all raise together and none hangs."""
    problem = (f"stage must be 0 (DDP), 1 (shard optimizer state) or 2 (also gradients), got {stage}"
               if stage not in (0, 1, 2) else f"collectives must be 'native' or 'ring', got {collectives!r}"
               if collectives not in COLLECTIVES else f"need parameters that require grad, all of one dtype and "
               f"device; got {sorted({f'{p.dtype}/{p.device}' for p in params})}"
               if not params or len({(p.dtype, p.device) for p in params}) > 1 else None)
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (problem, *model), group=group)
    for r, (problem, *theirs) in enumerate(everyone):
        if problem:
            raise ValueError(f"rank {r}: {problem}")
        if tuple(theirs) != everyone[0][1:]:
            (n0, p0, s0, g0), (n, p, s, g) = everyone[0][1:], theirs
            raise ValueError(f"ranks disagree: rank 0 has {n0} elements in {p0} parameters (stage {s0}, "
                             f"groups {g0}), rank {r} has {n} in {p} (stage {s}, groups {g}); pass the "
                             f"same model, groups and stage")


# ----------------------------------------------------------------------------- demo


def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("--steps", type=int, default=3, help="Adam steps of the equivalence check (fp64)")
    p.add_argument("--widths", type=int, nargs="+", default=[19, 60, 60],
                   help="MLP widths; the default's N = 4,860 divides by K = 1..5: no padding")
    return p


def demo(args) -> int:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP
    launch.require(args.steps >= 1 and len(args.widths) >= 2 and min(args.widths) >= 1,
                   "--steps must be >= 1 and --widths two or more numbers >= 1")
    k, w, adam, runs = launch.setup().world_size, args.widths, torch.optim.Adam, {}
    make = {"DDP + Adam": lambda m, f: adam(f.parameters(), lr=1e-2),
            "DDP + ZeroRedundancyOptimizer": lambda m, f: ZeroRedundancyOptimizer(f.parameters(), adam, lr=1e-2)}
    make |= {f"ZeRO-{s}": lambda m, f, s=s: ZeroOptimizer(m.named_parameters(), adam, stage=s, lr=1e-2)
             for s in (0, 1, 2)}
    for name, optimizer in make.items():  # the same model on every rank, each rank its own data
        model = models.mlp(w, torch.float64).to(launch.device())
        forward = DDP(model) if name.startswith("DDP") else model
        runs[name] = (model, forward, optimizer(model, forward))
        models.random_batch_steps(*runs[name], args.steps)
    diff = {name: max((p - q).abs().max().item() for p, q in zip(runs[name][0].parameters(),
                                                                  runs["DDP + Adam"][0].parameters()))
            for name in runs if name != "DDP + Adam"}
    worst = max(diff.values())  # fp64: only the order in which the K gradients are summed differs (~1e-16)
    opt, grad = runs["ZeRO-1"][2], runs["ZeRO-2"][2].grad
    state = sum(v.numel() for v in opt.optimizer.state[opt.slices[0]].values() if v.dim() > 0)
    S, N = opt.partition.shard_size, opt.partition.numel
    launch.print0(f"{opt.partition}\n{args.steps} Adam steps, fp64, K = {k}; max |parameter difference| from native "
                  f"DDP + Adam: " + ", ".join(f"{n} {d:.1e}" for n, d in diff.items()) +
                  f"\nper rank (rank 0): Adam state for {state:,} elements = 2S (DDP: 2N = {2 * N:,}); ZeRO-2 keeps "
                  f"a mean gradient of {grad.numel():,} elements = S (DDP, ZeRO-1: N = {N:,})")
    return launch.conclude("zero", worst <= 1e-12, f"stages 0/1/2 = DDP and ZeroRedundancyOptimizer ({worst:.0e})",
                           state == 2 * S and grad.numel() == S, "per rank: Adam state 2S, ZeRO-2 gradient S elements")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
