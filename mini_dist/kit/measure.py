"""Measuring memory instead of assuming it: tensors saved for backward, a step's peak bytes, FSDP's gathered units.

Activation memory is what autograd keeps from forward for backward. `SavedTensors` counts it exactly with
torch.autograd.graph.saved_tensors_hooks, which sees every tensor an autograd function saves, on any
device: each distinct storage counts once (views of one buffer share it), and parameters are left out
(they live on whether or not backward needs them). `PeakSaved` keeps the most of them held at once, as
microbatches come and go in a pipeline. `LiveActivations` follows those bytes over time: the
activation storages alive after every op of forward and backward (where recomputation brings some back).

The peak of a whole step is the allocator's: on CUDA, torch.cuda.max_memory_allocated; on the CPU, which
keeps no such counter, glibc's heap bytes in use (mallinfo2), sampled every 0.1 ms by a thread while the
step runs, so it is a lower bound that catches anything alive for longer than that. `UnitLedger` keeps what FSDP
did to each unit and the bytes gathered; what it sends is the wire's LEDGER's, read as a ring's by `ring_sent`.

Demo (an L-layer Linear + Tanh stack: saved bytes beside their formula, activations alive during backward):

    torchrun --standalone --nproc_per_node=1 mini_dist/kit/measure.py [--layers 8 --width 256 --batch 32]
"""
import ctypes
import sys
import threading
import time
import weakref
from pathlib import Path

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

if not __package__:  # run as `torchrun mini_dist/kit/measure.py`: Python put mini_dist/kit/ on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from mini_dist.kit import launch, trace, wire


class SavedTensors:
    """with SavedTensors(exclude=model.parameters()) as saved: loss = model(x)   ->  saved.bytes

    Bytes of the distinct storages autograd saved for backward inside the block (parameters excluded)."""

    def __init__(self, exclude=()):
        self.exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self.storages = {}  # data_ptr -> nbytes, each storage once

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self.exclude and t.device.type != "meta":
            self.storages[ptr] = t.untyped_storage().nbytes()
        return t

    def __enter__(self):
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())


class Saved:
    """What autograd keeps in place of a saved tensor: while it lives, the graph still holds the tensor."""
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


class PeakSaved:
    """saved = PeakSaved(lambda: parameter_addresses); with saved.hooks(): step()   ->  saved.peak

    The most bytes autograd holds for backward at once, parameters excluded: each distinct storage once,
    for as long as a graph holds a tensor of it (weak references to the Saved handles the pack hook gives
    autograd; a storage that lives on elsewhere, say a chunk's output kept for its backward, no longer
    counts once its graph is gone). Bytes only grow at a pack, so the peak is taken there.
    `parameters()` gives the parameter storages' addresses at that moment."""

    def __init__(self, parameters):
        self.parameters = parameters
        self.held = {}  # storage address -> (bytes, weak references to the Saved handles of its tensors)
        self.peak = 0

    def pack(self, t):
        saved = Saved(t)
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.parameters():
            self.forget_freed()
            n, refs = self.held.get(storage.data_ptr(), (storage.nbytes(), []))
            self.held[storage.data_ptr()] = (n, refs + [weakref.ref(saved)])
            self.peak = max(self.peak, sum(n for n, _ in self.held.values()))
        return saved

    def forget_freed(self) -> None:
        """Drop the handles autograd has let go of, and the storages no graph holds any more."""
        held = {}
        for ptr, (n, refs) in self.held.items():
            live = [r for r in refs if r() is not None]
            if live:
                held[ptr] = (n, live)
        self.held = held

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda saved: saved.tensor)


