"""Activation checkpointing: keep a segment's input, not its activations; recompute them in backward.

Backward needs tensors from forward (activations): L layers keeping A bytes each hold L*A until their
backward. Checkpointing a segment keeps only its input (I bytes) and the RNG state; backward runs its
forward again, with grad on and the same dropout masks, and backpropagates through it (Chen et al. 2016,
"Training Deep Nets with Sublinear Memory Cost"). L layers cut into k segments keep k inputs, plus, while
one segment is recomputed, its L/k layers:

    memory  M(k) = k*I + (L/k)*A,  least at k = sqrt(L*A/I)  (k = sqrt(L) when I ~ A: 2*sqrt(L) layers)
    compute one extra forward: F + 2F + F = 4/3 of a step, when backward costs twice the forward

checkpoint_sequential (torch's and ours) leaves the last segment alone, as backward needs it first:
(k-1)*I + (L - (k-1)*floor(L/k))*A bytes stay after forward. Keeping some of a segment's tensors and
recomputing the rest is selective checkpointing: mini_dist/selective_checkpoint.py.

    torchrun --standalone --nproc_per_node=1 mini_dist/activation_checkpoint.py [--layers 16 --segments 4]

Mirrors torch.utils.checkpoint (checkpoint, checkpoint_sequential) and, for checkpoint_module,
torch.distributed._composable.checkpoint.
"""
import contextlib
import functools
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

if not __package__:  # run as `torchrun mini_dist/x.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist.kit import launch
from mini_dist.kit.measure import bars, profile_step


# ----- the textbook: forward without grad, keeping the input; backward recomputes, then backpropagates -----

class ReentrantCheckpoint(torch.autograd.Function):
    """.apply(fn, *inputs) = torch.utils.checkpoint.checkpoint(fn, *inputs, use_reentrant=True), tensors only."""

    @staticmethod
    def forward(ctx, fn, *inputs):
        # exercise: keep fn, the inputs (ctx.save_for_backward) and rng_state(inputs); return fn(*inputs)
        ctx.fn, ctx.rng = fn, rng_state(inputs)
        ctx.save_for_backward(*inputs)
        return fn(*inputs)  # a Function's forward runs without grad: nothing inside is saved
        # end exercise

    @staticmethod
    def backward(ctx, grad):
        # exercise: rerun fn with grad on under replayed_rng, backpropagate grad, return the inputs' grads
        inputs = [x.detach().requires_grad_(x.requires_grad) for x in ctx.saved_tensors]
        with replayed_rng(ctx.rng), torch.enable_grad():
            output = ctx.fn(*inputs)
        torch.autograd.backward(output, grad)  # the engine inside the engine: weights' .grad filled here
        return None, *(x.grad for x in inputs)
        # end exercise


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


# ----- non-reentrant: the real graph, with recomputed tensors where the saved ones would be -----
# What it buys: the textbook's backward is a second engine run, so (1) when no input requires grad, neither
# does its output, and the weights inside get no gradient; (2) the weights' .grad is written inside, where
# torch.autograd.grad(loss, weights) cannot see it; (3) Function.apply takes no keyword arguments. Here the
# segment runs with grad on, so the graph is the real one, but saved_tensors_hooks put a number where each
# saved tensor would go; the first number backward unpacks reruns the segment, and every number gets its
# recomputed tensor. One backward, so all three just work (PyTorch recommends this form).

class SaveForRecompute(torch.autograd.Function):
    """Keeps a segment's inputs (and what a context keeps) the way autograd keeps activations, so that
    saved_tensors_hooks see them, as they see torch's checkpoint inputs. Its output is never used."""

    @staticmethod
    def forward(ctx, anchor, *tensors):
        ctx.save_for_backward(*tensors)
        return anchor.new_empty(0)


class Checkpoint:
    """One checkpointed call of fn. Forward: fn runs with a number saved in place of every tensor it
    saves; what stays are the tensors among its arguments (and what `context` keeps), in SaveForRecompute.
    Backward: the first number unpacked reruns fn, and every number gets its recomputed tensor.
    context(kept), if given, is entered around fn: in forward kept is a list it may fill with tensors to
    keep, in the recomputation an iterator over them (selective checkpointing, selective_checkpoint.py)."""

    def __init__(self, fn, context=None):
        self.fn, self.count, self.recomputed = fn, 0, []
        self.context = context or (lambda kept: contextlib.nullcontext())

    def forward(self, args, kwargs):
        values = [*args, *kwargs.values()]
        self.n_args, self.names = len(args), list(kwargs)
        self.is_tensor = [isinstance(v, torch.Tensor) for v in values]
        self.others = [None if t else v for v, t in zip(values, self.is_tensor)]  # tensors go to autograd
        inputs, kept = [v for v, t in zip(values, self.is_tensor) if t], []
        self.rng, self.n_inputs = rng_state(inputs), len(inputs)
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack), self.context(kept):
            out = self.fn(*args, **kwargs)
        anchor = torch.empty(0, requires_grad=True)  # cpu: holds no data, only gives SaveForRecompute a node
        self.saved = SaveForRecompute.apply(anchor, *inputs, *kept)
        return out

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
        with replayed_rng(self.rng), torch.enable_grad(), capture, self.context(iter(saved[self.n_inputs:])):
            self.fn(*values[:self.n_args], **dict(zip(self.names, values[self.n_args:])))
        if len(self.recomputed) != self.count:
            raise RuntimeError(f"a checkpointed segment saved {self.count} tensors in forward and "
                               f"{len(self.recomputed)} when recomputed: it must compute the same thing "
                               "both times (same branches and shapes; randomness only from torch's RNG)")


