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
(the paper, Sec. 7.2.1: Psi + Psi = 2 Psi, as in DP). ZeRO-1 that all-reduces moves 1.5x DP, as
DeepSpeed's first ZeRO-1 did; it could reduce-scatter too, but then replicas no longer hold full grads.

Demo (equivalence with DDP and ZeroRedundancyOptimizer, then bytes and memory per stage vs formulas):

    torchrun --standalone --nproc_per_node=4 mini_dist/zero.py [--bench]

Mirrors torch.distributed.optim.ZeroRedundancyOptimizer (stage 1, sharded by whole parameters) and
DeepSpeed's ZeRO stages 1 and 2 (flat, padded, equal shards, as here).
"""
import sys
import time
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path

import torch
import torch.distributed as dist

if not __package__:  # run as `torchrun mini_dist/zero.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist import launch  # noqa: E402

HALF = (torch.float16, torch.bfloat16)


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


class ZeroOptimizer:
    """Any torch.optim optimizer, sharded: stage 0 = plain data parallel, 1 shards its state, 2 also grads.

    params: parameters or (name, parameter) pairs (names label the printed partition); those that require
    grad must share one dtype and device, and become views of one flat vector. Half-precision parameters
    get an fp32 master copy of the own shard, which the optimizer steps. A parameter without a gradient
    counts as a zero gradient (the shard is stepped as one tensor). collectives: "native"
    (torch.distributed) or "ring" (mini_dist.ring_allreduce, whose LEDGER counts every byte sent).
    Wrap the bare model, not a DDP one: step() averages the gradients itself. Stage 2 frees the full
    gradients once backward has made them all; real ZeRO-2 reduce-scatters bucket by bucket during
    backward, so that they never all exist at once.
    """

    def __init__(self, params, optimizer_class, stage: int = 1, group=None, collectives: str = "native",
                 **optimizer_kwargs):
        named = [x if isinstance(x, tuple) else (f"p{i}", x) for i, x in enumerate(params)]
        named = [(n, p) for n, p in named if p.requires_grad]
        if dist.get_rank(group) < 0:
            raise ValueError("this rank is not in `group`: create the ZeroOptimizer only on its ranks")
        self.params, self.stage, self.group = [p for _, p in named], stage, group
        self.rank, world = dist.get_rank(group), dist.get_world_size(group)
        # Every rank learns every rank's problems and model size first: all raise together, none hangs.
        mine = (_problem(self.params, stage, collectives), sum(p.numel() for p in self.params), len(named),
                stage)
        everyone = [None] * world
        dist.all_gather_object(everyone, mine, group=group)
        for r, (problem, *model) in enumerate(everyone):
            if problem:
                raise ValueError(f"rank {r}: {problem}")
            if tuple(model) != everyone[0][1:]:
                (n0, p0, s0), (n, p, s) = everyone[0][1:], model
                raise ValueError(f"ranks disagree: rank 0 has {n0} elements in {p0} parameters (stage {s0}), "
                                 f"rank {r} has {n} in {p} (stage {s}); pass the same model and stage")
        self.partition = Partition(tuple(n for n, _ in named), tuple(p.shape for p in self.params), world)
        self.flat = flatten_into_buffer(self.params, self.partition)
        everything = (0, self.partition.padded_numel)
        self.lo, self.hi = everything if stage == 0 else self.partition.shard(self.rank)
        own = self.flat[self.lo:self.hi]
        # The paper's K = 12 bytes: for half params the optimizer steps fp32 master weights of the shard.
        self.has_master = own.dtype in HALF
        self.master = own.float() if self.has_master else own
        self.optimizer = optimizer_class([self.master], **optimizer_kwargs)
        self.grad = None  # the averaged gradient kept after a step: full (stages 0, 1) or own shard (2)
        if collectives == "ring":
            from mini_dist.ring_allreduce import ring_all_gather, ring_reduce_scatter
            self._reduce_scatter, self._all_gather = ring_reduce_scatter, ring_all_gather
        else:
            self._reduce_scatter, self._all_gather = dist.reduce_scatter_single, dist.all_gather_single

    @property
    def param_groups(self) -> list:
        return self.optimizer.param_groups  # change the learning rate here, as with any optimizer

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        self.grad = None

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        flat_grad = torch.zeros_like(self.flat)  # zeros: the padding, and parameters without a gradient
        for p, (a, b) in zip(self.params, self.partition.spans):
            if p.grad is not None:
                flat_grad[a:b].copy_(p.grad.reshape(-1))
        shard_grad = torch.empty(self.partition.shard_size, dtype=self.flat.dtype, device=self.flat.device)
        self._reduce_scatter(shard_grad, flat_grad, op=dist.ReduceOp.AVG, group=self.group)
        if self.stage < 2:  # finish the all-reduce: every replica holds the full average, as in DDP
            self._all_gather(flat_grad, shard_grad, group=self.group)
            for p, (a, b) in zip(self.params, self.partition.spans):
                p.grad = flat_grad[a:b].view_as(p)
            self.grad = flat_grad[self.lo:self.hi]
        else:  # ZeRO-2: no rank keeps a full gradient, only the reduced shard it owns
            for p in self.params:
                p.grad = None
            self.grad = shard_grad
        self.master.grad = self.grad.to(self.master.dtype)  # a copy only for half params (fp32 master)
        self.optimizer.step()
        self.master.grad = None
        own = self.flat[self.lo:self.hi]
        if self.has_master:
            own.copy_(self.master)
        if self.stage > 0:  # the input is cloned: it must not alias the output it is gathered into
            self._all_gather(self.flat, own.clone(), group=self.group)
        return loss

    def state_dict(self, to: int = 0):
        """Collective. Rank `to` (of the group) gets the whole optimizer state in torch.optim's format,
        one entry per parameter, loadable by a plain optimizer over the same parameters; others get None."""
        if not 0 <= to < self.partition.world_size:
            raise ValueError(f"to={to} is not a rank of the group (0..{self.partition.world_size - 1})")
        inner = self.optimizer.state_dict()
        shard = dict(inner["state"].get(0, {}))
        if self.has_master:
            shard["master_param"] = self.master
        full = {k: self._gather(v, to) for k, v in sorted(shard.items()) if _per_element(v)}
        if self.rank != to:
            return None
        state = {i: {k: full[k][a:b].view(p.shape).clone() if k in full else _clone(v)
                     for k, v in shard.items()}
                 for i, (p, (a, b)) in enumerate(zip(self.params, self.partition.spans))}
        group = {**inner["param_groups"][0], "params": list(range(len(self.params)))}
        return {"state": state if shard else {}, "param_groups": [group]}

    def _gather(self, shard: torch.Tensor, to: int):
        if self.stage == 0:
            return shard  # every rank already holds all of it
        k = self.partition.world_size
        parts = [torch.empty_like(shard) for _ in range(k)] if self.rank == to else None
        dist.gather(shard.contiguous(), parts, group=self.group, group_dst=to)
        return torch.cat(parts) if parts else None

    def load_state_dict(self, state_dict, src=None) -> None:
        """Each rank keeps its own shard of a consolidated state dict. With src (a group rank) only that
        rank needs to pass it (the others may pass None) and it is broadcast; else every rank passes it."""
        if src is not None:
            box = [state_dict]
            dist.broadcast_object_list(box, group=self.group, group_src=src)
            state_dict = box[0]
        groups, state = state_dict["param_groups"], state_dict["state"]
        ids = groups[0]["params"] if len(groups) == 1 else []
        if len(ids) != len(self.params) or (state and any(i not in state for i in ids)):
            raise ValueError(f"expected one param group of {len(self.params)} parameters, each with state; "
                             f"got {[len(g['params']) for g in groups]} parameters in {len(groups)} groups")
        if state and all(p.dim() == 0 for p in self.params):
            raise ValueError("every parameter is 0-dim, so per-element state cannot be told from scalar "
                             "counters such as Adam's step; give the model one parameter with dim >= 1")
        keys = {k for i in ids for k, v in state.get(i, {}).items() if _per_element(v)}
        shard = {}
        for key, value in (state[ids[0]].items() if state else ()):
            if key not in keys:
                shard[key] = _clone(value)
                continue
            flat = torch.zeros(self.partition.padded_numel, dtype=value.dtype, device=self.flat.device)
            for i, (p, (a, b)) in zip(ids, zip(self.params, self.partition.spans)):
                if state[i][key].numel() != p.numel():
                    raise ValueError(f"state {key!r} of parameter {i} has {state[i][key].numel()} elements, "
                                     f"the parameter has {p.numel()}: the state dict is of another model")
                flat[a:b] = state[i][key].reshape(-1)
            shard[key] = flat[self.lo:self.hi].clone()  # a clone: a view would keep all of `flat` alive
        master = shard.pop("master_param", None)
        if self.has_master:
            self.master.copy_(self.flat[self.lo:self.hi] if master is None else master)
        self.optimizer.load_state_dict({"state": {0: shard} if shard else {},
                                        "param_groups": [{**groups[0], "params": [0]}]})


def _per_element(value) -> bool:
    """Per-element state (exp_avg, momentum_buffer) has the parameter's shape; scalars (step) have none."""
    return isinstance(value, torch.Tensor) and value.dim() > 0


