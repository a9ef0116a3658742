"""Activation checkpointing: keep a segment's input, not its activations; recompute them in backward.

Backward needs tensors from forward (activations): L layers keeping A bytes each hold L*A until their
backward. Checkpointing a segment keeps only its input (I bytes) and runs its forward again in backward
(Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost"). L layers cut into k segments keep k
inputs, plus, while one segment is recomputed, its L/k layers:

    memory  M(k) = k*I + (L/k)*A,  least at k = sqrt(L*A/I)  (k = sqrt(L) when I ~ A: 2*sqrt(L) layers)
    compute one extra forward: F + 2F + F = 4/3 of a step, when backward costs twice the forward

checkpoint_sequential (torch's and ours) leaves the last segment alone, as backward needs it first:
(k-1)*I + (L - (k-1)*floor(L/k))*A bytes stay after forward. Selective checkpointing (Korthikanti et al.
2022) keeps the outputs of the matmuls, which cost the FLOPs, and recomputes the cheap ops (norms,
softmax, GeLU, dropout), which cost the bytes: in attention the 5as^2b of a layer's sbh(34 + 5as/h).

Two ways to recompute, both in torch.utils.checkpoint:
- reentrant (naive, use_reentrant=True): an autograd.Function runs the segment under no_grad keeping its
  inputs; its backward runs it again with grad on and calls torch.autograd.backward inside backward. So
  (1) when no input requires grad, neither does the output: the weights inside get no gradient; (2) the
  inner backward writes the weights' .grad, so torch.autograd.grad(loss, weights) cannot see them;
  (3) Function.apply takes no keyword arguments.
- non-reentrant (use_reentrant=False, which PyTorch recommends; `checkpoint` here): the segment runs with
  grad on, so the graph is the real one, but saved_tensors_hooks put a number where each saved tensor
  would go. The first number backward unpacks re-runs the segment (same RNG state: dropout draws the same
  mask) and every number gets its recomputed tensor. One backward, so all three cases just work.
Measured, not assumed (mini_dist.measure): bytes saved for backward, bytes alive op by op, FLOPs.

    torchrun --standalone --nproc_per_node=1 mini_dist/activation_checkpoint.py [--layers 16 --segments 4]

Mirrors torch.utils.checkpoint (checkpoint, checkpoint_sequential, create_selective_checkpoint_contexts)
and, for checkpoint_module, torch.distributed._composable.checkpoint.
"""
import contextlib
import functools
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

if not __package__:  # run as `torchrun mini_dist/x.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist.kit import launch
from mini_dist.kit.measure import bars, profile_step


def rng_state(tensors) -> tuple:
    """The CPU generator's state and that of every GPU holding one of the tensors."""
    devices = sorted({t.device.index for t in tensors if t.is_cuda})
    return torch.get_rng_state(), devices, [torch.cuda.get_rng_state(d) for d in devices]


@contextlib.contextmanager
def replayed_rng(state):
    """Inside: the RNG as forward found it, so dropout draws the same mask. After: as backward left it."""
    cpu, devices, gpus = state
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(cpu)
        for device, gpu in zip(devices, gpus):
            torch.cuda.set_rng_state(gpu, device)
        yield


# ----- naive: reentrant -----

class ReentrantCheckpoint(torch.autograd.Function):
    """.apply(fn, *inputs) = torch.utils.checkpoint.checkpoint(fn, *inputs, use_reentrant=True), tensors only."""

    @staticmethod
    def forward(ctx, fn, *inputs):
        ctx.fn, ctx.rng = fn, rng_state(inputs)
        ctx.save_for_backward(*inputs)
        return fn(*inputs)  # a Function's forward runs without grad: nothing inside is saved

    @staticmethod
    def backward(ctx, grad):
        inputs = [x.detach().requires_grad_(x.requires_grad) for x in ctx.saved_tensors]
        with replayed_rng(ctx.rng), torch.enable_grad():
            output = ctx.fn(*inputs)
        torch.autograd.backward(output, grad)  # the engine inside the engine: weights' .grad filled here
        return None, *(x.grad for x in inputs)


# ----- non-reentrant, and selective -----

class SaveForRecompute(torch.autograd.Function):
    """Keeps a segment's inputs (and a policy's kept outputs) the way autograd keeps activations, so that
    saved_tensors_hooks see them, as they see torch's checkpoint inputs. Its output is never used."""

    @staticmethod
    def forward(ctx, anchor, *tensors):
        ctx.save_for_backward(*tensors)
        return anchor.new_empty(0)