def side_by_side(rows, keys) -> str:
    """A table of one line per rank, rows[r] = (measured, predicted) dicts: measured = predicted for each key
    (!= where they differ), as the demos that count bytes print them beside their formulas."""
    lines = ["  rank " + "".join(f"{k:>24}" for k in keys)]
    for r, (got, want) in enumerate(rows):
        cells = [f"{float(got[k]):,.0f}{' = ' if got[k] == want[k] else ' != '}{float(want[k]):,.0f}" for k in keys]
        lines.append(f"  {r:>4} " + "".join(f"{c:>24}" for c in cells))
    return "\n".join(lines)


class LiveActivations(TorchDispatchMode):
    """with LiveActivations() as live: out = model(x); live.mark("backward"); out.backward(dy)
    ->  live.timeline[live.marks["backward"]:]: activation bytes alive after each op of backward.

    An activation is a storage that an op creates while grad mode is on: in forward, and in a checkpoint's
    recomputation inside backward (backward computes gradients with grad mode off, and views or in-place
    ops create no storage). Each counts from the op that creates it until it is freed, whoever holds it."""

    def __init__(self):
        super().__init__()
        self.alive = {}     # storage data_ptr -> (weak reference, nbytes)
        self.timeline = []  # bytes alive after each op
        self.marks = {}     # name -> index into timeline

    def mark(self, name: str) -> None:
        self.marks[name] = len(self.timeline)

    def __torch_dispatch__(self, op, types, args=(), kwargs=None):
        out = op(*args, **(kwargs or {}))
        if torch.is_grad_enabled():
            inputs = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs))}
            for t in _tensors(out):
                storage = t.untyped_storage()
                if storage.data_ptr() not in inputs and t.device.type != "meta":
                    self.alive[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())
        self.alive = {ptr: (ref, n) for ptr, (ref, n) in self.alive.items() if not ref.expired()}
        self.timeline.append(sum(n for _, n in self.alive.values()))
        return out


def _tensors(tree):
    """The tensors in nested tuples, lists and dicts (an op's arguments or outputs)."""
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (tuple, list)):
        for item in tree:
            yield from _tensors(item)
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from _tensors(item)


def profile_step(forward, backward, exclude=()) -> dict:
    """out = forward(); backward(out): the bytes forward saved for backward (`exclude`: parameters), the
    activation bytes alive after each op of backward, and the FLOPs of both (torch's FlopCounterMode)."""
    from torch.utils.flop_counter import FlopCounterMode
    with FlopCounterMode(display=False) as flops, LiveActivations() as live:
        with SavedTensors(exclude) as saved:
            out = forward()
        live.mark("backward")
        backward(out)
    return dict(saved=saved.bytes, backward=live.timeline[live.marks["backward"]:], flops=flops.get_total_flops())


