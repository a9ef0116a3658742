"""Fully sharded data parallel (ZeRO-3): a unit's parameters exist in full only while it computes.

DDP keeps the whole model on every rank; ZeRO stage 3 (Rajbhandari et al., 2020, P_os+g+p) shards the
parameters themselves, not only optimizer state and gradients. FSDP groups the parameters into *units*
(a transformer block, say; the root takes whatever is left), flattens each unit into one vector padded
to K*S elements (S = ceil(numel / K)) and keeps only shard r on rank r. Around each unit:

    forward:   all-gather the unit -> run it -> free it               (reshard_after_forward=True)
    backward:  all-gather it again -> backward -> reduce-scatter its gradient (rank r keeps shard r) -> free
    step:      any torch.optim optimizer, on the shards only

Why gather twice? Backward needs the weights again (dL/dx = dL/dy W). Keeping them from forward to
backward (reshard_after_forward=False, the ZeRO-2-like trade) saves one all-gather but holds every unit
at the turn. The root is resharded too (FSDP2 keeps it, as backward needs it at once), so every unit
costs exactly 2 all-gathers + 1 reduce-scatter. Per rank per step, N parameters (padded) of B bytes:

    memory   N/K  +  gathered units (root + 1 unit, root + 2 with prefetch)   vs DDP  N
    traffic  all-gather + all-gather + reduce-scatter = 3 (K-1)/K N B         vs DDP  2 (K-1)/K N B

prefetch=True starts the next unit's all-gather (async) before the current unit computes, in forward
and backward order. param_dtype=torch.bfloat16 computes and communicates in half while the shards and
their gradients stay fp32. `ledger` records every collective with the bytes this rank sends and the bytes
of full parameters alive, read from the storages themselves, with their peak.

Collectives are native (all_gather_single, reduce_scatter_single): prefetch needs async_op to overlap a
gather with compute, which the blocking ring functions cannot. The ledger counts what a bandwidth-optimal
ring sends, (K-1) * S * B per collective; tests/test_fsdp.py checks that count against the bytes
mini_dist.ring_allreduce's LEDGER measures on the same buffers.

    torchrun --standalone --nproc_per_node=4 mini_dist/fsdp.py [--bench]

Mirrors torch.distributed.fsdp.fully_shard (FSDP2), with FSDP1's one flat parameter per unit.
"""
import ctypes
import sys
import threading
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

if not __package__:  # run as `torchrun mini_dist/fsdp.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist import ring_allreduce  # noqa: E402
from mini_dist.launch import conclude, print0, setup  # noqa: E402


class Ledger:
    """One rank's events since reset() (phase, unit, what, bytes sent, gathered bytes after), and the peak."""

    def __init__(self):
        self.events, self.gathered, self.peak = [], 0, 0  # gathered: bytes of full parameters alive now

    def record(self, phase: str, unit: str, what: str, sent: int, gathered: int) -> None:
        self.events.append((phase, unit, what, sent, gathered))
        self.gathered, self.peak = gathered, max(self.peak, gathered)

    def reset(self) -> None:
        self.events, self.peak = [], self.gathered

    def count(self, what: str, unit: str | None = None) -> int:
        return sum(e[2] == what and unit in (None, e[1]) for e in self.events)

    @property
    def sent(self) -> int:
        return sum(e[3] for e in self.events)


