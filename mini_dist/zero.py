"""ZeRO stages 1 and 2: shard the optimizer state (and the gradients) so memory per rank shrinks with K.

Data parallelism keeps K full replicas. With fp32 Adam a parameter costs 4 bytes of weight, 4 of gradient
and 8 of optimizer state (exp_avg, exp_avg_sq): 16N bytes per rank for N parameters. ZeRO (Rajbhandari
et al., 2020) flattens the parameters into one vector, pads it to Psi = K*S elements, and gives rank r
the shard [r*S, (r+1)*S): rank r keeps optimizer state only for its shard (stage 1, P_os) and, in stage 2
(P_os+g), only its shard of the averaged gradient. Memory per rank (N/K means S; N counts the padding):

    stage            fp32 Adam        half params + fp32 master weights (the paper's 2 + 2 + 12 bytes)
    0 (DDP)          16N              16N
    1 (ZeRO-1)       8N + 8N/K        4N + 12N/K
    2 (ZeRO-2)       4N + 12N/K       2N + 14N/K

One step: reduce-scatter the flat gradient (rank r receives the average of shard r); stages 0 and 1
all-gather it back (reduce-scatter + all-gather = all-reduce: every replica keeps the full average, as
DDP does), stage 2 frees the full gradients instead; step the own shard; all-gather the updated shards.
Each ring reduce-scatter or all-gather sends (K-1)*S*b bytes per rank (b bytes per element), so a step
sends 2(K-1)S*b (DDP), 3(K-1)S*b (ZeRO-1) and 2(K-1)S*b (ZeRO-2). ZeRO-2 moves exactly as much as DDP,
not less: the reduce-scatter saves half of the all-reduce and the parameter all-gather spends it again
(the paper, Sec. 7.2.1: Psi + Psi = 2 Psi, as in DP).

    torchrun --standalone --nproc_per_node=4 mini_dist/zero.py [--steps 3] [--widths 19 60 60]

Mirrors torch.distributed.optim.ZeroRedundancyOptimizer (stage 1, sharded by whole parameters) and
DeepSpeed's ZeRO stages 1 and 2 (flat, padded, equal shards, as here).
"""
import sys
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path

import torch
import torch.distributed as dist

if not __package__:  # run as `torchrun mini_dist/zero.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist import sharded_state
from mini_dist.kit import launch
from mini_dist.ring_allreduce import LEDGER, ring_all_gather, ring_reduce_scatter
from mini_dist.sharded_state import copy_settings, settings

HALF = (torch.float16, torch.bfloat16)
PASSES = {0: 2, 1: 3, 2: 2}  # ring passes of (K-1)*S*b bytes per step: reduce-scatter, all-gathers


@dataclass(frozen=True)
class Partition:
    """Where each parameter sits in the flat vector, and which slice [lo, hi) of it each rank owns."""
    names: tuple
    shapes: tuple
    world_size: int

    @property
    def spans(self) -> list:
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

    def pieces(self, rank: int) -> list:
        """(name, start, stop) of every parameter slice that falls into rank's shard."""
        lo, hi = self.shard(rank)
        return [(n, max(lo, a) - a, min(hi, b) - a) for n, (a, b) in zip(self.names, self.spans)
                if a < hi and b > lo]

    def __str__(self) -> str:
        pad = self.padded_numel - self.numel
        lines = [f"partition of N={self.numel:,} elements over K={self.world_size} ranks: "
                 f"shard S={self.shard_size:,}, padding {pad}"]
        for r in range(self.world_size):
            lo, hi = self.shard(r)
            tail = f" + {min(pad, hi - lo)} padding" if hi > self.numel else ""
            parts = " ".join(f"{n}[{a}:{b}]" for n, a, b in self.pieces(r))
            lines.append(f"  rank {r}: [{lo}, {hi}) {parts}{tail}")
        return "\n".join(lines)


def flatten_into_buffer(params: list, partition: Partition) -> torch.Tensor:
    """One padded flat vector; each parameter becomes a view of it: writing the vector updates the model."""
    flat = torch.zeros(partition.padded_numel, dtype=params[0].dtype, device=params[0].device)
    for p, (a, b) in zip(params, partition.spans):
        flat[a:b].copy_(p.detach().reshape(-1))
        p.data = flat[a:b].view_as(p)
    return flat