def checkpoint(fn, *args, context=None, **kwargs):
    """fn(*args, **kwargs), keeping for backward only the tensors among args and kwargs (and what
    `context` keeps, see Checkpoint): torch.utils.checkpoint.checkpoint(..., use_reentrant=False)."""
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)  # no graph, nothing saved: nothing to recompute
    return Checkpoint(fn, context).forward(args, kwargs)


def run_layers(layers, x):
    for layer in layers:
        x = layer(x)
    return x


def checkpoint_sequential(model, segments: int, x, context=None):
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
        x = checkpoint(run_layers, layers[start:start + size], x, context=context)
    return run_layers(layers[size * (segments - 1):], x)


def checkpoint_module(module: nn.Module, context=None) -> nn.Module:
    """Checkpoint every call of `module`, in place: no wrapper, so parameter names stay (as with
    torch.distributed._composable.checkpoint); its hooks run once, outside the checkpoint."""
    module.forward = functools.partial(checkpoint, module.forward, context=context)
    return module


# ----- demo: a tiny transformer, each strategy measured beside its formula and against torch -----

class TransformerLayer(nn.Module):
    """A pre-norm GPT layer written op by op, so that what it saves is Korthikanti et al.'s count (their
    Section 4.1): e(16sbh + 2as^2b) + 2sbh + as^2b bytes, plus the layer norms' mean and 1/std."""

    def __init__(self, hidden, heads, dropout=0.1, dtype=None, device=None):
        super().__init__()
        self.heads, self.p, h = heads, dropout, hidden
        norm, linear = (functools.partial(m, dtype=dtype, device=device) for m in (nn.LayerNorm, nn.Linear))
        self.ln1, self.qkv, self.proj = norm(h), linear(h, 3 * h), linear(h, h)
        self.ln2, self.fc1, self.fc2 = norm(h), linear(h, 4 * h), linear(4 * h, h)

    def drop(self, x):  # native_dropout keeps a 1-byte mask on any device (F.dropout on the CPU: e bytes)
        return torch.native_dropout(x, self.p, True)[0]

    def forward(self, x):                                                                  # [b, s, h]
        q, k, v = self.qkv(self.ln1(x)).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)  # [b, a, s, d]
        attn = self.drop((q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).softmax(-1))  # [b, a, s, s]
        x = x + self.drop(self.proj((attn @ v).transpose(1, 2).flatten(2)))               # [b, s, h]
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


def layer_bytes(b: int, s: int, h: int, a: int, e: int = 4) -> tuple[int, int]:
    """(A, I): the bytes a TransformerLayer keeps for backward (with its norms' 4sb statistics), its input's."""
    return e * (16 * s * b * h + 2 * a * s * s * b) + 2 * s * b * h + a * s * s * b + 4 * s * b * e, e * s * b * h


def each_layer(ckpt):
    """run(model, x) with every layer of the model checkpointed by ckpt(layer, x)."""
    return lambda model, x: run_layers([functools.partial(ckpt, layer) for layer in model], x)


def strategies(L: int, k: int, s: int, h: int) -> list:
    """(name, ours, torch's, kept bytes after forward as a function of A and I, FLOPs over none): a
    recomputed layer adds its forward to F + 2F."""
    from torch.utils import checkpoint as tc
    n = L // k
    return [("none", lambda m, x: m(x), lambda m, x: m(x), lambda A, I: L * A, 1),
            ("every layer", each_layer(checkpoint), each_layer(functools.partial(tc.checkpoint, use_reentrant=False)),
             lambda A, I: L * I, 4 / 3),
            (f"every {n} layers", lambda m, x: checkpoint_sequential(m, k, x),
             lambda m, x: tc.checkpoint_sequential(m, k, x, use_reentrant=False),
             lambda A, I: (k - 1) * I + (L - (k - 1) * n) * A, 1 + (k - 1) * n / (3 * L))]


