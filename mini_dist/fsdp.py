"""Fully sharded data parallel (ZeRO-3): a unit's parameters exist in full only while it computes.

DDP keeps the whole model on every rank; ZeRO stage 3 (Rajbhandari et al., 2020) shards the parameters
themselves. FSDP (Zhao et al., 2023) groups them into *units* -- by default each child block of the wrapped
module; the root takes what is left -- flattens each unit into one vector padded to K*S elements
(S = ceil(numel / K): ZeRO's layout, flat_param.py) and keeps only shard r on rank r. Around each unit:

    forward:   all-gather the unit -> run it -> free it
    backward:  all-gather it again -> backward -> reduce-scatter its gradient (rank r keeps shard r) -> free
    step:      any torch.optim optimizer, on this rank's slices of the parameters only

Backward needs the weights again (dL/dx = dL/dy W): gathering twice is the price of holding one unit at a
time (reshard_after_forward=False keeps them: one gather fewer, every unit alive at the turn). Per rank
per step, fp32 Adam, K ranks, N parameters (N' = the units' padded sizes K*S, summed), in bytes:

    memory   16N'/K (shards of params, grads, Adam state) + root + 1 unit gathered     vs DDP  16N
    traffic  all-gather + all-gather + reduce-scatter = 3 (K-1)/K 4N'                   vs DDP  2 (K-1)/K 4N

(beside DDP's: fsdp_ledger.py; each collective is counted in the wire's LEDGER under "fsdp", of which a ring sends
(K-1) S B; `ledger` keeps what each unit did and the full parameters' bytes alive). Naive (prefetch=False): a unit's
all-gather starts when it is needed; prefetch=True starts the next unit's (async_op) before this one computes,
forward and backward: hidden, for one unit more.

The module keeps its parameters under their own names: between computations each is this rank's slice, a 1-D
nn.Parameter of at most S elements (maybe 0) with its own .grad; while its unit computes, a view of the gathered
vector in its shape (FSDP1's use_orig_params=True; FSDP2 holds the slices as DTensors). model.named_parameters() is
model.module's, in its order: optimizers, clipping and loops work unchanged. model.state_dict() has the module's
keys with whole tensors on every rank; load_state_dict() takes one of any world size (FSDP1's FULL_STATE_DICT; the
sharded kind too: fsdp_state.py). ignored_params (say, the norms) stay whole and their gradients are averaged at the
end of backward, as DDP does; torch's fully_shard(ignored_params=...) leaves them each rank's own, for the user to
reduce. param_dtype= torch.bfloat16 gathers and computes in half while shards and gradients keep the parameters'
dtype; a policy per unit, wrap={Block: torch.bfloat16, nn.LayerNorm: torch.float32}, keeps norms in fp32.

    torchrun --standalone --nproc_per_node=4 mini_dist/fsdp.py [--depth 6 --width 256]

Mirrors torch.distributed.fsdp.fully_shard (FSDP2), with FSDP1's flat parameter per unit.
"""
import sys
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves

if not __package__:  # run as `torchrun mini_dist/fsdp.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist import flat_param, fsdp_state
from mini_dist.kit import debug, launch, measure, models, timing, trace, weakly, wire

BOOKED = "fsdp"  # the kind FSDP's all-gathers and reduce-scatters are counted under in the wire's LEDGER