def _clone(value):
    return value.clone() if isinstance(value, torch.Tensor) else value


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
    one = (partition.world_size - 1) * partition.shard_size * elem_bytes
    return {0: 2, 1: 3, 2: 2}[stage] * one


# ----------------------------------------------------------------------------- demo

SIZES = (19, 60, 60)  # N = 60*20 + 60*61 = 4,860 divides by K = 1..5: no padding, formulas read exactly
FORMULAS = {False: ("16N", "8N + 8N/K", "4N + 12N/K"), True: ("16N", "4N + 12N/K", "2N + 14N/K")}


def _make(kind: str, dtype, stage: int = 1, sizes=SIZES, collectives: str = "ring") -> tuple:
    """(model, what runs forward, optimizer): 'ddp' = native DDP + Adam, 'zro' = DDP +
    ZeroRedundancyOptimizer(Adam), 'zero' = ZeroOptimizer(Adam) on the bare model."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)  # every rank builds the same initial model
    layers = [m for a, b in zip(sizes, sizes[1:]) for m in (torch.nn.Linear(a, b), torch.nn.Tanh())]
    model = torch.nn.Sequential(*layers[:-1]).to(launch.device(), dtype)
    if kind == "zero":
        return model, model, ZeroOptimizer(model.named_parameters(), torch.optim.Adam, stage=stage,
                                           collectives=collectives, lr=1e-2)
    ddp = DDP(model)
    opt = (torch.optim.Adam(ddp.parameters(), lr=1e-2) if kind == "ddp" else
           ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.Adam, lr=1e-2))
    return model, ddp, opt


def _train(model, forward, optimizer, steps: int) -> None:
    """Each rank its own batch; zero_grad comes first, so the last step's gradients stay live."""
    for t in range(steps):
        g = torch.Generator().manual_seed(1000 * t + dist.get_rank())
        x = torch.randn(8, model[0].in_features, generator=g).to(launch.device(), model[0].weight.dtype)
        optimizer.zero_grad()
        (forward(x) ** 2).mean().backward()
        optimizer.step()