def _problem(params: list, stage: int, collectives: str):
    """What is wrong with this rank's arguments (None if nothing), to be shared before anyone blocks."""
    if stage not in (0, 1, 2):
        return f"stage must be 0 (DDP), 1 (shard optimizer state) or 2 (also gradients), got {stage}"
    if collectives not in ("native", "ring"):
        return f"collectives must be 'native' or 'ring', got {collectives!r}"
    if not params or len({(p.dtype, p.device) for p in params}) > 1:
        return (f"need parameters that require grad, all of one dtype and device; got "
                f"{sorted({f'{p.dtype}/{p.device}' for p in params})}")
    return None


class ZeroOptimizer(torch.optim.Optimizer):
    """Any element-wise torch.optim optimizer (SGD, Adam, AdamW, ...), sharded: stage 0 = plain data
    parallel, 1 shards its state, 2 also the gradients. A torch.optim.Optimizer itself: parameter groups
    ([{"params": ..., "weight_decay": 0}, ...]) and LR schedulers work, as with ZeroRedundancyOptimizer.

    The parameters that require grad (of one dtype and device) become views of one flat padded vector,
    group after group, so that each rank's shard is one slice of it and the updated shards are gathered
    straight into the model (ZeroRedundancyOptimizer does the same with parameters_as_bucket_view=True).
    They stay the model's parameters, usable as before; replacing one's .data later (p.data = ..., or
    model.to(...)) would detach it from the optimizer, so step() refuses it. Half-precision parameters
    get an fp32 master copy of the own shard, which the optimizer steps. A parameter without a gradient
    counts as a zero gradient. collectives: "native" (torch.distributed) or "ring" (ring_allreduce, whose
    LEDGER counts every byte). Wrap the bare model, not a DDP one: step() averages the gradients itself.
    Stage 2 frees the full gradients once backward has made them all; real ZeRO-2 reduce-scatters bucket
    by bucket during backward, so that they never all exist at once.
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
        # Every rank learns every rank's problems and model size first: all raise together, none hangs.
        sizes = [sum(p.numel() for p in g["params"] if p.requires_grad) for g in self.param_groups]
        mine = (_problem(self.params, stage, collectives), sum(sizes), len(named), stage, sizes)
        everyone = [None] * world
        dist.all_gather_object(everyone, mine, group=group)
        for r, (problem, *model) in enumerate(everyone):
            if problem:
                raise ValueError(f"rank {r}: {problem}")
            if tuple(model) != everyone[0][1:]:
                (n0, p0, s0, g0), (n, p, s, g) = everyone[0][1:], model
                raise ValueError(f"ranks disagree: rank 0 has {n0} elements in {p0} parameters (stage {s0}, "
                                 f"groups {g0}), rank {r} has {n} in {p} (stage {s}, groups {g}); pass the "
                                 f"same model, groups and stage")
        self.partition = Partition(tuple(n for n, _ in named), tuple(p.shape for p in self.params), world)
        self.span = dict(zip(self.params, self.partition.spans))
        self.flat = flatten_into_buffer(self.params, self.partition)
        self.lo, self.hi = (0, self.partition.padded_numel) if stage == 0 else self.partition.shard(self.rank)
        own = self.flat[self.lo:self.hi]
        # The paper's K = 12 bytes: for half params the optimizer steps fp32 master weights of the shard.
        self.has_master = own.dtype in HALF
        self.master = own.float() if self.has_master else own
        # Each group is one stretch of the flat vector (the padding joins the last): its part of my shard
        # is one slice, which the inner optimizer steps with the group's settings.
        ends = [*accumulate(sizes)][:-1] + [self.partition.padded_numel]
        clip = lambda x: min(max(x, self.lo), self.hi) - self.lo
        self.ranges = [(clip(a), clip(b)) for a, b in zip([0] + ends[:-1], ends)]
        self.slices = [self.master[a:b] for a, b in self.ranges]
        self.optimizer = optimizer_class([{**settings(g), "params": [s]} for g, s in zip(self.param_groups,
                                                                                        self.slices)], **defaults)
        self.defaults.update(self.optimizer.defaults)  # the inner optimizer's defaults (betas, ...): schedulers
        copy_settings(self.optimizer.param_groups, self.param_groups)  # read them here
        self.grad = None  # the averaged gradient kept after a step: full (stages 0, 1) or own shard (2)

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
        k, S = self.partition.world_size, self.partition.shard_size
        grad = torch.empty_like(self.flat)  # every element written below: no separate pass of zeros
        grad[self.partition.numel:].zero_()  # the padding
        for name, p, (a, b) in zip(self.partition.names, self.params, self.partition.spans):
            if p.untyped_storage().data_ptr() != self.flat.untyped_storage().data_ptr():
                raise RuntimeError(f"parameter {name}'s .data was replaced after the ZeroOptimizer was built: "
                                   f"it no longer lives in the flat vector that the optimizer steps; cast or "
                                   f"move the model first, then build the optimizer")
            if p.grad is None:  # counts as zeros
                grad[a:b].zero_()
            else:  # divide on the way in, as DDP does: a sum of K gradients cannot overflow
                torch.mul(p.grad.reshape(-1), 1.0 / k, out=grad[a:b])
        mine = slice(self.rank * S, (self.rank + 1) * S)
        if self.collectives == "ring":
            shard = torch.empty(S, dtype=grad.dtype, device=grad.device)
            ring_reduce_scatter(shard, grad, group=self.group)
            if self.stage < 2:  # finish the all-reduce: every replica holds the full average, as in DDP
                grad[mine] = shard
                self._all_gather_in_place(grad)
        elif self.stage < 2 or dist.get_backend(self.group) == "gloo":
            # reduce-scatter + all-gather in one all_reduce, as DDP and ZeroRedundancyOptimizer do; on gloo
            # stage 2 too: its reduce_scatter_single is an all-reduce and a copy (same bits, slower: measured)
            dist.all_reduce(grad, group=self.group)
            shard = grad[mine].clone() if self.stage == 2 else None
        else:
            shard = torch.empty(S, dtype=grad.dtype, device=grad.device)
            dist.reduce_scatter_single(shard, grad, group=self.group)
        if self.stage < 2:
            for p, (a, b) in zip(self.params, self.partition.spans):
                p.grad = grad[a:b].view_as(p)
            self.grad = grad[self.lo:self.hi]
        else:  # ZeRO-2: no rank keeps a full gradient, only the reduced shard it owns
            for p in self.params:
                p.grad = None
            self.grad = shard
        master_grad = self.grad.to(self.master.dtype)  # a copy only for half params (fp32 master)
        for s, (a, b) in zip(self.slices, self.ranges):
            s.grad = master_grad[a:b]
        copy_settings(self.param_groups, self.optimizer.param_groups)  # an LR scheduler's changes
        self.optimizer.step()
        copy_settings(self.optimizer.param_groups, self.param_groups)
        for s in self.slices:
            s.grad = None
        if self.has_master:
            self.flat[self.lo:self.hi].copy_(self.master)
        if self.stage > 0:
            self._all_gather_in_place(self.flat)
        return loss

    def _all_gather_in_place(self, flat: torch.Tensor) -> None:
        """Slice r of `flat` (S elements) goes from rank r to every rank: the all-gather of the shards."""
        S = self.partition.shard_size
        if self.collectives == "ring":  # a copy: the input must not alias the output it is gathered into
            ring_all_gather(flat, flat[self.rank * S:(self.rank + 1) * S].clone(), group=self.group)
            return
        # K broadcasts, each shard from its owner, as ZeroRedundancyOptimizer does: the same bytes as
        # all_gather_single, which gloo runs 2-4x slower (measured in mini_dist/bench/data_parallel.py)
        works = [dist.broadcast(flat[r * S:(r + 1) * S], group=self.group, group_src=r, async_op=True)
                 for r in range(self.partition.world_size)]
        for work in works:
            work.wait()

    # Checkpoints: a plain optimizer's state dict per parameter, or this rank's shard alone. How the
    # shards are cut and put together again is a lesson of its own: mini_dist/sharded_state.py.
    def state_dict(self, to: int | None = None):
        """Collective. The whole state in torch.optim's format for the same param groups (a plain optimizer
        over them can load it), on every rank (to=None) or only on group rank `to` (the others get None)."""
        return sharded_state.consolidated_state_dict(self, to)

    def load_state_dict(self, state_dict, src=None) -> None:
        """Each rank keeps its own shard of a consolidated state dict. With src (a group rank) only that
        rank needs to pass it (the others may pass None) and it is broadcast; else every rank passes it."""
        sharded_state.load_consolidated_state_dict(self, state_dict, src)

    def shard_state_dict(self) -> dict:
        """This rank's shard only, no communication: what a sharded checkpoint saves per rank."""
        return sharded_state.shard_state_dict(self)

    def load_shard_state_dict(self, shard: dict) -> None:
        sharded_state.load_shard_state_dict(self, shard)


