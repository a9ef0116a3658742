"""Fully sharded data parallel (ZeRO-3): a unit's parameters exist in full only while it computes.

DDP keeps the whole model on every rank; ZeRO stage 3 (Rajbhandari et al., 2020) shards the parameters
themselves. FSDP (Zhao et al., 2023) groups them into *units* -- by default each child block of the wrapped
module; the root takes what is left -- flattens each unit into one vector padded to K*S elements
(S = ceil(numel / K)) and keeps only shard r on rank r. Around each unit:

    forward:   all-gather the unit -> run it -> free it
    backward:  all-gather it again -> backward -> reduce-scatter its gradient (rank r keeps shard r) -> free
    step:      any torch.optim optimizer, on this rank's slices of the parameters only

Backward needs the weights again (dL/dx = dL/dy W): gathering twice is the price of holding one unit at a
time (reshard_after_forward=False keeps them: one gather fewer, every unit alive at the turn). Per rank
per step, fp32 Adam, K ranks, N parameters (N' = the units' padded sizes K*S, summed), in bytes:

    memory   16N'/K (shards of params, grads, Adam state) + root + 1 unit gathered     vs DDP  16N
    traffic  all-gather + all-gather + reduce-scatter = 3 (K-1)/K 4N'                   vs DDP  2 (K-1)/K 4N

(both measured beside DDP's: mini_dist/fsdp_ledger.py).

Naive (prefetch=False): a unit's all-gather starts when the unit is needed, and compute waits for it.
Optimized (prefetch=True): the next unit's all-gather starts (async) before the current unit computes, in
forward and in backward order, so communication hides behind compute for the price of one more unit.

named_parameters() yields the module's own names, each bound to this rank's slice of that parameter (a
1-D view of the shard, see flat_param.py) with its own .grad: optimizers, clipping and loops over
parameters work unchanged. Mixed precision is a policy per unit, as one fully_shard call per unit:
param_dtype=torch.bfloat16 (or torch.float16, which may need loss scaling: mixed_precision.py) gathers
and computes in half while shards and gradients keep the parameters' dtype; wrap={Block: torch.bfloat16,
nn.LayerNorm: torch.float32} keeps norms in fp32. A unit casts its floating inputs to its param_dtype.
State dicts: full_state_dict(to=rank, or None for every rank); sharded_state_dict() for checkpoints.

`ledger` records each collective with the bytes a bandwidth-optimal ring sends, (K-1) S B, and the bytes of
full parameters alive (read from the storages), with their peak. The collectives are torch's own
all_gather_single and reduce_scatter_single: prefetch needs async_op to overlap a gather with compute.

    torchrun --standalone --nproc_per_node=4 mini_dist/fsdp.py [--depth 6 --width 256]

Mirrors torch.distributed.fsdp.fully_shard (FSDP2), with FSDP1's flat parameter per unit.
"""
import sys
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

if not __package__:  # run as `torchrun mini_dist/fsdp.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist import flat_param
from mini_dist.kit import debug, launch, models, timing, weakly, wire


