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
from torch import nn
from torch.utils import checkpoint as tc

if not __package__:  # run as `torchrun mini_dist/x.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist.kit import launch
from mini_dist.kit.activations import (Strategy, each_layer, layer_bytes, no_checkpoint, profile_strategies,
                                       require_stack, stack_flags, strategy_table, transformer_stack)
from mini_dist.kit.measure import bars


# ----- the textbook: forward without grad, keeping the input; backward recomputes, then backpropagates -----

class ReentrantCheckpoint(torch.autograd.Function):
    """.apply(fn, *inputs) = torch.utils.checkpoint.checkpoint(fn, *inputs, use_reentrant=True), tensors only."""

    @staticmethod
    def forward(ctx, fn, *inputs):
        # exercise: returns fn(*inputs), autograd keeping for backward only the inputs (ctx.save_for_backward)
        ctx.fn = fn
        ctx.rng = rng_state(inputs)
        ctx.save_for_backward(*inputs)
        return fn(*inputs)  # a Function's forward runs without grad: nothing inside is saved
        # end exercise

    @staticmethod
    def backward(ctx, grad):
        # exercise: returns (None for fn, then each input's gradient), the weights inside fn left with their .grad
        #   accumulated, all bit for bit as without checkpointing (dropout's masks: replayed_rng), fn run once more
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


def no_context(kept):
    """What full checkpointing enters around a segment: nothing, it keeps no tensor but the inputs."""
    return contextlib.nullcontext()


class Checkpoint:
    """One checkpointed call of fn. Forward: fn runs with a number saved in place of every tensor it
    saves; what stays are the tensors among its arguments (and what `context` keeps), in SaveForRecompute.
    Backward: the first number unpacked reruns fn, and every number gets its recomputed tensor.
    context(kept), if given, is entered around fn: in forward kept is a list it may fill with tensors to
    keep, in the recomputation an iterator over them (selective checkpointing, selective_checkpoint.py)."""

    def __init__(self, fn, context=None):
        self.fn = fn
        self.context = context or no_context
        self.count = 0         # tensors fn saved in forward, each replaced by its number
        self.recomputed = []   # by number: the recomputation's tensors, None once backward has used one

    def forward(self, args, kwargs):
        values = [*args, *kwargs.values()]
        self.n_args = len(args)
        self.names = list(kwargs)
        self.is_tensor = [isinstance(v, torch.Tensor) for v in values]
        self.others = [None if t else v for v, t in zip(values, self.is_tensor)]  # tensors go to autograd
        inputs = [v for v, t in zip(values, self.is_tensor) if t]
        kept = []
        self.rng = rng_state(inputs)
        self.n_inputs = len(inputs)
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
        tensor = self.recomputed[number]
        self.recomputed[number] = None  # freed once its node is done
        return tensor

    def recompute(self) -> None:
        """Rerun fn on the kept inputs with forward's RNG state, keeping every tensor it saves, in order."""
        saved = self.saved.grad_fn.saved_tensors
        inputs = iter([x.detach().requires_grad_(x.requires_grad) for x in saved[:self.n_inputs]])
        values = [next(inputs) if t else v for v, t in zip(self.others, self.is_tensor)]
        args = values[:self.n_args]
        kwargs = dict(zip(self.names, values[self.n_args:]))
        self.recomputed = []
        capture = torch.autograd.graph.saved_tensors_hooks(lambda t: self.recomputed.append(t.detach()),
                                                           lambda nothing: nothing)  # this graph is never used
        with replayed_rng(self.rng), torch.enable_grad(), capture, self.context(iter(saved[self.n_inputs:])):
            self.fn(*args, **kwargs)
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


# ----------------------------------------------------------------------------- demo

def parser():
    p = launch.demo_parser(__doc__)
    stack_flags(p, layers=16)
    p.add_argument("--segments", type=int, default=0, help="k for checkpoint_sequential (0: round(sqrt(L)))")
    return p


def strategies(L: int, k: int, A: int, I: int) -> list[Strategy]:
    """None, every layer, and checkpoint_sequential's k segments of n = L // k layers, each beside torch's and
    its formulas: bytes kept after forward, FLOPs over none (a recomputed layer adds 1/3: its F to F + 2F)."""
    n = L // k
    torchs = functools.partial(tc.checkpoint, use_reentrant=False)
    return [Strategy("none", no_checkpoint, no_checkpoint, L * A, 1),
            Strategy("every layer", each_layer(checkpoint), each_layer(torchs), L * I, 4 / 3),
            Strategy(f"every {n} layers", lambda m, x: checkpoint_sequential(m, k, x),
                     lambda m, x: tc.checkpoint_sequential(m, k, x, use_reentrant=False),
                     (k - 1) * I + (L - (k - 1) * n) * A, 1 + (k - 1) * n / (3 * L))]


def measure(layers, segments, batch, seq, hidden, heads, dropout=0.1, seed=0) -> dict:
    """Each strategy's step on a stack of TransformerLayers: kit.activations.profile_strategies' rows."""
    model, x, dy = transformer_stack(layers, batch, seq, hidden, heads, dropout, seed)
    A, I = layer_bytes(batch, seq, hidden, heads)
    return profile_strategies(model, x, dy, strategies(layers, segments, A, I), seed)


def memory_and_compute(rows=None) -> tuple[str, bool]:
    """Question 18, and the demo's table: per strategy, bytes kept and at backward's peak, forward runs and
    FLOPs, beside the formulas; holds when each equals its formula and every gradient is bit-identical to
    none's and torch's. rows: measure(...); by default 4 layers in 2 segments."""
    return strategy_table(rows or measure(layers=4, segments=2, batch=1, seq=16, hidden=16, heads=2))


def demo(args) -> int:
    L = args.layers
    k = args.segments or max(1, round(math.sqrt(L)))
    require_stack(args)
    launch.require(1 <= k <= L, f"--segments must lie between 1 and --layers ({L}), got {k}")
    env = launch.setup(seed=args.seed)
    rows = measure(L, k, args.batch, args.seq, args.hidden, args.heads, args.dropout, args.seed + env.rank)
    A, I = layer_bytes(args.batch, args.seq, args.hidden, args.heads)
    figure, holds = memory_and_compute(rows)
    top = max(max(r["backward"]) for r in rows.values())
    timelines = "\n".join(f"  {n:<16}|{bars(r['backward'], top)}| peak {max(r['backward']) / 2**20:.2f} MiB"
                          for n, r in rows.items())
    shape = f"b={args.batch} s={args.seq} h={args.hidden} a={args.heads}"
    launch.print0(f"{L} layers {shape} fp32: each keeps A = e(16sbh + 2as^2b) + 2sbh + as^2b + 4sbe = {A:,} B; "
                  f"a layer's input is I = e*sbh = {I:,} B\n{figure}\nactivation bytes alive during backward "
                  f"(time ->), one scale for all:\n{timelines}")
    exact = max(r["diff"] for r in rows.values()) == 0
    kept = rows[f"every {L // k} layers"]["saved"] / rows["none"]["saved"]
    return launch.conclude("activation_checkpoint", exact, "gradients bit-identical to none and torch",
                           holds, f"kept bytes and FLOPs = formulas; k={k} keeps {kept:.0%} of none")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