class FullyShardedDataParallel(fsdp_state.StateDicts, nn.Module):
    """Wrap `module`. `wrap` names the units: None (each child), module classes, submodules, or a dict from
    those to a unit's param_dtype. The root unit keeps what is left, but `ignored_params`, which stay whole."""

    def __init__(self, module: nn.Module, wrap=None, group=None, reshard_after_forward: bool = True,
                 prefetch: bool = True, param_dtype: torch.dtype | None = None, ignored_params=None):
        super().__init__()
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        if self.rank < 0:
            raise ValueError("this rank is not in `group`: build FullyShardedDataParallel on its ranks only")
        self.module = module
        self.group = group
        self.reshard_after_forward = reshard_after_forward
        self.prefetch = prefetch
        self.ledger = measure.UnitLedger()
        self._finished = []
        left_out = set(ignored_params or ())  # torch's ignored_params (a set, or None)
        units = flat_param.pick_units(module, wrap, param_dtype)
        self.units, modules, initial = flat_param.flatten_units(module, units, self.rank, self.world, left_out)
        self.ignored = [p for p in module.parameters() if p in left_out]  # whole, in the module's order
        # rank 0's values win, as in DDP: its shards are scattered, the parameters left whole broadcast
        fsdp_state.load_full_state_dict(self.units, initial if self.rank == 0 else None, group, self.ignored)
        for unit, m in zip(self.units, modules):
            m.register_forward_pre_hook(partial(self._pre_forward, unit), with_kwargs=True)
            m.register_forward_hook(partial(self._post_forward, unit))
            if unit.full.requires_grad:
                unit.full.register_post_accumulate_grad_hook(weakly(self._reduce_scatter, unit))

    # ----- the idea: around each unit, gather just before it computes, free right after

    def _pre_forward(self, unit, module, args, kwargs):
        """Forward pre-hook: the unit's whole parameters must exist before it computes."""
        # exercise: on return the module computes on the whole unit: gathered (in self.units' order), views attached
        self._before_compute(unit, "forward", self.units)
        unit.attach_views()
        # end exercise
        return unit.cast((args, kwargs))

    def _post_forward(self, unit, module, args, output):
        """Forward hook: the module holds its slices again; the unit is freed (unless kept) till its backward."""
        # exercise: on return the module holds its slices again; the unit is noted finished (self._finished) and freed
        #   when resharding, and when no backward can come (grad disabled: nothing else would free it); and autograd
        #   will call self._pre_backward(unit) when a gradient first reaches one of the unit's outputs
        unit.attach_shards()
        self._finished.append(unit)
        if self.reshard_after_forward or not torch.is_grad_enabled():
            self._free(unit, "forward")
        needs_grad = [t for t in tree_leaves(output) if torch.is_tensor(t) and t.requires_grad]
        if needs_grad:  # fires when the first gradient reaches the unit's output: its backward is next
            torch.autograd.graph.register_multi_grad_hook(needs_grad, lambda _: self._pre_backward(unit), mode="any")
        # end exercise

    def _pre_backward(self, unit) -> None:
        """Before the unit's backward: dL/dx = dL/dy W needs the weights forward freed: gather them again."""
        # exercise: on return the unit is whole again (gathered, views attached), prefetching in backward's order
        self._before_compute(unit, "backward", self._finished[::-1])
        unit.attach_views()  # a checkpointed segment of the unit recomputes its forward now
        # end exercise

    def _reduce_scatter(self, unit, full: torch.Tensor) -> None:
        """Once autograd has put the unit's full gradient in full.grad: rank r keeps the average over
        ranks of shard r of it (SUM then / K: gloo has no AVG), in the shard's dtype; the unit goes."""
        grad = full.grad
        full.grad = None
        out = torch.empty(unit.shard_numel, dtype=grad.dtype, device=grad.device)
        self._collective(unit, "reduce-scatter of its gradient", partial(
            wire.call, dist.reduce_scatter_single, out, grad, group=self.group, book=(BOOKED, grad.nbytes)))
        self.ledger.record("backward", unit.name, "reduce-scatter", self.units)
        out = out.div_(self.world).to(unit.shard.dtype)
        for p, g in zip(unit.params, unit.pieces(out)):  # each slice's .grad: a view of the flat gradient
            p.grad = g if p.grad is None else p.grad.add_(g)
        self._free(unit, "backward")

    def _end_of_backward(self) -> None:
        """Free what no gradient reached (a frozen unit, an unused one, a prefetch that was not needed); the
        parameters left whole get the mean of the ranks' gradients, as in DDP (a rank without one adds 0)."""
        for unit in self.units:
            self._free(unit, "backward")
        for p in self.ignored:
            if p.requires_grad:
                grad = torch.zeros_like(p) if p.grad is None else p.grad
                wire.call(dist.all_reduce, grad, group=self.group, book=("all_reduce", grad.nbytes))
                p.grad = grad.div_(self.world)

    # ----- gathering, freeing and prefetching, each collective recorded in the ledger

    def _before_compute(self, unit, phase: str, order: list) -> None:
        """Gather the unit and wait; with prefetch, first start the gather of the unit after it in order."""
        self._gather(unit, phase)
        following = order[order.index(unit) + 1:] if unit in order else []
        if self.prefetch and following:
            self._gather(following[0], phase, wait=False)
        self.ledger.record(phase, unit.name, "compute", self.units)

    def _gather(self, unit, phase: str, wait: bool = True) -> None:
        """All-gather the unit's full vector into its re-allocated storage (left in flight unless wait)."""
        if not unit.gathered:
            full = unit.full
            full.untyped_storage().resize_(full.nbytes)
            shard = unit.shard.to(full.dtype)  # in param_dtype: half the bytes on the wire
            # .data: autograd saved views of `full` in forward and checks they were not rewritten in
            # place; we refill the very values they held, so the write must not bump the version.
            gather = partial(wire.call, dist.all_gather_single, full.data, shard, group=self.group, async_op=True,
                             book=(BOOKED, full.nbytes))
            unit.work = (self._collective(unit, f"all-gather for {phase}", gather), shard)
            self.ledger.record(phase, unit.name, "all-gather", self.units)
        if wait and unit.work is not None:
            self._collective(unit, f"all-gather for {phase}", unit.work[0].wait)
            unit.work = None

    def _free(self, unit, phase: str) -> None:
        unit.attach_shards()  # the module holds this rank's slices again
        if unit.gathered:
            self._gather(unit, phase)  # a prefetch still in flight must land before its buffer goes
            unit.full.untyped_storage().resize_(0)
            self.ledger.record(phase, unit.name, "free", self.units)

    def _collective(self, unit, what: str, run):
        """A rank that died or timed out surfaces here, often inside loss.backward(): say where we were."""
        try:
            with trace.span(f"{what}, unit {unit.name}", trace.COMM):  # a slice of the trace (kit/trace.py)
                return run()
        except RuntimeError as e:  # a rank that left quietly is named: torchrun would blame the first to fail
            cause = debug.lost_rank() or f"{e} (the first rank to fail says why in its own log)"
            raise RuntimeError(f"FSDP unit {unit.name!r}: {what} failed on rank {dist.get_rank()}: {cause}") from e

    # ----- the module's face: forward, its parameters (state dicts: fsdp_state.StateDicts)

    def forward(self, *args, **kwargs):
        self._finished = []  # the order units finish forward, reversed, is the order of their backward
        output = self.module(*args, **kwargs)
        needs_grad = [t for t in tree_leaves(output) if torch.is_tensor(t) and t.requires_grad]
        if needs_grad:  # backward starts here: queue its end (the engine's callback, as DDP's reducer does)
            torch.autograd.graph.register_multi_grad_hook(needs_grad, self._queue_end_of_backward, mode="any")
        return output

    def _queue_end_of_backward(self, grads) -> None:
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """The wrapped module's own parameters, names and order: sharded ones as this rank's slices."""
        return self.module.named_parameters(prefix, recurse, remove_duplicate)


