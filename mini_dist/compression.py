"""Gradient compression: send fewer bytes per step, and carry what was not sent into the next step.

A DDP communication hook replaces the all-reduce of one bucket: hook(state, bucket) -> Future[Tensor], the
bucket holding this rank's summed gradients (mini_dist/buckets.py). The naive way casts: fp16 or bf16 halves
the bytes and rounds every gradient. PowerSGD (Vogels, Karimireddy & Jaggi, NeurIPS 2019) sends a rank-r
approximation of each gradient matrix M (n x m; a conv weight is n x the rest), found by one step of power
iteration from last step's Q (warm start):

    P = M Q           all-reduce P (n r numbers), orthogonalize its columns (Gram-Schmidt; QR for r > 2)
    Q = M^T P         all-reduce Q (m r numbers), divide by N        ->   M ~ P Q^T

    numbers sent per matrix:  r (n + m)  instead of  n m      (64 x 64 at r = 1: 128 instead of 4,096)

P and Q are linear in M, so the all-reduced P Q^T compresses the mean of the ranks' gradients. Vectors
(biases), and matrices that would not shrink by min_compression_rate, are all-reduced whole in one
buffer. The compressor is biased: what it drops from a gradient, it drops again next step. Error
feedback keeps it: every rank compresses g + e and stores

    e <- (g + e) - what was applied       (exactly what was not sent)

so nothing is lost, only delayed. Without it a low rank can stall: the steady small directions of the
gradient never make it into the top r.

    torchrun --standalone --nproc_per_node=4 mini_dist/compression.py [--steps 60] [--ranks 1 2 4]

Mirrors torch.distributed.algorithms.ddp_comm_hooks (fp16_compress_hook, bf16_compress_hook,
PowerSGDState, powerSGD_hook): with the same state and seed, the same gradients bit for bit.
"""
import functools
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

if not __package__:  # run as `torchrun mini_dist/x.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist.collectives import all_reduce
from mini_dist.ddp import DistributedDataParallel
from mini_dist.kit import launch, models
from mini_dist.kit.wire import LEDGER
from mini_dist.reducer import launch_on_comm_thread


def _all_reduce_(x: torch.Tensor, group) -> torch.Tensor:
    """In place, counted in the kit's LEDGER (bytes handed to the all-reduce)."""
    return x.copy_(all_reduce(x, group))


# ----------------------------------------------------------------------------- naive: fewer bits

def cast_compress_hook(dtype, process_group, bucket) -> torch.futures.Future[torch.Tensor]:
    """Divide by N first (a sum of N half gradients could overflow), all-reduce in `dtype`, cast back."""
    def run():
        half = bucket.buffer().to(dtype).div_(dist.get_world_size(process_group))
        return bucket.buffer().copy_(_all_reduce_(half, process_group))
    return launch_on_comm_thread(run)  # on DDP's communication thread: backward goes on meanwhile


def fp16_compress_hook(process_group, bucket) -> torch.futures.Future[torch.Tensor]:
    return cast_compress_hook(torch.float16, process_group, bucket)


def bf16_compress_hook(process_group, bucket) -> torch.futures.Future[torch.Tensor]:
    return cast_compress_hook(torch.bfloat16, process_group, bucket)


# ----------------------------------------------------------------------------- PowerSGD: fewer numbers