MATMULS = [torch.ops.aten.mm.default, torch.ops.aten.addmm.default]  # nn.Linear's, not attention's bmm


def keep_matmuls(op) -> bool:
    """The selective policy: keep what the weight matmuls return, recompute everything else."""
    return op in MATMULS


class Selective(TorchDispatchMode):
    """Sees every op of a segment. In forward (kept: a list) it keeps the outputs of the ops policy(op)
    keeps; in recomputation (kept: an iterator over them) those ops hand them back instead of running."""

    def __init__(self, policy, kept):
        super().__init__()
        self.policy, self.kept = policy, kept

    def __torch_dispatch__(self, op, types, args=(), kwargs=None):
        if self.policy(op) and not isinstance(self.kept, list):
            return next(self.kept).detach()
        out = op(*args, **(kwargs or {}))
        if self.policy(op):
            self.kept.append(out.detach())
        return out


class Checkpoint:
    """One checkpointed call of fn. Forward: fn runs with a number saved in place of every tensor it
    saves; what stays are the tensors among its arguments (and what a policy keeps), in SaveForRecompute.
    Backward: the first number unpacked re-runs fn, and every number gets its recomputed tensor."""

    def __init__(self, fn, policy=None):
        self.fn, self.policy, self.count, self.recomputed = fn, policy, 0, []

    def forward(self, args, kwargs):
        values = [*args, *kwargs.values()]
        self.n_args, self.names = len(args), list(kwargs)
        self.is_tensor = [isinstance(v, torch.Tensor) for v in values]
        self.others = [None if t else v for v, t in zip(values, self.is_tensor)]  # tensors go to autograd
        inputs, kept = [v for v, t in zip(values, self.is_tensor) if t], []
        self.rng, self.n_inputs = rng_state(inputs), len(inputs)
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack), self.selective(kept):
            out = self.fn(*args, **kwargs)
        anchor = torch.empty(0, requires_grad=True)  # gives SaveForRecompute a graph node to live in
        self.saved = SaveForRecompute.apply(anchor, *inputs, *kept)
        return out

    def selective(self, kept):
        return Selective(self.policy, kept) if self.policy else contextlib.nullcontext()

    def pack(self, tensor) -> int:
        """Forward: a number instead of the tensor, which is freed as soon as forward lets go of it."""
        self.count += 1
        return self.count - 1

    def unpack(self, number: int) -> torch.Tensor:
        """Backward: the first unpack recomputes the segment (again under retain_graph's next backward)."""
        if number >= len(self.recomputed) or self.recomputed[number] is None:
            self.recompute()
        tensor, self.recomputed[number] = self.recomputed[number], None  # freed once its node is done
        return tensor

    def recompute(self) -> None:
        saved = self.saved.grad_fn.saved_tensors
        inputs = iter([x.detach().requires_grad_(x.requires_grad) for x in saved[:self.n_inputs]])
        values = [next(inputs) if t else v for v, t in zip(self.others, self.is_tensor)]
        self.recomputed = []
        capture = torch.autograd.graph.saved_tensors_hooks(lambda t: self.recomputed.append(t.detach()),
                                                           lambda nothing: nothing)
        with replayed_rng(self.rng), torch.enable_grad(), capture, self.selective(iter(saved[self.n_inputs:])):
            self.fn(*values[:self.n_args], **dict(zip(self.names, values[self.n_args:])))
        if len(self.recomputed) != self.count:
            raise RuntimeError(f"a checkpointed segment saved {self.count} tensors in forward and "
                               f"{len(self.recomputed)} when recomputed: it must compute the same thing "
                               "both times (same branches and shapes; randomness only from torch's RNG)")


def checkpoint(fn, *args, policy=None, **kwargs):
    """fn(*args, **kwargs), keeping for backward only the tensors among args and kwargs (and, with a
    policy, the outputs of the ops policy(op) keeps): torch.utils.checkpoint.checkpoint(...,
    use_reentrant=False), or with context_fn=create_selective_checkpoint_contexts(ops) for a policy."""
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)  # no graph, nothing saved: nothing to recompute
    return Checkpoint(fn, policy).forward(args, kwargs)


def run_layers(layers, x):
    for layer in layers:
        x = layer(x)
    return x


