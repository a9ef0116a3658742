"""ZeroOptimizer: ZeRO's step (mini_dist/zero.py) as a torch.optim.Optimizer that wraps any element-wise one.

    model = ...                                                        # the same on every rank
    optimizer = ZeroOptimizer(model.named_parameters(), torch.optim.Adam, stage=2, lr=1e-3)
    loss.backward(); optimizer.step()                                  # no DDP wrapper: step() averages

Stage 0 is plain data parallelism (all-reduce, every rank steps everything), 1 shards the optimizer state
(zero1_step), 2 also the averaged gradient (zero2_step). Parameter groups, LR schedulers and half-precision
parameters (with fp32 master weights of the own shard) work as on torch.optim; the state is sharded, so
optimizer.state_dict() refuses and mini_dist/sharded_state.py gathers or saves it per shard.

    torchrun --standalone --nproc_per_node=4 mini_dist/zero_optimizer.py [--steps 3] [--widths 19 60 60]

Mirrors torch.distributed.optim.ZeroRedundancyOptimizer (stage 1, sharded by whole parameters) and
DeepSpeed's ZeRO stages 1 and 2 (flat, padded, equal shards, as here).
"""
import sys
from itertools import accumulate
from pathlib import Path

import torch
import torch.distributed as dist

if not __package__:  # run as `torchrun mini_dist/zero_optimizer.py`: Python put mini_dist/ on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist.kit import flags, launch, models, wire
from mini_dist.zero import COLLECTIVES, Partition, flatten_into_buffer, zero1_step, zero2_step


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
        self.stage = stage
        self.group = group
        self.collectives = collectives
        self.rank = dist.get_rank(group)
        world = dist.get_world_size(group)
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
        self.ranges = [(self._clip(a), self._clip(b)) for a, b in zip([0] + ends[:-1], ends)]
        self.slices = [self.master[a:b] for a, b in self.ranges]
        self.optimizer = optimizer_class([{**settings(g), "params": [s]} for g, s in zip(self.param_groups,
                                                                                        self.slices)], **defaults)
        self.defaults.update(self.optimizer.defaults)  # the inner optimizer's defaults: schedulers read them
        copy_settings(self.optimizer.param_groups, self.param_groups)
        self.grad = None  # the mean gradient kept after a step: whole (stages 0, 1) or my shard (2)

    def _clip(self, x: int) -> int:
        """A place in the flat vector -> its place in my slice [lo, hi), clamped to it."""
        return min(max(x, self.lo), self.hi) - self.lo

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
            grad = zero1_step(self.flat, grad, self._step_own, self.group, self.collectives)
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
    wire.call(dist.all_gather_object, everyone, (problem, *model), group=group)
    for r, (problem, *theirs) in enumerate(everyone):
        if problem:
            raise ValueError(f"rank {r}: {problem}")
        if tuple(theirs) != everyone[0][1:]:
            n0, p0, s0, g0 = everyone[0][1:]
            n, p, s, g = theirs
            raise ValueError(f"ranks disagree: rank 0 has {n0} elements in {p0} parameters (stage {s0}, "
                             f"groups {g0}), rank {r} has {n} in {p} (stage {s}, groups {g}); pass the "
                             f"same model, groups and stage")


# ----------------------------------------------------------------------------- demo


def parser():
    return flags.adam_check(launch.demo_parser(__doc__))


def demo(args) -> int:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP
    launch.require(args.steps >= 1 and len(args.widths) >= 2 and min(args.widths) >= 1,
                   "--steps must be >= 1 and --widths two or more numbers >= 1")
    K = launch.setup().world_size
    runs = {}
    for name in ("DDP + Adam", "DDP + ZeroRedundancyOptimizer", "ZeRO-0", "ZeRO-1", "ZeRO-2"):
        model = models.mlp(args.widths, torch.float64)  # the same model on every rank, each rank its own data
        forward = DDP(model) if name.startswith("DDP") else model
        if name == "DDP + Adam":
            optimizer = torch.optim.Adam(forward.parameters(), lr=1e-2)
        elif name.startswith("DDP"):
            optimizer = ZeroRedundancyOptimizer(forward.parameters(), torch.optim.Adam, lr=1e-2)
        else:
            optimizer = ZeroOptimizer(model.named_parameters(), torch.optim.Adam, stage=int(name[-1]), lr=1e-2)
        models.random_batch_steps(model, forward, optimizer, args.steps)
        runs[name] = (model, optimizer)
    reference = list(runs["DDP + Adam"][0].parameters())
    diff = {name: max((p - q).abs().max().item() for p, q in zip(model.parameters(), reference))
            for name, (model, _) in runs.items() if name != "DDP + Adam"}
    worst = max(diff.values())  # fp64: only the order in which the K gradients are summed differs (~1e-16)
    state = {s: sum(v.numel() for st in runs[f"ZeRO-{s}"][1].optimizer.state.values() for v in st.values()
                    if v.dim() > 0) for s in (0, 1, 2)}  # the elements of per-element state the inner Adam holds
    partition = runs["ZeRO-1"][1].partition
    launch.print0(f"{args.steps} Adam steps, fp64, K = {K}; max |parameter difference| from native DDP + Adam: "
                  + ", ".join(f"{n} {d:.1e}" for n, d in diff.items()) + "\nper rank (rank 0), elements of Adam "
                  f"state: " + ", ".join(f"ZeRO-{s} {n:,}" for s, n in state.items()) +
                  f" = 2 Psi, 2S, 2S (Psi = {partition.padded_numel:,}, S = {partition.shard_size:,})")
    want = [2 * partition.padded_numel, 2 * partition.shard_size, 2 * partition.shard_size]
    return launch.conclude("zero_optimizer", worst <= 1e-12, f"stages 0/1/2 = DDP and ZeroRedundancyOptimizer "
                           f"({worst:.0e})", list(state.values()) == want, "Adam state per rank: 2 Psi, 2S, 2S")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