class FullyShardedDataParallel(nn.Module):
    """Wrap `module`. `wrap` names the units: None (each child of `module`), module classes, submodules,
    or a dict from those to the unit's own param_dtype. The root unit keeps the parameters left over."""

    def __init__(self, module: nn.Module, wrap=None, group=None, reshard_after_forward: bool = True,
                 prefetch: bool = True, param_dtype: torch.dtype | None = None):
        super().__init__()
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        if self.rank < 0:
            raise ValueError("this rank is not in `group`: build FullyShardedDataParallel on its ranks only")
        self.module, self.group = module, group
        self.reshard_after_forward, self.prefetch = reshard_after_forward, prefetch
        self.ledger, self._finished, self._callback_queued = Ledger(), [], False
        units = flat_param.pick_units(module, wrap, param_dtype)
        self.units, modules, initial = flat_param.flatten_units(module, units, self.rank, self.world)
        self.load_full_state_dict(initial if self.rank == 0 else None)  # rank 0's values win, as in DDP
        for unit, m in zip(self.units, modules):
            m.register_forward_pre_hook(partial(self._pre_forward, unit), with_kwargs=True)
            m.register_forward_hook(partial(self._post_forward, unit))
            if unit.full.requires_grad:
                unit.full.register_post_accumulate_grad_hook(weakly(self._reduce_scatter, unit))

    # ----- the idea: around each unit, gather just before it computes, free right after

    def _pre_forward(self, unit, module, args, kwargs):
        """Forward pre-hook: the unit's whole parameters must exist before it computes."""
        # exercise: gather the unit (_before_compute, in forward order self.units), then attach_views()
        self._before_compute(unit, "forward", self.units)
        unit.attach_views()
        # end exercise
        cast = lambda t: t.to(unit.param_dtype) if torch.is_tensor(t) and t.is_floating_point() else t
        return tree_map(cast, (args, kwargs)) if unit.param_dtype is not None else (args, kwargs)

    def _post_forward(self, unit, module, args, output):
        """Forward hook: free the unit (unless kept for backward); its backward gathers it again."""
        # exercise: note the unit finished; free it if resharding; hook _pre_backward on its grad-needing outputs
        self._finished.append(unit)
        if self.reshard_after_forward or not torch.is_grad_enabled():
            self._free(unit, "forward")
        needs_grad = [t for t in tree_leaves(output) if torch.is_tensor(t) and t.requires_grad]
        if needs_grad:  # fires when the first gradient reaches the unit's output: its backward is next
            torch.autograd.graph.register_multi_grad_hook(needs_grad, lambda _: self._pre_backward(unit),
                                                          mode="any")
        # end exercise

    def _pre_backward(self, unit) -> None:
        """Before the unit's backward: dL/dx = dL/dy W needs the weights forward freed: gather them again."""
        if not self._callback_queued:  # the engine's end-of-backward hook (DDP's reducer uses it too)
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        # exercise: gather the unit again, in backward order (the units that finished forward, reversed)
        self._before_compute(unit, "backward", self._finished[::-1])
        # end exercise

    def _reduce_scatter(self, unit, full: torch.Tensor) -> None:
        """Once autograd has put the unit's full gradient in full.grad: rank r keeps the average over
        ranks of shard r of it (SUM then / K: gloo has no AVG), in the shard's dtype; the unit goes."""
        grad, full.grad = full.grad, None
        out = torch.empty(unit.shard_numel, dtype=grad.dtype, device=grad.device)
        self._collective(unit, "reduce-scatter of its gradient",
                         lambda: wire.call(dist.reduce_scatter_single, out, grad, group=self.group))
        self._record("backward", unit, "reduce-scatter", out)
        out = out.div_(self.world).to(unit.shard.dtype)
        for p, g in zip(unit.params, unit.pieces(out)):  # each slice's .grad: a view of the flat gradient
            p.grad = g if p.grad is None else p.grad.add_(g)
        self._free(unit, "backward")

    # ----- gathering, freeing and prefetching, each collective recorded in the ledger

    def _before_compute(self, unit, phase: str, order: list) -> None:
        """Gather the unit and wait; with prefetch, first start the gather of the unit after it in order."""
        self._gather(unit, phase)
        following = order[order.index(unit) + 1:] if unit in order else []
        if self.prefetch and following:
            self._gather(following[0], phase, wait=False)
        self._record(phase, unit, "compute")

    def _gather(self, unit, phase: str, wait: bool = True) -> None:
        """All-gather the unit's full vector into its re-allocated storage (left in flight unless wait)."""
        if not unit.gathered:
            full = unit.full
            full.untyped_storage().resize_(full.nbytes)
            shard = unit.shard.to(full.dtype)  # in param_dtype: half the bytes on the wire
            # .data: autograd saved views of `full` in forward and checks they were not rewritten in
            # place; we refill the very values they held, so the write must not bump the version.
            unit.work = (self._collective(unit, f"all-gather for {phase}", lambda: wire.call(
                dist.all_gather_single, full.data, shard, group=self.group, async_op=True)), shard)
            self._record(phase, unit, "all-gather", shard)
        if wait and unit.work is not None:
            self._collective(unit, f"all-gather for {phase}", unit.work[0].wait)
            unit.work = None

    def _free(self, unit, phase: str) -> None:
        if unit.gathered:
            self._gather(unit, phase)  # a prefetch still in flight must land before its buffer goes
            unit.full.untyped_storage().resize_(0)
            self._record(phase, unit, "free")

    def _collective(self, unit, what: str, run):
        """A rank that died or timed out surfaces here, often inside loss.backward(): say where we were."""
        try:
            return run()
        except RuntimeError as e:  # a rank that left quietly is named: torchrun would blame the first to fail
            cause = debug.lost_rank() or f"{e} (the first rank to fail says why in its own log)"
            raise RuntimeError(f"FSDP unit {unit.name!r}: {what} failed on rank {dist.get_rank()}: {cause}") from e

    def _record(self, phase: str, unit, what: str, piece: torch.Tensor | None = None) -> None:
        sent = 0 if piece is None else (self.world - 1) * piece.nbytes  # a ring sends K-1 pieces of a shard
        gathered = sum(u.full.untyped_storage().nbytes() for u in self.units)
        self.ledger.record(phase, unit.name, what, sent, gathered)

    def _end_of_backward(self) -> None:
        """Free what no gradient reached (a frozen unit, an unused one, a prefetch that was not needed)."""
        self._callback_queued = False
        for unit in self.units:
            self._free(unit, "backward")

    # ----- the module's face: forward, its parameters (this rank's slices), state dicts

    def forward(self, *args, **kwargs):
        self._finished = []  # the order units finish forward, reversed, is the order of their backward
        return self.module(*args, **kwargs)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """The wrapped module's names, each bound to this rank's slice of that parameter (see the top)."""
        for unit in self.units:
            yield from ((f"{prefix}.{n}" if prefix else n, p) for n, p in zip(unit.names, unit.params))

    def full_state_dict(self, to: int | None = 0) -> dict:
        """Collective: whole parameters on group rank `to` ({} elsewhere), or on every rank with to=None."""
        return flat_param.full_state_dict(self.units, to, self.group)

    def load_full_state_dict(self, state: dict | None) -> None:
        """Collective: group rank 0's full state dict (the others may pass None) -> every rank's shard."""
        flat_param.load_full_state_dict(self.units, state, self.group)

    def sharded_state_dict(self) -> dict:
        """{name: (this rank's 1-D slice, Slice(shape, start, stop))}; with optimizer.state_dict() on the
        same rank, all a checkpoint needs. No communication."""
        return flat_param.sharded_state_dict(self.units)

    def load_sharded_state_dict(self, state: dict) -> None:
        """Collective: each rank loads its own sharded_state_dict() (same world size and wrap)."""
        flat_param.load_sharded_state_dict(self.units, state, self.group)