class PowerSGDState:
    """Hyperparameters and, per bucket index, the error e and the warm-started P and Q (torch's names).

    Before step start_powerSGD_iter the hook all-reduces plainly. With error feedback or warm start it
    must be >= 2 (torch's rule: its DDP rebuilds buckets after the first step, and e, P, Q follow buckets)."""

    def __init__(self, process_group=None, matrix_approximation_rank: int = 1, start_powerSGD_iter: int = 1_000,
                 min_compression_rate: float = 2, use_error_feedback: bool = True, warm_start: bool = True,
                 orthogonalization_epsilon: float = 0, random_seed: int = 0):
        if not isinstance(matrix_approximation_rank, int) or matrix_approximation_rank < 1:
            raise ValueError(f"matrix_approximation_rank must be an integer >= 1, got {matrix_approximation_rank}")
        if (use_error_feedback or warm_start) and start_powerSGD_iter <= 1:
            raise ValueError("start_powerSGD_iter must be > 1 with error feedback or warm start (as in torch): "
                             "run at least two plain steps first")
        self.process_group = process_group
        self.matrix_approximation_rank = matrix_approximation_rank
        self.start_powerSGD_iter = start_powerSGD_iter
        self.min_compression_rate = min_compression_rate
        self.use_error_feedback = use_error_feedback
        self.warm_start = warm_start
        self.orthogonalization_epsilon = orthogonalization_epsilon
        self.rng = np.random.RandomState(random_seed)  # the same draws on every rank: the same Qs
        self.error_dict = {}     # per bucket index: e, what was not sent
        self.p_memory_dict = {}  # per bucket index: every matrix's P, side by side in one flat buffer
        self.q_memory_dict = {}  # and every Q: last step's is the warm start
        self.iter = 0
        self.total_numel_before_compression = 0
        self.total_numel_after_compression = 0

    def maybe_increase_iter(self, bucket) -> None:
        if bucket.is_last():
            self.iter += 1


def orthogonalize(M: torch.Tensor, epsilon: float = 0) -> None:
    """Orthonormal columns, in place: Gram-Schmidt for rank <= 2 and half precision, else QR (torch's choice)."""
    if M.shape[1] > 2 and M.dtype not in (torch.float16, torch.bfloat16):
        torch.linalg.qr(M, out=(M, M.new_empty(M.shape[1], M.shape[1])))
        return
    for i in range(M.shape[1]):
        col = M[:, i:i + 1]
        col /= torch.norm(col, dim=0, keepdim=True) + epsilon
        rest = M[:, i + 1:]
        rest -= torch.sum(col * rest, dim=0, keepdim=True) * col  # remove col from the columns after it


def should_compress(n: int, m: int, r: int, min_compression_rate: float) -> bool:
    """Worth it when r(n + m) * min_compression_rate < n m; r is at most min(n, m) (torch clamps it)."""
    return min(n, m, r) * (n + m) * min_compression_rate < n * m


def powerSGD_hook(state: PowerSGDState, bucket) -> torch.futures.Future[torch.Tensor]:
    """torch's signature: register with ddp.register_comm_hook(state, powerSGD_hook)."""
    return launch_on_comm_thread(functools.partial(_powersgd, state, bucket))  # backward goes on meanwhile