class FlatParameter:
    """One unit's parameters as one vector of K*S elements; rank r owns elements [r*S, (r+1)*S)."""

    def __init__(self, name, names, params, slots, world, param_dtype):
        self.name, self.names, self.slots = name, names, slots  # slots: (module, attr, index of param)
        self.shapes, self.numels = [p.shape for p in params], [p.numel() for p in params]
        self.numel, self.shard_numel, self.world = sum(self.numels), -(-sum(self.numels) // world), world
        dtype, device, trainable = params[0].dtype, params[0].device, params[0].requires_grad
        self.shard = nn.Parameter(torch.empty(self.shard_numel, dtype=dtype, device=device), trainable)
        self.full = torch.empty(world * self.shard_numel, dtype=param_dtype or dtype, device=device)
        self.full.requires_grad_(trainable).untyped_storage().resize_(0)  # allocated only when gathered
        self.work = None  # (async all-gather, its input) while a gather is in flight

    def flatten(self, tensors) -> torch.Tensor:
        """The unit's tensors in one zero-padded vector of K*S elements (padding keeps shards equal)."""
        flat = torch.zeros(self.world * self.shard_numel, dtype=tensors[0].dtype, device=tensors[0].device)
        torch.cat([t.reshape(-1) for t in tensors], out=flat[:self.numel])
        return flat

    @property
    def gathered(self) -> bool:
        return self.full.untyped_storage().nbytes() > 0

    def attach_views(self) -> None:
        """Point each module attribute at its slice of the gathered vector (with autograd, if enabled)."""
        views = self.full[:self.numel].split(self.numels)
        for module, attr, i in self.slots:
            setattr(module, attr, views[i].view(self.shapes[i]))


class FullyShardedDataParallel(nn.Module):
    """Wrap `module`; `wrap` names the units: module classes (every Block) or the submodules themselves.

    The optimizer gets `.parameters()`: one shard per unit, in the parameters' own dtype. prefetch=False
    is the naive schedule, in which every all-gather starts only when its unit is needed and it waits.
    """

    def __init__(self, module: nn.Module, wrap=(), group=None, reshard_after_forward: bool = True,
                 prefetch: bool = True, param_dtype: torch.dtype | None = None):
        super().__init__()
        if param_dtype is not None and not param_dtype.is_floating_point:
            raise ValueError(f"param_dtype must be a floating dtype (torch.bfloat16), not {param_dtype}")
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        if self.rank < 0:
            raise ValueError("this rank is not in `group`: build FullyShardedDataParallel on its ranks only")
        self.module, self.group, self.param_dtype = module, group, param_dtype
        self.reshard_after_forward, self.prefetch = reshard_after_forward, prefetch
        self.ledger, self._finished, self._callback_queued = Ledger(), [], False
        self.units, modules, initial = self._flatten(module, _pick_units(module, wrap), param_dtype)
        self.shards = nn.ParameterList([u.shard for u in self.units])  # all the optimizer will see
        self.load_full_state_dict(initial if self.rank == 0 else None)  # rank 0's values win, as in DDP
        for unit, m in zip(self.units, modules):
            m.register_forward_pre_hook(partial(self._pre_forward, unit), with_kwargs=True)
            m.register_forward_hook(partial(self._post_forward, unit))
            if unit.full.requires_grad:
                unit.full.register_post_accumulate_grad_hook(partial(self._reduce_scatter, unit))

    def _flatten(self, root, unit_modules, param_dtype):
        """Each parameter goes to the innermost unit around it; each unit with parameters -> FlatParameter."""
        names = {id(p): n for n, p in root.named_parameters()}
        module_names = {id(m): n or "root" for n, m in root.named_modules()}
        found = {id(m): [] for m in unit_modules}

        def visit(m, unit):
            unit = m if id(m) in found else unit
            found[id(unit)].extend((m, attr, p) for attr, p in m._parameters.items() if p is not None)
            for child in m.children():
                visit(child, unit)
        visit(root, root)
        units, modules, initial, owner = [], [], {}, {}
        for m in unit_modules:
            params = list({id(p): p for _, _, p in found[id(m)]}.values())  # tied parameters once
            for p in params:
                if owner.setdefault(id(p), m) is not m:
                    raise ValueError(f"parameter {names[id(p)]} is shared by units {module_names[id(m)]} and "
                                     f"{module_names[id(owner[id(p)])]}: wrap a module holding both users")
            if not params:
                continue
            if len({(p.dtype, p.requires_grad, p.device) for p in params}) > 1:
                raise ValueError(f"unit {module_names[id(m)]} mixes parameter dtypes, devices or frozen and "
                                 f"trainable parameters: one flat parameter needs one kind; wrap them apart")
            index = {id(p): i for i, p in enumerate(params)}
            units.append(FlatParameter(module_names[id(m)], [names[id(p)] for p in params], params,
                                       [(sub, attr, index[id(p)]) for sub, attr, p in found[id(m)]],
                                       self.world, param_dtype))
            modules.append(m)
            initial.update({names[id(p)]: p.detach() for p in params})
            for sub, attr, _ in found[id(m)]:
                del sub._parameters[attr]  # the module keeps no full copy: only views, set in forward
        return units, modules, initial

    # ----- the collectives, each recorded in the ledger

    def _record(self, phase: str, unit: FlatParameter, what: str, piece: torch.Tensor | None = None) -> None:
        """piece: what a ring sends per step, one shard; a collective of K ranks sends K-1 of them."""
        sent = 0 if piece is None else (self.world - 1) * piece.nbytes
        gathered = sum(u.full.untyped_storage().nbytes() for u in self.units)
        self.ledger.record(phase, unit.name, what, sent, gathered)

    def _gather(self, unit: FlatParameter, phase: str, wait: bool = True) -> None:
        """All-gather the unit's full vector into its re-allocated storage (left in flight unless wait)."""
        if not unit.gathered:
            full = unit.full
            full.untyped_storage().resize_(full.nbytes)
            shard = unit.shard.detach().to(full.dtype)  # in param_dtype: half the bytes on the wire
            # .data: autograd saved views of `full` in forward and checks they were not rewritten in
            # place; we refill the very values they held, so the write must not bump the version.
            unit.work = (dist.all_gather_single(full.data, shard, group=self.group, async_op=True), shard)
            self._record(phase, unit, "all-gather", shard)
        if wait and unit.work is not None:
            unit.work[0].wait()
            unit.work = None

    def _free(self, unit: FlatParameter, phase: str) -> None:
        if unit.gathered:
            self._gather(unit, phase)  # a prefetch still in flight must land before its buffer goes
            unit.full.untyped_storage().resize_(0)
            self._record(phase, unit, "free")

    def _reduce_scatter(self, unit: FlatParameter, full: torch.Tensor) -> None:
        """Runs once autograd has put the unit's full gradient in full.grad: rank r keeps the average
        over ranks of shard r of it, in the shard's own (fp32) dtype, and the gathered unit goes."""
        grad, full.grad = full.grad, None
        out = torch.empty(unit.shard_numel, dtype=grad.dtype, device=grad.device)
        dist.reduce_scatter_single(out, grad, group=self.group)  # SUM, then / K: works on every backend
        self._record("backward", unit, "reduce-scatter", out)
        out = out.div_(self.world).to(unit.shard.dtype)
        unit.shard.grad = out if unit.shard.grad is None else unit.shard.grad.add_(out)
        self._free(unit, "backward")

    # ----- the hooks: forward pre/post on each unit, pre-backward on its outputs (post: _reduce_scatter)

    def forward(self, *args, **kwargs):
        self._finished = []  # the order units finish forward, reversed, is the order of their backward
        return self.module(*args, **kwargs)

    def _before_compute(self, unit: FlatParameter, phase: str, order: list) -> None:
        """Gather the unit and wait; with prefetch, first start the gather of the unit after it in order."""
        self._gather(unit, phase)
        following = order[order.index(unit) + 1:] if unit in order else []
        if self.prefetch and following:
            self._gather(following[0], phase, wait=False)
        self._record(phase, unit, "compute")

    def _pre_forward(self, unit, module, args, kwargs):
        self._before_compute(unit, "forward", self.units)
        unit.attach_views()
        if self.param_dtype is not None:
            cast = lambda t: t.to(self.param_dtype) if torch.is_tensor(t) and t.is_floating_point() else t
            args, kwargs = tree_map(cast, (args, kwargs))
        return args, kwargs

    def _post_forward(self, unit, module, args, output):
        self._finished.append(unit)
        if self.reshard_after_forward or not torch.is_grad_enabled():
            self._free(unit, "forward")
        needs_grad = [t for t in tree_leaves(output) if torch.is_tensor(t) and t.requires_grad]
        if needs_grad:  # fires when the first gradient reaches the unit's output: its backward is next
            torch.autograd.graph.register_multi_grad_hook(needs_grad, lambda _: self._pre_backward(unit),
                                                          mode="any")

    def _pre_backward(self, unit) -> None:
        if not self._callback_queued:  # the engine's end-of-backward hook (DDP's reducer uses it too)
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        self._before_compute(unit, "backward", self._finished[::-1])

    def _end_of_backward(self) -> None:
        """Free what no gradient reached (a frozen unit, an unused one, a prefetch that was not needed)."""
        self._callback_queued = False
        for unit in self.units:
            self._free(unit, "backward")

    # ----- full state dicts, for saving and for comparing with an unsharded model

    def full_state_dict(self) -> dict:
        """Every parameter at full size, gathered from the shards onto group rank 0 ({} on the others)."""
        state = {}
        for unit in self.units:
            pieces = [torch.empty_like(unit.shard) for _ in range(self.world)] if self.rank == 0 else None
            dist.gather(unit.shard.detach(), pieces, group=self.group, group_dst=0)
            if self.rank == 0:
                flat = torch.cat(pieces)[:unit.numel].split(unit.numels)
                state.update({n: t.view(s).clone() for n, t, s in zip(unit.names, flat, unit.shapes)})
        return state

    def load_full_state_dict(self, state: dict | None) -> None:
        """Group rank 0's full state dict (others may pass None) -> every rank's shards. Every rank must
        have built the same units and the dict must fit them, or the scatters would pair up wrong and
        hang: all ranks learn both answers from one all-gather and raise the same error."""
        wrong = [f"{n} (want shape {tuple(s)})" for u in self.units for n, s in zip(u.names, u.shapes)
                 if n not in state or tuple(state[n].shape) != tuple(s)] if self.rank == 0 else []
        everyone = [None] * self.world
        dist.all_gather_object(everyone, ([(u.name, u.numel, str(u.shard.dtype)) for u in self.units], wrong),
                               group=self.group)
        units = [theirs for theirs, _ in everyone]
        bad = [r for r, theirs in enumerate(units) if theirs != units[0]]
        if bad:
            raise ValueError(f"ranks {bad} built other units than rank 0 ({units[0]} vs {units[bad[0]]}): "
                             f"every rank must build the same module, same wrap")
        if everyone[0][1]:
            raise ValueError(f"state dict lacks or misshapes: {', '.join(everyone[0][1])}")
        for unit in self.units:
            flat = unit.flatten([state[n].to(unit.shard) for n in unit.names]) if self.rank == 0 else None
            dist.scatter(unit.shard.detach(), list(flat.chunk(self.world)) if self.rank == 0 else None,
                         group=self.group, group_src=0)


def _pick_units(root: nn.Module, wrap) -> list[nn.Module]:
    """[root, *units in module order]: the order forward prefetches in."""
    if isinstance(wrap, type) or wrap and isinstance(wrap, tuple) and isinstance(wrap[0], type):
        return [root] + [m for m in root.modules() if m is not root and isinstance(m, wrap)]
    wanted = list(wrap)
    inside = [m for m in root.modules() if m is not root and any(m is w for w in wanted)]
    if len(inside) != len({id(w) for w in wanted if w is not root}):
        raise ValueError("wrap names a module that is not inside the wrapped module: pass its submodules "
                         "(or their classes)")
    return [root] + inside


# ----------------------------------------------------------------------------- demo and --bench


class Block(nn.Module):
    """A residual MLP standing in for a transformer block: the unit FSDP gathers and frees whole."""

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.up, self.down = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


def make_model(width, hidden, depth, dtype, device, native=False, **options) -> nn.Module:
    """Linear -> Blocks -> Linear, each Block a unit: wrapped by us, or by native fully_shard (FSDP2)."""
    torch.manual_seed(0)
    blocks = [Block(width, hidden) for _ in range(depth)]
    model = nn.Sequential(nn.Linear(width, width), *blocks, nn.Linear(width, width)).to(device, dtype)
    if not native:
        return FullyShardedDataParallel(model, wrap=Block, **options)
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    mesh = DeviceMesh.from_group(dist.group.WORLD, device.type)
    for block in blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def train_step(model, optimizer, x, y) -> float:
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def check_against_fully_shard(env, steps: int = 3) -> float:
    """fp64 Adam on the same per-rank data: the largest difference in losses and gathered parameters."""
    g = torch.Generator().manual_seed(env.rank)
    data = [torch.randn(2, 4, 6, generator=g, dtype=torch.float64).to(env.device) for _ in range(steps)]
    ours, native = (make_model(6, 10, 3, torch.float64, env.device, native=n) for n in (False, True))
    losses = []
    for m in (ours, native):
        optimizer = torch.optim.Adam(m.parameters(), lr=0.01)
        losses.append([train_step(m, optimizer, x, y) for x, y in data])
    native_params = {n: p.full_tensor() for n, p in native.named_parameters()}
    return max([abs(a - b) for a, b in zip(*losses)] +
               [(p - native_params[n]).abs().max().item() for n, p in ours.full_state_dict().items()])


def timeline(ledger: Ledger, names: list[str]) -> str:
    """A row per unit, a column per event; '=' while the unit is gathered, '.' while only its shard is."""
    symbol = {"all-gather": "G", "compute": "C", "reduce-scatter": "R", "free": "F"}
    rows, alive, phase = {n: f"  {n:>6} " for n in names}, dict.fromkeys(names, False), "forward"
    for step_phase, unit, what, *_ in ledger.events:
        if step_phase != phase:
            phase, rows = step_phase, {n: r + "|" for n, r in rows.items()}
        alive[unit] = what != "free" and (alive[unit] or what == "all-gather")
        for n in names:
            rows[n] += symbol[what] if n == unit else "=" if alive[n] else "."
    return "\n".join(rows.values())


def one_step(env, reshard: bool):
    """Forward and backward through 6 Blocks whose unit sizes K does not divide; gathered B after forward."""
    fsdp = make_model(30, 97, 6, torch.float32, env.device, reshard_after_forward=reshard)
    x = torch.randn(8, 30, generator=torch.Generator().manual_seed(env.rank)).to(env.device)
    fsdp.ledger.reset()
    out = fsdp(x)
    after_forward = fsdp.ledger.gathered
    out.square().mean().backward()
    return fsdp, after_forward


def demo() -> int:
    env = setup()
    if "--bench" in sys.argv:
        return bench(env)
    K = env.world_size
    worst, allowed = check_against_fully_shard(env), 0.0 if K <= 2 else 1e-14  # why: tests/test_fsdp.py
    print0(f"vs fully_shard (FSDP2), fp64 Adam, 3 steps, K = {K}: max |diff| of losses and parameters "
           f"{worst:.1e} (allowed {allowed:g})")
    fsdp, after_forward = one_step(env, reshard=True)
    kept, kept_after_forward = one_step(env, reshard=False)
    print0("one step on rank 0 (G all-gather, C compute, R reduce-scatter, F free; = gathered, . shard only)")
    print0(timeline(fsdp.ledger, [u.name for u in fsdp.units]))
    per_unit = lambda f: f"{f.ledger.count('all-gather', '1')} all-gather(s) + 1 reduce-scatter"
    print0(f"why gather twice: after forward rank 0 holds {after_forward} B of full parameters (shards "
           f"only), but\n  backward needs every W again (dL/dx = dL/dy W): per unit {per_unit(fsdp)}.\n  "
           f"reshard_after_forward=False keeps them: {per_unit(kept)}, but holds {kept_after_forward} B "
           f"at the turn\n  (peak {kept.ledger.peak} B instead of {fsdp.ledger.peak} B)")

    full, shards = [u.full.nbytes for u in fsdp.units], sum(u.shard.nbytes for u in fsdp.units)  # root first
    formula, N = full[0] + max(a + b for a, b in zip(full[1:], full[2:])), sum(u.numel for u in fsdp.units)
    print0(f"parameter memory per rank: shards {shards} B + gathered peak {fsdp.ledger.peak} B (ledger) = "
           f"{shards + fsdp.ledger.peak} B\n  formula N/K + root + 2 units = {shards + formula} B; "
           f"DDP holds N = {4 * N} B")
    ring_allreduce.LEDGER.reset()
    ring_allreduce.ring_all_reduce(torch.zeros(N, device=env.device))  # what DDP sends for these gradients
    ddp, sent = ring_allreduce.LEDGER.sent, 3 * (K - 1) * shards
    print0(f"traffic per rank per step: FSDP {fsdp.ledger.sent} B (ledger; 3(K-1)/K N' = {sent} B)\n"
           f"  vs DDP's ring all-reduce {ddp} B (ring ledger; 2(K-1)/K N = {2 * (K - 1) / K * 4 * N:.0f} B)"
           + (f": {fsdp.ledger.sent / ddp:.2f}x" if ddp else ""))
    figure_ok = fsdp.ledger.peak == formula and fsdp.ledger.sent == sent and after_forward == 0
    return conclude("fsdp", worst <= allowed, f"= fully_shard (max diff {worst:.0e})", figure_ok,
                    f"peak N/K + 3 units {shards + formula} B vs DDP {4 * N} B; sent 3(K-1)/K N {sent} B")


class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]