class Ledger:
    """One rank's events since reset(): (phase, unit, what, bytes sent, gathered bytes after), and the peak."""

    def __init__(self):
        self.events, self.gathered, self.peak = [], 0, 0  # gathered: bytes of full parameters alive now

    def record(self, *event) -> None:
        self.events.append(event)
        self.gathered = event[4]
        self.peak = max(self.peak, self.gathered)

    def reset(self) -> None:
        self.events, self.peak = [], self.gathered

    def count(self, what: str, unit: str | None = None) -> int:
        return sum(e[2] == what and unit in (None, e[1]) for e in self.events)

    @property
    def sent(self) -> int:
        return sum(e[3] for e in self.events)



# ----------------------------------------------------------------------------- demo

def timeline(ledger: Ledger, names: list[str]) -> str:
    """A row per unit, a column per event; '=' while the unit is gathered, '.' while only its shard is."""
    symbol = {"all-gather": "G", "compute": "C", "reduce-scatter": "R", "free": "F"}
    rows, alive, phase = {n: f"  {n:>5} " for n in names}, dict.fromkeys(names, False), "forward"
    for step_phase, unit, what, *_ in ledger.events:
        if step_phase != phase:
            phase, rows = step_phase, {n: r + "|" for n, r in rows.items()}
        alive[unit] = what != "free" and (alive[unit] or what == "all-gather")
        for n in names:
            rows[n] += symbol[what] if n == unit else "=" if alive[n] else "."
    return "\n".join(rows.values())


def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("--depth", type=int, default=6, help="Blocks, one unit each (the root keeps 2 Linears)")
    p.add_argument("--width", type=int, default=256, help="width of the timed model (Block hidden: 4x)")
    p.add_argument("--steps", type=int, default=3, help="fp64 Adam steps compared with fully_shard")
    p.add_argument("--repeats", type=int, default=5, help="timed steps per schedule (medians, in turns)")
    return p