def bars(timeline: list, top: int, width: int = 48) -> str:
    """A timeline of bytes as one line of `width` bars (each the highest value of its stretch) on 0..top."""
    stretches = [timeline[i * len(timeline) // width:(i + 1) * len(timeline) // width] for i in range(width)]
    return "".join(" ▁▂▃▄▅▆▇█"[round(8 * max(part or [0]) / max(top, 1))] for part in stretches)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]


def heap_bytes() -> int:
    """glibc's heap bytes in use right now (small blocks + mmapped large ones)."""
    mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return info.uordblks + info.hblkhd


def peak_bytes(step, device) -> int:
    """Memory one call of step() holds above its start: CUDA's allocator peak; on CPU glibc's, sampled."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    base = heap_bytes()
    peak = base
    done = threading.Event()

    def sample():
        """Every 0.1 ms until the step is done: the most heap bytes in use so far."""
        nonlocal peak
        while not done.is_set():
            peak = max(peak, heap_bytes())
            time.sleep(1e-4)
    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        step()
    finally:
        done.set()
        sampler.join()
    return max(0, peak - base)


class UnitLedger:
    """What FSDP (mini_dist/fsdp.py) did to its units on one rank since reset(), kept as trace records (kit/trace.py:
    what a trace file shows): events (phase, unit, what, bytes of full parameters alive after), and their peak."""

    def __init__(self):
        self.records = []
        self.gathered = 0  # bytes of full parameters alive now
        self.peak = 0

    def record(self, phase: str, unit: str, what: str, units) -> None:
        """`what` happened to `unit`; `units` (each with its gathered vector .full) say what is alive after."""
        gathered = sum(u.full.untyped_storage().nbytes() for u in units)
        trace.mark(what, into=self.records, phase=phase, unit=unit, gathered=gathered)
        self.gathered = gathered
        self.peak = max(self.peak, gathered)

    def reset(self) -> None:
        self.records = []
        self.peak = self.gathered

    @property
    def events(self) -> list:
        return [(r.args["phase"], r.args["unit"], r.name, r.args["gathered"]) for r in self.records]

    def count(self, what: str, unit: str | None = None) -> int:
        return sum(e[2] == what and unit in (None, e[1]) for e in self.events)


def ring_sent(kind: str, world: int) -> int:
    """Bytes a ring sends on this rank for the all-gathers and reduce-scatters the wire's LEDGER counted under `kind`
    since its reset: (K-1)/K of their payload, each a vector padded to K equal pieces (FSDP's units)."""
    return wire.LEDGER.bytes[kind] * (world - 1) // world


def step_sent(step, ledger, kind: str, world: int) -> int:
    """step() with `ledger` and the wire's LEDGER reset first (ledger then holds that step): its ring_sent."""
    ledger.reset()
    wire.LEDGER.reset()
    step()
    return ring_sent(kind, world)


# ----- demo: what an MLP keeps for backward, measured, beside what it should keep -----

def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("--layers", type=int, default=8, help="Linear + Tanh layers (L)")
    p.add_argument("--width", type=int, default=256, help="features per layer (w)")
    p.add_argument("--batch", type=int, default=32, help="rows per batch (b)")
    return p


def demo(args) -> int:
    L = args.layers
    w = args.width
    b = args.batch
    launch.require(min(L, w, b) >= 1, "--layers, --width and --batch must be at least 1")
    env = launch.setup()
    layers = [m for _ in range(L) for m in (torch.nn.Linear(w, w, device=env.device), torch.nn.Tanh())]
    model = torch.nn.Sequential(*layers)
    x = torch.randn(b, w, device=env.device)  # data: needs no gradient, but the first Linear keeps it
    step = profile_step(lambda: model(x), lambda out: out.sum().backward(), exclude=model.parameters())
    alive = step["backward"]
    # each Linear keeps its input (for dW = dy^T x), each Tanh its output (dtanh = 1 - t^2); the Tanh output
    # is the next Linear's input, one storage: x + L outputs = (L + 1) * b * w * 4 bytes
    formula = (L + 1) * b * w * 4
    heap = peak_bytes(lambda: model(x).sum().backward(), env.device)
    allocator = "CUDA allocator" if env.device.type == "cuda" else "glibc, sampled"
    flops = (6 * L - 2) * b * w * w  # forward 2bw^2 a layer, backward 4bw^2 but the first layer's dx
    launch.print0(f"{L} x (Linear({w}, {w}) + Tanh), batch {b}, fp32, bytes on this rank: saved for backward "
                  f"{step['saved']:,} B, formula (L+1)*b*w*4 = {formula:,} B\n"
                  f"activation bytes alive during backward (max {max(alive):,} B): {bars(alive, max(alive))}\n"
                  f"heap peak of a step above its start ({allocator}): {heap:,} B\n"
                  f"matmul FLOPs {step['flops']:,} = (6L-2)bw^2 = {flops:,} (forward 2bw^2 a layer, backward 4bw^2 "
                  "but for the first layer's dx: x needs no gradient)")
    return launch.conclude("measure", step["saved"] == formula, f"saved bytes = (L+1)bw*4 = {formula:,}",
                           step["flops"] == flops, "FLOPs = (6L-2)bw^2")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