def peak_bytes(step, device) -> int:
    """Memory one step holds above its start: CUDA's allocator peak; on CPU, which keeps none, glibc's heap
    bytes in use (mallinfo2's hblkhd + uordblks) sampled every 0.1 ms by a thread while the step runs."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    mallinfo2.restype = MallInfo2
    in_use = lambda: (lambda info: info.uordblks + info.hblkhd)(mallinfo2())
    base, peak, done = in_use(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], in_use())
            time.sleep(1e-4)
    sampler = threading.Thread(target=sample)
    sampler.start()
    step()
    done.set()
    sampler.join()
    return peak[0] - base


def bench(env, width: int = 512, depth: int = 8, batch: int = 16, steps: int = 5) -> int:
    """Seconds per step (barrier to barrier, after a warm-up step), then the peak memory of one more step."""
    g = torch.Generator().manual_seed(env.rank)
    x, y = (torch.randn(batch, width, generator=g).to(env.device) for _ in range(2))
    N = depth * (8 * width * width + 5 * width) + 2 * (width * width + width)
    kind = "torch.cuda.max_memory_allocated" if env.device.type == "cuda" else "glibc heap, sampled"
    print0(f"bench: {depth} blocks, {N / 1e6:.1f}M fp32 parameters ({4 * N / 2 ** 20:.0f} MiB), batch "
           f"{batch}, {env.world_size} ranks on {env.device.type}\n  peak: {kind}, above the step's "
           f"start; gathered: the ledger's peak of full parameters")
    seconds = {}
    for name, options in [("mini_dist", {}), ("no prefetch", {"prefetch": False}),
                          ("fully_shard", {"native": True})]:
        model = make_model(width, 4 * width, depth, torch.float32, env.device, **options)
        step = partial(train_step, model, torch.optim.Adam(model.parameters(), lr=1e-4), x, y)
        step()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        if env.device.type == "cuda":  # the last step's kernels may still run: wait for them
            torch.cuda.synchronize()
        dist.barrier()
        seconds[name], peak = (time.perf_counter() - start) / steps, peak_bytes(step, env.device)
        gathered = f"{model.ledger.peak / 2 ** 20:5.1f} MiB" if name != "fully_shard" else "  n/a"
        print0(f"  {name:>12}: {seconds[name] * 1e3:8.1f} ms/step   peak {peak / 2 ** 20:6.1f} MiB   "
               f"gathered {gathered}")
    ratio = seconds["mini_dist"] / seconds["fully_shard"]
    return conclude("fsdp-bench", True, "ran", True, f"{ratio:.2f}x fully_shard's step time")


if __name__ == "__main__":
    raise SystemExit(demo())