# ----------------------------------------------------------------------------- ledgers and formulas


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind these tensors: views of one buffer count once, padding too."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in tensors if t is not None}
    return sum(storages.values())


def memory_ledger(params, optimizer) -> dict:
    """Bytes live on this rank by component, measured from the tensors (of a ZeroOptimizer, or of a plain
    optimizer over `params`). 'state' is per-element optimizer state, master weights included; 0-dim
    counters (Adam's step, 4 bytes per stepped tensor) are outside the formulas, reported as 'scalars'."""
    params = list(params)
    inner = optimizer.optimizer if isinstance(optimizer, ZeroOptimizer) else optimizer
    state = [v for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    grads = [p.grad for p in params]
    if isinstance(optimizer, ZeroOptimizer):
        grads.append(optimizer.grad)
        if optimizer.has_master:
            state.append(optimizer.master)
    return {"params": _storage_bytes(params), "grads": _storage_bytes(grads),
            "state": _storage_bytes(t for t in state if t.dim() > 0),
            "scalars": sum(t.nbytes for t in state if t.dim() == 0)}


def memory_formula(stage: int, partition: Partition, param_bytes: int, state_bytes: int) -> dict:
    """The table above with N = Psi and N/K = S: params, grads (full or shard), state (full or shard).
    state_bytes per element: 8 for fp32 Adam, 4 for SGD with momentum, +4 for fp32 master weights."""
    psi, s = partition.padded_numel, partition.shard_size
    return {"params": param_bytes * psi, "grads": param_bytes * (psi if stage < 2 else s),
            "state": state_bytes * (psi if stage == 0 else s)}


def bytes_sent_formula(stage: int, partition: Partition, elem_bytes: int) -> int:
    """Ring bytes one rank sends per step: (K-1)*S*b per reduce-scatter or all-gather; stage 0 does 2
    (the gradient all-reduce), stage 1 3 (+ the parameter all-gather), stage 2 2 (no gradient gather)."""
    return PASSES[stage] * (partition.world_size - 1) * partition.shard_size * elem_bytes


# ----------------------------------------------------------------------------- demo

FORMULAS = {False: ("16N", "8N + 8N/K", "4N + 12N/K"), True: ("16N", "4N + 12N/K", "2N + 14N/K")}


def build(kind: str, widths, dtype, stage: int = 1, collectives: str = "ring"):
    """(model, what runs forward, optimizer) for kind "ddp" (native DDP + Adam), "torch zero" (native DDP +
    ZeroRedundancyOptimizer(Adam)) or "mini zero" (ZeroOptimizer(Adam) on the bare model)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)  # every rank builds the same initial model
    layers = [m for a, b in zip(widths, widths[1:]) for m in (torch.nn.Linear(a, b), torch.nn.Tanh())]
    model = torch.nn.Sequential(*layers[:-1]).to(launch.device(), dtype)
    if kind == "mini zero":
        return model, model, ZeroOptimizer(model.named_parameters(), torch.optim.Adam, stage=stage,
                                           collectives=collectives, lr=1e-2)
    ddp = DDP(model)
    optimizer = (torch.optim.Adam(ddp.parameters(), lr=1e-2) if kind == "ddp" else
                 ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.Adam, lr=1e-2))
    return model, ddp, optimizer


def train(model, forward, optimizer, steps: int) -> None:
    """Each rank its own batch; zero_grad comes first, so the last step's gradients stay live."""
    for t in range(steps):
        g = torch.Generator().manual_seed(1000 * t + dist.get_rank())
        x = torch.randn(8, model[0].in_features, generator=g).to(launch.device(), model[0].weight.dtype)
        optimizer.zero_grad()
        (forward(x) ** 2).mean().backward()
        optimizer.step()


def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("--steps", type=int, default=3, help="Adam steps of the equivalence check (fp64)")
    p.add_argument("--widths", type=int, nargs="+", default=[19, 60, 60],
                   help="MLP widths; the default's N = 4,860 divides by K = 1..5: no padding")
    return p


def demo(args) -> int:
    launch.require(args.steps >= 1 and len(args.widths) >= 2 and min(args.widths) >= 1,
                   "--steps must be >= 1 and --widths two or more numbers >= 1")
    print0, (k, w) = launch.print0, (launch.setup().world_size, args.widths)
    runs = {(kind, s): build(kind, w, torch.float64, s) for kind, s in
            [("ddp", 0), ("torch zero", 0), ("mini zero", 0), ("mini zero", 1), ("mini zero", 2)]}
    for run in runs.values():
        train(*run, steps=args.steps)
    worst = max((p - q).abs().max().item() for s in (0, 1, 2) for ref in ("ddp", "torch zero")
                for p, q in zip(runs["mini zero", s][0].parameters(), runs[ref, 0][0].parameters()))
    equal = worst <= 1e-12  # fp64: only the order in which the K gradients are summed differs (~1e-16)
    print0(f"{runs['mini zero', 1][2].partition}\n{args.steps} Adam steps in fp64, stages 0/1/2 vs native DDP "
           f"and ZeroRedundancyOptimizer: max |diff| {worst:.1e} ({'PASS' if equal else 'FAIL'}: <= 1e-12)")
    model, forward, adam = build("ddp", w, torch.float32)
    train(model, forward, adam, 1)
    ddp_bytes = sum(v for c, v in memory_ledger(model.parameters(), adam).items() if c != "scalars")
    n, exact, per_n, sent = sum(p.numel() for p in model.parameters()), True, {}, {}
    for half in (False, True):
        b, state_bytes = (2, 12) if half else (4, 8)  # 12 = fp32 master 4 + Adam 8
        print0(f"\n{'bf16 params + fp32 master Adam' if half else 'fp32 Adam'}, K={k}, N={n:,} (rank 0 shown; "
               f"every rank checked)\nstage | sent/step B = formula   |  params   grads   state | total B = formula")
        for stage in (0, 1, 2):
            model, forward, zero = build("mini zero", w, torch.bfloat16 if half else torch.float32, stage)
            train(model, forward, zero, 1)
            LEDGER.reset()
            train(model, forward, zero, 1)  # one step's bytes; the ledger right after it
            want = memory_formula(stage, zero.partition, b, state_bytes)
            got = [memory_ledger(model.parameters(), zero)[c] for c in want]
            sent[half, stage], per_n[half, stage] = LEDGER.sent, sum(got) / n
            exact &= got == list(want.values()) and LEDGER.sent == bytes_sent_formula(stage, zero.partition, b)
            print0(f"{stage:<6}| {LEDGER.sent:>11,} = {PASSES[stage]}(K-1)S*b | {got[0]:>7,} {got[1]:>7,} "
                   f"{got[2]:>7,} | {sum(got):>7,} = {FORMULAS[half][stage]} = {per_n[half, stage]:.2f}N")
    ratio = [sent[False, s] / max(1, sent[False, 0]) for s in (1, 2)]
    print0(f"\nnative DDP + Adam measures {ddp_bytes / n:.2f}N, as stage 0. " + (
        f"Bytes vs DDP: ZeRO-1 {ratio[0]:.2f}x, ZeRO-2 {ratio[1]:.2f}x (its reduce-scatter halves the "
        f"gradient traffic, the parameter all-gather spends it again)" if k > 1 else "K=1 sends nothing.") +
        f"\nfp32 ZeRO-1 measures {per_n[False, 1]:.2f}N = 8N + 8N/K; the often-quoted 4N + 12N/K = "
        f"{per_n[True, 1]:.2f}N is the half-precision accounting (bf16 + fp32 master above)")
    return launch.conclude("zero", equal, f"= DDP and ZeroRedundancyOptimizer ({worst:.0e})",
                           exact and ddp_bytes == 16 * n, f"bytes, memory = formulas (ZeRO-2 {per_n[False, 2]:.2f}N)")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