def checkpoint_sequential(model, segments: int, x, policy=None):
    """model(x) in `segments` pieces of len(model) // segments layers, each but the last checkpointed
    (the last takes the rest): torch.utils.checkpoint.checkpoint_sequential(..., use_reentrant=False)."""
    if not isinstance(model, (nn.Sequential, nn.ModuleList, list, tuple)):
        raise TypeError(f"checkpoint_sequential cuts a chain of layers (nn.Sequential, nn.ModuleList or a "
                        f"list), got {type(model).__name__}: checkpoint its blocks with checkpoint(block, x)")
    layers = list(model)
    if isinstance(segments, bool) or not isinstance(segments, int) or not 1 <= segments <= len(layers):
        raise ValueError(f"segments must be a whole number from 1 to the {len(layers)} layers, got {segments!r}")
    size = len(layers) // segments
    for start in range(0, size * (segments - 1), size):
        x = checkpoint(run_layers, layers[start:start + size], x, policy=policy)
    return run_layers(layers[size * (segments - 1):], x)


def checkpoint_module(module: nn.Module, policy=None) -> nn.Module:
    """Checkpoint every call of `module`, in place: no wrapper, so parameter names stay (as with
    torch.distributed._composable.checkpoint); its hooks run once, outside the checkpoint."""
    module.forward = functools.partial(checkpoint, module.forward, policy=policy)
    return module


# ----- demo: a tiny transformer, each strategy measured beside its formula and against torch -----

class TransformerLayer(nn.Module):
    """A pre-norm GPT layer written op by op, so that what it saves is Korthikanti et al.'s count (their
    Section 4.1): e(16sbh + 2as^2b) + 2sbh + as^2b bytes, plus the layer norms' mean and 1/std."""

    def __init__(self, hidden, heads, dropout=0.1, dtype=None):
        super().__init__()
        self.heads, self.p, h, kw = heads, dropout, hidden, dict(dtype=dtype)
        self.ln1, self.qkv, self.proj = nn.LayerNorm(h, **kw), nn.Linear(h, 3 * h, **kw), nn.Linear(h, h, **kw)
        self.ln2, self.fc1, self.fc2 = nn.LayerNorm(h, **kw), nn.Linear(h, 4 * h, **kw), nn.Linear(4 * h, h, **kw)

    def drop(self, x):  # native_dropout keeps a 1-byte mask on any device (F.dropout on the CPU: e bytes)
        return torch.native_dropout(x, self.p, True)[0]

    def forward(self, x):                                                                  # [b, s, h]
        q, k, v = self.qkv(self.ln1(x)).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)  # [b, a, s, d]
        attn = self.drop((q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).softmax(-1))  # [b, a, s, s]
        x = x + self.drop(self.proj((attn @ v).transpose(1, 2).flatten(2)))               # [b, s, h]
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


def strategies(L: int, k: int, s: int, h: int) -> list:
    """(name, ours, torch's, kept bytes after forward as a function of A and I, FLOPs over no checkpoint).
    A recomputed layer adds its forward to F + 2F; selective recomputes only attention's two bmm, 4bs^2h
    of a layer's 24bsh^2 + 4bs^2h forward FLOPs."""
    from torch.utils import checkpoint as tc
    each = lambda ckpt: lambda m, x: run_layers([functools.partial(ckpt, layer) for layer in m], x)  # noqa: E731
    sac = functools.partial(tc.create_selective_checkpoint_contexts, MATMULS)
    n = L // k
    return [("none", lambda m, x: m(x), lambda m, x: m(x), lambda A, I: L * A, 1),
            ("every layer", each(checkpoint), each(functools.partial(tc.checkpoint, use_reentrant=False)),
             lambda A, I: L * I, 4 / 3),
            (f"every {n} layers", lambda m, x: checkpoint_sequential(m, k, x),
             lambda m, x: tc.checkpoint_sequential(m, k, x, use_reentrant=False),
             lambda A, I: (k - 1) * I + (L - (k - 1) * n) * A, 1 + (k - 1) * n / (3 * L)),
            ("selective", each(functools.partial(checkpoint, policy=keep_matmuls)),
             each(functools.partial(tc.checkpoint, use_reentrant=False, context_fn=sac)),
             lambda A, I: 10 * L * I, 1 + s / (3 * (6 * h + s)))]  # input + qkv 3 + proj 1 + fc1 4 + fc2 1