def measure_strategies(layers, segments, batch, seq, hidden, heads, dropout=0.1, seed=0, chosen=strategies) -> dict:
    """name -> profile_step's figures for each of chosen(...)'s strategies (and forward runs per layer), with
    its formulas and the largest |difference| of its gradients from none's and from torch's."""
    torch.manual_seed(seed)
    model = nn.Sequential(*[TransformerLayer(hidden, heads, dropout, device=launch.device()) for _ in range(layers)])
    x, dy = (torch.randn(batch, seq, hidden, device=launch.device()) for _ in range(2))  # x needs no gradient
    calls = []
    [layer.register_forward_pre_hook(lambda *_: calls.append(1)) for layer in model]

    def measure(run) -> dict:
        calls.clear(), model.zero_grad(), torch.manual_seed(seed)  # the same dropout masks for every strategy
        step = profile_step(lambda: run(model, x), lambda out: out.backward(dy), exclude=model.parameters())
        return dict(step, calls=len(calls) / layers, grads=[p.grad.clone() for p in model.parameters()])
    rows, (A, I) = {}, layer_bytes(batch, seq, hidden, heads)
    for name, ours, native, kept, more in chosen(layers, segments, seq, hidden):
        rows[name] = got = measure(ours)
        refs = [rows["none"]["grads"], measure(native)["grads"]]
        diff = max((p - q).abs().max().item() for ref in refs for p, q in zip(got["grads"], ref))
        got.update(kept=kept(A, I), more=more, ratio=got["flops"] / rows["none"]["flops"], diff=diff)
    return rows


def memory_and_compute(rows=None) -> tuple[str, bool]:
    """Question 18, and the demo's table: per strategy, the bytes kept after forward and alive at backward's
    peak, forward runs per layer and FLOPs over none, beside the formulas; holds when each equals its formula
    and every gradient is bit-identical to none's and torch's. rows: measure_strategies(...), 4 layers, k=2."""
    rows = rows or measure_strategies(layers=4, segments=2, batch=1, seq=16, hidden=16, heads=2)
    same = {n: r["saved"] == r["kept"] and math.isclose(r["ratio"], r["more"], rel_tol=1e-12) for n, r in rows.items()}
    return "bytes on this rank, kept after forward and alive at backward's peak; compute over none:\n" + ";\n".join(
        f"  {n:<16} kept {r['saved']:>11,} B {'=' if same[n] else '!='} formula {r['kept']:>11,} B, peak "
        f"{max(r['backward']):>11,} B, forward x{r['calls']:<4.3g} FLOPs x{r['ratio']:.3f} (formula "
        f"x{r['more']:.3f}), gradients' max |diff| {r['diff']:.0e}" for n, r in rows.items()), \
        all(same.values()) and all(r["diff"] == 0 for r in rows.values())


def parser(doc: str = __doc__, layers: int = 16, segments: bool = True):
    """The tiny transformer's flags, shared with selective_checkpoint's demo."""
    p = launch.demo_parser(doc)
    flags = [("layers", layers, "L, transformer layers"), ("batch", 2, "b, sequences")]
    flags += [("segments", 0, "k for checkpoint_sequential (0: round(sqrt(L)))")] if segments else []
    for flag, default, text in flags + [("seq", 64, "s, tokens"), ("hidden", 64, "h"), ("heads", 4, "a"),
                                        ("seed", 0, ""), ("dropout", 0.1, "dropout probability (masks are recomputed)")]:
        p.add_argument(f"--{flag}", type=type(default), default=default, help=text)
    return p


def demo(args) -> int:
    L, b, s, h, a = args.layers, args.batch, args.seq, args.hidden, args.heads
    k = args.segments or max(1, round(math.sqrt(L)))
    for ok, message in [(min(L, b, s, h, a) >= 1, "--layers, --batch, --seq, --hidden and --heads must be >= 1"),
                        (1 <= k <= L, f"--segments must lie between 1 and --layers ({L}), got {k}"),
                        (a < 1 or h % a == 0, f"--heads ({a}) must divide --hidden ({h})"),
                        (0 <= args.dropout < 1, f"--dropout must lie in [0, 1), got {args.dropout}")]:
        launch.require(ok, message)
    env = launch.setup(seed=args.seed)
    rows = measure_strategies(L, k, b, s, h, a, args.dropout, args.seed + env.rank)
    (A, I), (figure, holds) = layer_bytes(b, s, h, a), memory_and_compute(rows)
    top, worst = max(max(r["backward"]) for r in rows.values()), max(r["diff"] for r in rows.values())
    launch.print0(f"{L} layers b={b} s={s} h={h} a={a} fp32: each keeps A = e(16sbh + 2as^2b) + 2sbh + as^2b + "
                  f"4sbe = {A:,} B; a layer's input is I = e*sbh = {I:,} B\n{figure}\nactivation bytes alive "
                  "during backward (time ->), one scale for all:\n" + "\n".join(
                      f"  {n:<16}|{bars(r['backward'], top)}| peak {max(r['backward']) / 2**20:.2f} MiB"
                      for n, r in rows.items()))
    return launch.conclude("activation_checkpoint", worst == 0, "gradients bit-identical to none and torch",
                           holds, f"kept bytes and FLOPs = formulas; k={k} keeps "
                           f"{rows[f'every {L // k} layers']['saved'] / rows['none']['saved']:.0%} of none")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