def _powersgd(state: PowerSGDState, bucket) -> torch.Tensor:
    """One bucket: g + e; P = M Q, all-reduce P, orthogonalize; Q = M^T P, all-reduce Q; M ~ P Q^T; e."""
    group = state.process_group
    k = bucket.index()
    buffer = bucket.buffer()
    N = dist.get_world_size(group)
    if state.iter < state.start_powerSGD_iter:  # warm-up: the plain average
        state.maybe_increase_iter(bucket)
        return _all_reduce_(buffer.div_(N), group)
    if state.use_error_feedback:
        if k in state.error_dict:
            buffer.add_(state.error_dict[k])  # g + e: last step's leftovers join this step's gradient
        else:
            state.error_dict[k] = torch.zeros_like(buffer)
        before = buffer.clone()
    matrices = []  # compressed: P and Q go instead
    whole = []     # all-reduced as they are
    for g in bucket.gradients():
        M = g.view(g.shape[0], -1)                                         # [n, m]
        r = min(*M.shape, state.matrix_approximation_rank)
        state.total_numel_before_compression += M.numel()
        if should_compress(*M.shape, r, state.min_compression_rate):
            matrices.append(M)
            state.total_numel_after_compression += r * sum(M.shape)
        else:
            whole.append(g)
            state.total_numel_after_compression += M.numel()
    shapes = list(dict.fromkeys(M.shape for M in matrices))
    matrices.sort(key=lambda M: shapes.index(M.shape))  # torch's order (grouped by shape): the same Qs
    ranks = [min(*M.shape, state.matrix_approximation_rank) for M in matrices]
    p_sizes = [M.shape[0] * r for M, r in zip(matrices, ranks)]
    q_sizes = [M.shape[1] * r for M, r in zip(matrices, ranks)]
    fresh = not state.warm_start or k not in state.p_memory_dict
    if fresh:
        state.p_memory_dict[k] = buffer.new_empty(sum(p_sizes))
        state.q_memory_dict[k] = buffer.new_empty(sum(q_sizes))
    p_parts = state.p_memory_dict[k].split(p_sizes)
    q_parts = state.q_memory_dict[k].split(q_sizes)
    ps = [p.view(M.shape[0], r) for p, M, r in zip(p_parts, matrices, ranks)]  # [n, r] each
    qs = [q.view(M.shape[1], r) for q, M, r in zip(q_parts, matrices, ranks)]  # [m, r] each
    if fresh:  # a random start, the same on every rank (one seed per step from the shared rng)
        g = torch.Generator().manual_seed(int(state.rng.randint(1_000_000_000)))
        for q in qs:
            q.copy_(torch.randn(q.shape, generator=g, dtype=q.dtype))
    for q in qs:
        orthogonalize(q, state.orthogonalization_epsilon)
    # each product as torch's hook computes it, a batch of one (bmm): a 2-D matmul may sum in another order
    for M, q, p in zip(matrices, qs, ps):
        torch.bmm(M[None], q[None], out=p[None])                             # P = M Q
    flat = torch.cat([t.view(-1) for t in whole]) if whole else buffer.new_empty(0)
    _all_reduce_(flat, group).div_(N)                                        # the rest, whole, in one buffer
    for t, mean in zip(whole, flat.split([t.numel() for t in whole])):
        t.copy_(mean.view_as(t))
    _all_reduce_(state.p_memory_dict[k], group)
    for M, p, q in zip(matrices, ps, qs):
        orthogonalize(p, state.orthogonalization_epsilon)
        torch.bmm(M.t()[None], p[None], out=q[None])                         # Q = M^T P
    _all_reduce_(state.q_memory_dict[k], group).div_(N)
    for M, p, q in zip(matrices, ps, qs):
        torch.bmm(p[None], q.t()[None], out=M[None])                         # M ~ P Q^T, into the bucket
    if state.use_error_feedback:
        state.error_dict[k] = before - buffer                                # exactly what was not sent
    if not state.warm_start:
        state.p_memory_dict.clear()
        state.q_memory_dict.clear()
    state.maybe_increase_iter(bucket)
    return buffer


# ----------------------------------------------------------------------------- demo

def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("--steps", type=int, default=60, help="SGD steps (momentum 0.9) per run")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4], help="PowerSGD ranks r to compare")
    p.add_argument("--widths", type=int, nargs="+", default=[32, 32, 32], help="layer widths of the linear model")
    p.add_argument("--start-iter", type=int, default=2, help="plain all-reduce steps before PowerSGD (>= 2)")
    return p


def train(widths, hook, state_args, steps: int, lr: float, native: bool = False) -> tuple:
    """Mini DDP over models.linears(widths) with our hook (torch's with native=True; None: DDP's all-reduce),
    trained by models.teacher_steps: the test losses, the final parameters, the bytes of the last step."""
    model = models.linears(widths)
    ddp = DistributedDataParallel(model)
    make_state = PowerSGDState
    if native:  # torch's own hook and state class: the reference
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook as torchs
        make_state = torchs.PowerSGDState
        hook = default_hooks.fp16_compress_hook if hook is fp16_compress_hook else torchs.powerSGD_hook
    if hook is not None:
        ddp.register_comm_hook(make_state(None, **state_args) if state_args is not None else None, hook)
    losses = models.teacher_steps(model, ddp, steps, lr)
    sent = sum(LEDGER.bytes.values()) if hook else ddp.timeline.bytes  # a hook's all-reduces, or DDP's
    return losses, [p.detach().clone() for p in model.parameters()], sent