def demo() -> int:
    from mini_dist.ring_allreduce import LEDGER
    print0 = launch.print0
    k, runs = launch.setup().world_size, {}
    for kind, stage in [("ddp", 0), ("zro", 0), ("zero", 0), ("zero", 1), ("zero", 2)]:
        runs[kind, stage] = _make(kind, torch.float64, stage)
        _train(*runs[kind, stage], steps=3)
    worst = max((p - q).abs().max().item() for s in (0, 1, 2) for ref in ("ddp", "zro")
                for p, q in zip(runs["zero", s][0].parameters(), runs[ref, 0][0].parameters()))
    equal = worst <= 1e-12  # fp64: only the order in which the K gradients are summed differs (~1e-16)
    print0(f"{runs['zero', 1][2].partition}\n3 Adam steps in fp64, stages 0/1/2 vs native DDP and "
           f"ZeroRedundancyOptimizer: max |diff| {worst:.1e} ({'PASS' if equal else 'FAIL'}: <= 1e-12)")
    model, forward, adam = _make("ddp", torch.float32)
    _train(model, forward, adam, 1)
    ddp_bytes = sum(v for c, v in memory_ledger(model.parameters(), adam).items() if c != "scalars")
    n, exact, per_n, sent = sum(p.numel() for p in model.parameters()), True, {}, {}
    for half in (False, True):
        b, state_bytes = (2, 12) if half else (4, 8)  # 12 = fp32 master 4 + Adam 8
        print0(f"\n{'bf16 params + fp32 master Adam' if half else 'fp32 Adam'}, K={k}, N={n:,} (rank 0 "
               f"shown; every rank checked)\nstage | sent/step B = formula   |  params   grads   state | "
               f"total B = formula")
        for stage in (0, 1, 2):
            model, forward, zero = _make("zero", torch.bfloat16 if half else torch.float32, stage)
            _train(model, forward, zero, 1)
            LEDGER.reset()
            _train(model, forward, zero, 1)  # one step's bytes; the ledger right after it
            want = memory_formula(stage, zero.partition, b, state_bytes)
            got = [memory_ledger(model.parameters(), zero)[c] for c in want]
            sent[half, stage], per_n[half, stage] = LEDGER.sent, sum(got) / n
            exact &= got == list(want.values())
            exact &= LEDGER.sent == bytes_sent_formula(stage, zero.partition, b)
            print0(f"{stage:<6}| {LEDGER.sent:>11,} = {'232'[stage]}(K-1)S*b | {got[0]:>7,} {got[1]:>7,} "
                   f"{got[2]:>7,} | {sum(got):>7,} = {FORMULAS[half][stage]} = {per_n[half, stage]:.2f}N")
    ratio = [sent[False, s] / max(1, sent[False, 0]) for s in (1, 2)]
    print0(f"\nnative DDP + Adam measures {ddp_bytes / n:.2f}N, as stage 0. " + (
        f"Bytes vs DDP: ZeRO-1 {ratio[0]:.2f}x, ZeRO-2 {ratio[1]:.2f}x (its reduce-scatter halves the "
        f"gradient traffic, the parameter all-gather spends it again)" if k > 1 else "K=1 sends nothing.") +
        f"\nfp32 ZeRO-1 measures {per_n[False, 1]:.2f}N = 8N + 8N/K; the often-quoted 4N + 12N/K = "
        f"{per_n[True, 1]:.2f}N is the half-precision accounting (bf16 + fp32 master above)")
    if "--bench" in sys.argv:  # ms per step in one run, native collectives, after a warm-up step
        times = {}
        for name, kind, stage in [("DDP + Adam", "ddp", 0), ("DDP + ZeroRedundancyOptimizer", "zro", 0),
                                  ("ZeroOptimizer stage 1", "zero", 1), ("ZeroOptimizer stage 2", "zero", 2)]:
            made = _make(kind, torch.float32, stage, (512, 1024, 1024, 512), collectives="native")
            _train(*made, steps=1)
            dist.barrier()
            start = time.perf_counter()
            _train(*made, steps=5)
            if launch.device().type == "cuda":  # the last step's kernels may still run: wait for them
                torch.cuda.synchronize()
            dist.barrier()
            times[name] = (time.perf_counter() - start) / 5
        zro = times["DDP + ZeroRedundancyOptimizer"]
        print0(f"\nbench: {sum(p.numel() for p in made[0].parameters()) / 1e6:.1f}M fp32 parameters, "
               f"Adam, K={k}, native collectives, 5 steps after a warm-up" + "".join(
                   f"\n  {name:<30} {t * 1e3:8.1f} ms/step  ({t / zro:.2f}x ZeroRedundancyOptimizer)"
                   for name, t in times.items()))
    return launch.conclude("zero", equal, f"= DDP and ZeroRedundancyOptimizer ({worst:.0e})",
                           exact and ddp_bytes == 16 * n,
                           f"bytes, memory = formulas (ZeRO-2 {per_n[False, 2]:.2f}N)")


if __name__ == "__main__":
    raise SystemExit(demo())