def measure_step(run, model, x, dy, seed: int) -> dict:
    """mini_dist.measure.profile_step of run(model, x), with forward calls per layer and the gradients."""
    calls = []
    hooks = [layer.register_forward_pre_hook(lambda *_: calls.append(1)) for layer in model]
    model.zero_grad()
    torch.manual_seed(seed)  # the same dropout masks for every strategy
    step = profile_step(lambda: run(model, x), lambda out: out.backward(dy), exclude=model.parameters())
    [hook.remove() for hook in hooks]
    return dict(step, calls=len(calls) / len(model), grads=[p.grad.clone() for p in model.parameters()])


def parser():
    p = launch.demo_parser(__doc__)
    for flag, default, text in [("layers", 16, "L, transformer layers"), ("batch", 2, "b, sequences"),
                                ("segments", 0, "k for checkpoint_sequential (0: round(sqrt(L)))"),
                                ("seq", 64, "s, tokens"), ("hidden", 64, "h"), ("heads", 4, "a"), ("seed", 0, ""),
                                ("dropout", 0.1, "dropout probability (masks are recomputed)")]:
        p.add_argument(f"--{flag}", type=type(default), default=default, help=text)
    return p


def demo(args) -> int:
    L, k, b, s, h, a, e = args.layers, args.segments, args.batch, args.seq, args.hidden, args.heads, 4
    k = k or max(1, round(math.sqrt(L)))
    for ok, message in [(min(L, b, s, h, a) >= 1, "--layers, --batch, --seq, --hidden and --heads must be >= 1"),
                        (1 <= k <= L, f"--segments must lie between 1 and --layers ({L}), got {k}"),
                        (a < 1 or h % a == 0, f"--heads ({a}) must divide --hidden ({h})"),
                        (0 <= args.dropout < 1, f"--dropout must lie in [0, 1), got {args.dropout}")]:
        launch.require(ok, message)
    env = launch.setup(seed=args.seed)
    model = nn.Sequential(*[TransformerLayer(h, a, args.dropout) for _ in range(L)]).to(env.device)
    x, dy = (torch.randn(b, s, h, device=env.device) for _ in range(2))  # data: x needs no gradient
    A = e * (16 * s * b * h + 2 * a * s * s * b) + 2 * s * b * h + a * s * s * b + 4 * s * b * e  # + norms' stats
    I = e * s * b * h
    launch.print0(f"{L} layers b={b} s={s} h={h} a={a} fp32: each keeps A = e(16sbh + 2as^2b) + 2sbh + as^2b "
                  f"+ 4sbe = {A:,} B; a layer's input is I = e*sbh = {I:,} B\n{'strategy':<16}"
                  f"{'kept after forward':>19}{'formula':>18}{'backward peak':>15}{'forward calls':>15}"
                  f"{'FLOPs':>8}{'formula':>9}")
    rows, worst, figures_ok = {}, 0.0, True
    for name, ours, native, kept, more in strategies(L, k, s, h):
        rows[name] = got = measure_step(ours, model, x, dy, args.seed + env.rank)
        for ref in (rows["none"], measure_step(native, model, x, dy, args.seed + env.rank)):
            worst = max([worst] + [(p - q).abs().max().item() for p, q in zip(got["grads"], ref["grads"])])
        flops = got["flops"] / rows["none"]["flops"]
        figures_ok &= got["saved"] == kept(A, I) and math.isclose(flops, more, rel_tol=1e-12)
        launch.print0(f"{name:<16}{got['saved']:>19,}{kept(A, I):>18,}{max(got['backward']):>15,}"
                      f"{got['calls']:>14.3g}x{flops:>8.3f}{more:>9.3f}")
    top = max(max(r["backward"]) for r in rows.values())
    launch.print0(f"gradients vs none and vs torch.utils.checkpoint: max |diff| {worst:.1e}\n"
                  "activation bytes alive during backward (time ->), one scale for all:")
    for name, row in rows.items():
        launch.print0(f"  {name:<16}|{bars(row['backward'], top)}| peak {max(row['backward']) / 2**20:.2f} MiB")
    return launch.conclude("activation_checkpoint", worst == 0, "gradients bit-identical to none and torch",
                           figures_ok, f"kept bytes and FLOPs = formulas; k={k} keeps "
                           f"{rows[f'every {L // k} layers']['saved'] / rows['none']['saved']:.0%} of none")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