def demo(args) -> int:
    w = args.widths
    launch.require(len(w) >= 2 and min(w) >= 1 and args.steps >= 1 and args.lr > 0 and args.start_iter >= 2,
                   "--widths needs two or more sizes >= 1, --steps >= 1, --lr > 0, --start-iter >= 2")
    small = min(min(a, b) for a, b in zip(w, w[1:]))
    launch.require(min(args.ranks) >= 1 and max(args.ranks) <= small, f"--ranks {max(args.ranks)}: a gradient "
                   f"matrix of this model has rank at most {small}; choose ranks from 1 to {small}")
    launch.require(all(should_compress(b, a, r, 2) for r in args.ranks for a, b in zip(w, w[1:])),
                   f"--ranks {max(args.ranks)}: r(n + m) * 2 >= n m for a layer of widths {w}, so PowerSGD would "
                   f"send it whole; choose a smaller r or wider layers")
    env = launch.setup()
    layers = list(zip(w, w[1:]))  # (in, out) of each Linear: its weight's gradient is an out x in matrix
    D = 4 * sum(a * b + b for a, b in layers)
    runs = {"none": (None, None, D, "D"), "fp16": (fp16_compress_hook, None, D // 2, "D/2")}  # hook, state, bytes
    for r in args.ranks:
        low = 4 * sum(r * (a + b) + b for a, b in layers)
        for feedback in (True, False):
            name = f"PowerSGD r={r}{' + EF' if feedback else ', no EF'}"
            state = dict(matrix_approximation_rank=r, start_powerSGD_iter=args.start_iter, use_error_feedback=feedback)
            runs[name] = (powerSGD_hook, state, low, "4 (sum r(n+m) + biases)")
    results = {name: train(w, hook, state, args.steps, args.lr) for name, (hook, state, _, _) in runs.items()}
    theirs = {name: train(w, hook, state, args.steps, args.lr, native=True)[1]  # torch's hooks: the reference
              for name, (hook, state, _, _) in runs.items() if hook}
    diff = max((a - b).abs().max().item() for name in theirs for a, b in zip(results[name][1], theirs[name]))
    launch.print0(f"{env.world_size} ranks, mini DDP with each hook vs torch's own hook, {args.steps} steps: "
                  f"max |parameter difference| {diff:.1e}")
    launch.print0(f"gradient matrices {', '.join(f'{b} x {a}' for a, b in layers)}: PowerSGD sends "
                  f"r(n + m) numbers for each instead of n m; biases go whole\n\n{'hook':<22}"
                  f"{'bytes all-reduced per step, per rank':>38}{'  (formula)':<40}{'loss: start':>11}"
                  f"{f'step {args.steps // 2}':>10}{f'step {args.steps}':>10}")
    bytes_ok = True
    for name, (hook, _, want, formula) in runs.items():
        if hook and env.world_size == 1:  # a hook's all-reduce on one rank sends nothing (DDP's own counts D)
            want = 0
            formula = "N = 1: none"
        losses, _, sent = results[name]
        bytes_ok &= sent == want
        launch.print0(f"{name:<22}{sent:>36,} B{f'  ({want:,} = {formula})':<40}{losses[0]:>11.2e}"
                      f"{losses[max(args.steps // 2 - 1, 0)]:>10.2e}{losses[-1]:>10.2e}")
    r1 = min(args.ranks)
    with_feedback = results[f"PowerSGD r={r1} + EF"][0][-1]
    without = results[f"PowerSGD r={r1}, no EF"][0][-1]
    return launch.conclude("compression", diff == 0.0, f"hooks = torch's bit for bit ({diff:.0e})",
                           bytes_ok and with_feedback < without, f"bytes = r(n+m) formulas; r={r1} loss with "
                           f"error feedback {with_feedback:.2e} vs without {without:.2e}")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