# ----------------------------------------------------------------------------- demo

def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("--depth", type=int, default=6, help="Blocks, one unit each (the root keeps 2 Linears)")
    p.add_argument("--width", type=int, default=256, help="width of the timed model (Block hidden: 4x)")
    p.add_argument("--steps", type=int, default=3, help="fp64 Adam steps compared with fully_shard")
    p.add_argument("--repeats", type=int, default=5, help="timed steps per schedule (medians, in turns)")
    return p


def timeline(ledger, names: list[str]) -> str:
    """A row per unit, a column per event; '=' while the unit is gathered, '.' while only its shard is."""
    symbol = {"all-gather": "G", "compute": "C", "reduce-scatter": "R", "free": "F"}
    rows = {n: f"  {n:>5} " for n in names}
    alive = dict.fromkeys(names, False)
    for i, (phase, unit, what, *_) in enumerate(ledger.events):
        if i and phase != ledger.events[i - 1][0]:
            rows = {n: r + "|" for n, r in rows.items()}
        alive[unit] = what != "free" and (alive[unit] or what == "all-gather")
        for n in names:
            rows[n] += symbol[what] if n == unit else "=" if alive[n] else "."
    return "\n".join(rows.values())


def demo(args) -> int:
    launch.require(min(args.depth - 1, args.width, args.steps, args.repeats) >= 1,
                   "--depth must be at least 2 (prefetch needs a next unit); --width, --steps, --repeats >= 1")
    env = launch.setup()
    K = env.world_size
    say = launch.print0
    g = torch.Generator().manual_seed(env.rank)
    data = [torch.randn(2, 4, 6, generator=g, dtype=torch.float64).to(env.device) for _ in range(args.steps)]
    ours = FullyShardedDataParallel(models.block_stack(6, 10, 3, torch.float64, env.device), wrap=models.Block)
    native = models.fully_shard_blocks(models.block_stack(6, 10, 3, torch.float64, env.device))
    adams = [torch.optim.Adam(m.parameters(), lr=0.01) for m in (ours, native)]
    losses = [[models.regression_step(m, adam, x, y) for x, y in data] for m, adam in zip((ours, native), adams)]
    state = ours.state_dict()  # the module's keys, whole tensors, on every rank
    worst = max([abs(a - b) for a, b in zip(*losses)] +
                [(state[n] - p.full_tensor()).abs().max().item() for n, p in native.named_parameters()])
    allowed = 0.0 if K <= 2 else 1e-14  # 2 numbers add alike in any order; gloo adds 3+ in a layout's order
    weight = ours.module[1].up.weight  # between steps: this rank's slice, the very tensor Adam steps
    stepped = any(weight is p for p in adams[0].param_groups[0]["params"])
    say(f"vs fully_shard (FSDP2), fp64 Adam, {args.steps} steps, K = {K}: max |diff| of losses and parameters "
        f"{worst:.1e} (allowed {allowed:g})\nbetween steps ours.module[1].up.weight is rank 0's slice, shape "
        f"{tuple(weight.shape)}, {'the' if stepped else 'NOT the'} tensor Adam steps; ours.state_dict() holds "
        f"it whole, {tuple(state['1.up.weight'].shape)}, under the module's own key '1.up.weight'")
    x, y = (torch.randn(16, args.width, generator=g).to(env.device) for _ in range(2))
    kinds = {"naive": dict(prefetch=False), "prefetch": {}, "kept": dict(reshard_after_forward=False)}
    stack = partial(models.block_stack, args.width, 4 * args.width, args.depth, torch.float32, env.device)
    fsdps = {k: FullyShardedDataParallel(stack(), wrap=models.Block, **o) for k, o in kinds.items()}
    steps = {k: partial(models.regression_step, m, torch.optim.Adam(m.parameters(), lr=1e-4), x, y)
             for k, m in fsdps.items()}
    seconds = {k: timing.median(t) for k, t in timing.paired(steps, args.repeats).items()}
    sent_by = {k: measure.step_sent(steps[k], m.ledger, BOOKED, K) for k, m in fsdps.items()}  # the step shown
    units = fsdps["naive"].units
    full = [u.full.nbytes for u in units]  # the root first
    shards = sum(u.shard.nbytes for u in units)
    formula = {"naive": ("root + 1 unit", full[0] + max(full[1:])), "kept": ("every unit", sum(full)),
               "prefetch": ("root + 2 units", full[0] + max(a + b for a, b in zip(full[1:], full[2:])))}
    sent = {k: (2 if k == "kept" else 3) * (K - 1) * shards for k in fsdps}  # 3(K-1)/K 4N', kept 2
    say("one step on rank 0 (G all-gather, C compute, R reduce-scatter, F free; = gathered, . shard only)")
    for k in ("naive", "prefetch"):
        say(f" {k}:\n{timeline(fsdps[k].ledger, [u.name for u in units])}")
    say(f"\nper rank, rank 0 shown (params, grads and Adam state beside DDP's: ./run.sh demo fsdp_ledger)\n"
        f"{'':24}{'gathers':>8} {'gathered params, peak = formula':>40} {'sent per step':>16} {'step':>9}")
    for k, m in fsdps.items():
        say(f"{k:24}{m.ledger.count('all-gather', units[1].name):>8} {m.ledger.peak:>14,} B = {formula[k][0]:16}"
            f"{sent_by[k]:>14,} B {seconds[k] * 1e3:6.1f} ms")
    figure_ok = all(m.ledger.peak == formula[k][1] and sent_by[k] == sent[k] and m.ledger.gathered == 0
                    for k, m in fsdps.items())
    return launch.conclude("fsdp", worst <= allowed and stepped, f"= fully_shard (max diff {worst:.0e})",
                           figure_ok, f"gathered peak root + 2 units = {formula['prefetch'][1]:,} B (naive root + "
                           f"1 unit: {formula['naive'][1]:,} B); sent 3(K-1)/K 4N' = {sent['prefetch']:,} B per rank")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