def demo(args) -> int:
    launch.require(min(args.depth - 1, args.width, args.steps, args.repeats) >= 1,
                   "--depth must be at least 2 (prefetch needs a next unit); --width, --steps, --repeats >= 1")
    env = launch.setup()
    K, say, g = env.world_size, launch.print0, torch.Generator().manual_seed(env.rank)
    data = [torch.randn(2, 4, 6, generator=g, dtype=torch.float64).to(env.device) for _ in range(args.steps)]
    ours = FullyShardedDataParallel(models.block_stack(6, 10, 3, torch.float64, env.device), wrap=models.Block)
    native = models.fully_shard_blocks(models.block_stack(6, 10, 3, torch.float64, env.device))
    losses = [[models.regression_step(m, opt, x, y) for x, y in data]
              for m, opt in ((m, torch.optim.Adam(m.parameters(), lr=0.01)) for m in (ours, native))]
    reference = {n: p.full_tensor() for n, p in native.named_parameters()}
    worst = max([abs(a - b) for a, b in zip(*losses)] +
                [(p - reference[n]).abs().max().item() for n, p in ours.full_state_dict(to=None).items()])
    allowed = 0.0 if K <= 2 else 1e-14  # 2 numbers add alike in any order; gloo adds 3+ in a layout's order
    say(f"vs fully_shard (FSDP2), fp64 Adam, {args.steps} steps, K = {K}: max |diff| of losses and "
        f"parameters {worst:.1e} (allowed {allowed:g})")

    x, y = (torch.randn(16, args.width, generator=g).to(env.device) for _ in range(2))
    kinds = {"naive": dict(prefetch=False), "prefetch": {}, "kept": dict(reshard_after_forward=False)}
    stack = lambda: models.block_stack(args.width, 4 * args.width, args.depth, torch.float32, env.device)
    fsdps = {k: FullyShardedDataParallel(stack(), wrap=models.Block, **o) for k, o in kinds.items()}
    steps = {k: partial(models.regression_step, m, torch.optim.Adam(m.parameters(), lr=1e-4), x, y)
             for k, m in fsdps.items()}
    seconds = {k: timing.median(t) for k, t in timing.paired(steps, args.repeats).items()}
    for k, m in fsdps.items():
        m.ledger.reset()
        steps[k]()  # the step the ledger shows
    units = fsdps["naive"].units
    full, shards = [u.full.nbytes for u in units], sum(u.shard.nbytes for u in units)  # root first
    formula = {"naive": ("root + 1 unit", full[0] + max(full[1:])), "kept": ("every unit", sum(full)),
               "prefetch": ("root + 2 units", full[0] + max(a + b for a, b in zip(full[1:], full[2:])))}
    sent = {k: (2 if k == "kept" else 3) * (K - 1) * shards for k in fsdps}  # 3(K-1)/K 4N', kept 2
    say("one step on rank 0 (G all-gather, C compute, R reduce-scatter, F free; = gathered, . shard only)")
    for k in ("naive", "prefetch"):
        say(f" {k}:\n{timeline(fsdps[k].ledger, [u.name for u in units])}")
    say(f"\nper rank, rank 0 shown: {'gathers':>8} {'gathered params, peak = formula':>40} {'sent per step':>16} "
        f"{'step':>9}")
    for k, m in fsdps.items():
        say(f"{k:24}{m.ledger.count('all-gather', units[1].name):>8} {m.ledger.peak:>14,} B = {formula[k][0]:16}"
            f"{m.ledger.sent:>14,} B {seconds[k] * 1e3:6.1f} ms")
    say("(params, grads and Adam state per rank beside DDP's: ./run.sh demo fsdp_ledger)")
    figure_ok = all(m.ledger.peak == formula[k][1] and m.ledger.sent == sent[k] and m.ledger.gathered == 0
                    for k, m in fsdps.items())
    return launch.conclude("fsdp", worst <= allowed, f"= fully_shard (max diff {worst:.0e})", figure_ok,
                           f"gathered peak root + 2 units = {formula['prefetch'][1]:,} B (naive root + 1 unit: "
                           f"{formula['naive'][1]:,} B); sent 3(K-1)/K 4N' = {sent['prefetch']:,} B per rank")

if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
