"""Every tensor, module and generator lives on the rank's device, or says why it is on the CPU.

The CPU suite cannot see a tensor made on the CPU where the rank's GPU was meant: under gloo the rank's
device IS the CPU. The first run on a GPU found five such bugs (a CPU generator drawing CUDA numbers, a dense
reference model left on the CPU, a CPU tensor handed to an NCCL broadcast, ...). This static check reads the
source of mini_dist/ and tests/ and refuses:

- a tensor factory (torch.zeros, randn, tensor, arange, ...) or an nn layer with parameters (nn.Linear,
  nn.Embedding, ...) that names no `device=` and is not moved at once (`torch.randn(...).to(device)`, or a
  layer inside an expression that ends in `.to(...)`);
- a factory that names a device and draws from a generator that names none (`torch.Generator()` is a CPU
  generator: drawing CUDA numbers from it fails);

unless the line says it means the CPU: a comment `# cpu: <why>` (bytes bound for a file, a table of
expected values, a shape). Numbers drawn on the CPU and then moved (`.to(device)`) are welcome: they are
the same on every device.

The source cannot show a tensor that reaches an operation from another device at run time: a CPU copy made on
purpose (a checkpoint's bytes through `.cpu()`, Adam's step counter, which torch keeps on the host) meeting the
rank's tensors. The GPU run found one (reshard's demo compared a loaded step counter, put on the GPU, with Adam's,
on the host). So `RankDevice` runs code with the rank's device told apart from the CPU, and an operation that
meets both raises what CUDA raises; the checkpoint and reshard paths (and reshard's demo) run under it here.
"""
import ast
import dataclasses
import functools
import importlib
import inspect
import os
import shutil
import tempfile
import weakref
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import test_checkpoint
import harness
from harness import run
from mini_dist import reshard
from mini_dist.kit import launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FACTORIES = {"zeros", "ones", "empty", "full", "rand", "randn", "randint", "randperm", "arange", "linspace",
             "tensor", "eye", "as_tensor"}
LAYERS = {name for name, cls in vars(nn).items()
          if inspect.isclass(cls) and issubclass(cls, nn.Module) and "device" in inspect.signature(cls).parameters}


def sources():
    for folder in ("mini_dist", "tests"):
        for path, _, files in os.walk(os.path.join(ROOT, folder)):
            for f in files:
                if f.endswith(".py") and f != "test_devices.py":
                    yield os.path.join(path, f)


def named(call: ast.Call) -> str | None:
    """'factory' for torch.<factory>(...), 'layer' for nn.<Layer>(...), 'generator' for torch.Generator()."""
    f = call.func
    if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
        if f.value.id == "torch" and f.attr in FACTORIES:
            return "factory"
        if f.value.id == "torch" and f.attr == "Generator":
            return "generator"
        if f.value.id == "nn" and f.attr in LAYERS:
            return "layer"
    return None


def keyword(call: ast.Call, name: str, dicts: frozenset = frozenset()):
    """The value passed as name=, or the **kw that carries it (kw bound to dict(..., name=...) in the file)."""
    for k in call.keywords:
        if k.arg == name:
            return k.value
        if k.arg is None and isinstance(k.value, ast.Name) and k.value.id in dicts:
            return k.value
    return None


def dicts_naming(tree, name: str) -> frozenset:
    """Names bound to dict(..., name=...) anywhere in the file: `kw = dict(dtype=d, device=device)`."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            call = node.value
            if isinstance(call.func, ast.Name) and call.func.id == "dict" and keyword(call, name) is not None:
                found.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return frozenset(found)


def moved(node, parents) -> bool:
    """node sits inside the receiver of a `.to(...)` / `.cuda()` call (torch.randn(3).to(d), nn.Sequential(
    nn.Linear(..)).to(d)), or is copied into a tensor that has its device (x.copy_(torch.randn(..)))."""
    child = node
    while child in parents:
        parent = parents[child]
        if isinstance(parent, ast.Attribute) and parent.attr in ("to", "cuda") and parent.value is child:
            return True
        if (isinstance(parent, ast.Call) and isinstance(parent.func, ast.Attribute) and parent.func.attr == "copy_"
                and child in parent.args):  # x.copy_(t) lands on x's device
            return True
        if isinstance(parent, (ast.stmt, ast.Lambda, ast.FunctionDef)):
            return False
        child = parent
    return False


def problems(path: str) -> list[str]:
    text = open(path).read()
    lines = text.splitlines()
    tree = ast.parse(text)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    device_dicts = dicts_naming(tree, "device")
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        kind = named(node)
        span = lines[node.lineno - 1:node.end_lineno]
        if any("# cpu:" in line for line in span):
            continue
        where = f"{os.path.relpath(path, ROOT)}:{node.lineno}: {lines[node.lineno - 1].strip()[:90]}"
        if kind in ("factory", "layer") and keyword(node, "device", device_dicts) is None and not moved(node, parents):
            found.append(f"{where}  <- names no device= and is not moved with .to(device)")
        gen = keyword(node, "generator")
        if kind == "factory" and keyword(node, "device") is not None and gen is not None and not any(
                isinstance(n, ast.keyword) and n.arg == "device" for n in ast.walk(gen)):
            found.append(f"{where}  <- draws on a device from a generator that names none (a CPU generator)")
    return found


@pytest.mark.single_process
def test_every_tensor_module_and_generator_is_made_on_the_ranks_device_or_marked_cpu():
    found = [p for path in sources() for p in problems(path)]
    assert not found, f"{len(found)} made on the CPU without a word:\n" + "\n".join(found)


@pytest.mark.single_process
@pytest.mark.parametrize("planted", [
    "x = torch.randint(-8, 8, (4,), generator=torch.Generator().manual_seed(0), device=dev)",  # comm's bug
    "dense = nn.Linear(4, 4)",                                                                  # parallel_gpt's
    "flag = torch.tensor([1.0])\ndist.broadcast(flag, 0)",                                     # the bench's
    "w = torch.empty(3, 4)",
    "kw = dict(dtype=torch.float64)\nln = nn.LayerNorm(4, **kw)",                              # a **kw without it
])
def test_each_bug_seen_on_the_gpu_is_caught_when_planted(planted, tmp_path):
    path = tmp_path / "planted.py"
    path.write_text(planted + "\n")
    assert problems(str(path)), planted


@pytest.mark.single_process
@pytest.mark.parametrize("fine", [
    "x = torch.randn(4, generator=torch.Generator().manual_seed(0)).to(dev)",
    "m = nn.Sequential(nn.Linear(4, 4), nn.Tanh()).to(dev)",
    "w = torch.empty(3, 4, device=dev)",
    "table = torch.tensor([1.0, 2.0])  # cpu: expected values, compared after .cpu()",
    "x = torch.randn(4, generator=torch.Generator(device=dev), device=dev)",
    "kw = dict(dtype=torch.float64, device=dev)\nln = nn.LayerNorm(4, **kw)",
])
def test_what_is_on_the_device_or_says_why_not_passes(fine, tmp_path):
    path = tmp_path / "fine.py"
    path.write_text(fine + "\n")
    assert not problems(str(path)), fine


# ----------------------------------------------------------------------------- the rank's device, told apart

RANK_DEVICE = torch.device("cpu", 0)  # the rank's device: CPU memory, told apart from "cpu" by its index
FACTORIES_CALLED = {getattr(torch, name) for name in FACTORIES | {"scalar_tensor", "empty_strided", "logspace"}}
TRANSFERS = {torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default}  # legal across devices
WHERE = {"rank": "the rank's device", "host": "the host", None: "neither (made where no mode saw it)"}
INDEXING = {torch.ops.aten.index.Tensor, torch.ops.aten.index_put_.default, torch.ops.aten.index_put.default,
            torch.ops.aten._index_put_impl_.default}  # a CUDA tensor takes CPU indices (they are moved)


class RankDevice(TorchFunctionMode):
    """Run code as if the rank's device were a GPU: every tensor is placed on the rank's device or on the host,
    as a GPU run would place it, and an operation that meets both raises what CUDA raises.

    Under gloo the rank's device is the CPU, so a CPU copy made on purpose (a state dict for a file, a step
    counter Adam keeps on the host, `.cpu()` before a comparison) and the tensor it came from are the same
    thing to torch, and a mix of the two passes every CPU test. Here launch.device() is torch.device("cpu", 0):
    a factory given that device (and a tensor `.to()` it) is placed on the rank's device, and `x.device` of such
    a tensor answers it, so `torch.zeros(n, device=p.device)` lands where p is, as on a GPU; a factory naming no
    device, and `.cpu()` (a copy, as on a GPU), are on the host. Every operation (backward's too: this is a
    dispatch mode) places its results where its inputs are. Both sides live in CPU memory: the numbers are the
    CPU run's. Tensors made where neither mode sees them (unpickled, read from bytes) count as neither."""

    def __init__(self):
        super().__init__()
        self.where = {}  # id(storage) -> (a weak reference to the storage, "rank" or "host")
        self.dispatch = _PlaceEveryOperation(self)

    def __enter__(self):
        self.dispatch.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        return self.dispatch.__exit__(*exc)

    def place(self, t: torch.Tensor) -> str | None:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):  # no storage of its own: a wrapper subclass
            return None
        entry = self.where.get(id(storage))
        return entry[1] if entry is not None and entry[0]() is storage else None

    def put(self, out, place: str, over: bool = True) -> None:
        """Place every tensor in `out` (a tensor, or a structure of them); over=False places only new ones."""
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and (over or self.place(t) is None):
                try:
                    storage = t.untyped_storage()
                except (RuntimeError, NotImplementedError, TypeError):
                    continue
                self.where[id(storage)] = (weakref.ref(storage, functools.partial(self.forget, id(storage))), place)

    def forget(self, key: int, ref) -> None:
        if key in self.where and self.where[key][0] is ref:
            del self.where[key]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func == torch.Tensor.device.__get__:
            return RANK_DEVICE if self.place(args[0]) == "rank" else func(*args)
        if func == torch.Tensor.is_cpu.__get__:
            return self.place(args[0]) != "rank" and func(*args)
        if func in (torch.Tensor.to, torch.Tensor.cpu):
            return self.move(func, args, kwargs)
        if func == torch.Tensor.numpy and self.place(args[0]) == "rank":
            raise TypeError("can't convert a tensor on the rank's device to numpy: use Tensor.cpu() first (as for "
                            "a cuda tensor)")
        out = func(*args, **kwargs)
        if kwargs.get("device") is not None:  # a factory, *_like or new_* that names its device
            self.put(out, "rank" if torch.device(kwargs["device"]) == RANK_DEVICE else "host")
        elif func in FACTORIES_CALLED:
            self.put(out, "host", over=False)
        return out

    def move(self, func, args, kwargs):
        """Tensor.to / Tensor.cpu: a copy when the place changes (as between a GPU and the host), else as asked."""
        t = args[0]
        kwargs = dict(kwargs)
        copy = kwargs.pop("copy", False)
        to = args[1:] if func == torch.Tensor.to else ("cpu",)
        device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*to, **kwargs)
        other = next((a for a in to if isinstance(a, torch.Tensor)), kwargs.get("other"))
        if other is not None:
            target = self.place(other) or "host"
        elif device is None:
            target = None  # a dtype only: the tensor stays where it is
        else:
            target = "rank" if device == RANK_DEVICE else "host"
        moving = target is not None and target != (self.place(t) or "host")
        out = torch.Tensor.to(t, "cpu", dtype or t.dtype, non_blocking, copy or moving,
                              memory_format=memory_format or torch.preserve_format)
        if moving:
            self.put(out, target)
        return out


class _PlaceEveryOperation(TorchDispatchMode):
    """RankDevice's half that sees every aten operation, backward's included."""

    def __init__(self, places: RankDevice):
        super().__init__()
        self.places = places

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        places = [self.places.place(t) for t in tensors]
        if "rank" in places and "host" in places and func not in TRANSFERS:
            indices = {id(t) for t in pytree.tree_leaves(args[1])} if func in INDEXING else set()
            host = [t for t, p in zip(tensors, places) if p == "host" and id(t) not in indices]
            if host and not cpu_scalars_taken(func, args, host):
                seen = ", ".join(f"{tuple(t.shape)} on {WHERE[p]}" for t, p in zip(tensors, places))
                raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                                   f"{RANK_DEVICE} (the rank's device) and cpu! (when checking the arguments of "
                                   f"{func}: {seen})")
        with torch._C.DisableTorchFunction():  # C++ calling aten (torch's DDP reducer) is not a Python call
            out = func(*args, **kwargs)
        if func == torch.ops.aten.copy_.default:
            return out  # the copy stays where its destination is
        if "rank" in places or kwargs.get("device") == RANK_DEVICE:
            self.places.put(out, "rank")
        elif "host" in places:
            self.places.put(out, "host", over=False)
        return out


def cpu_scalars_taken(func, args, host) -> bool:
    """CUDA's elementwise kernels take a 0-dim CPU tensor beside CUDA ones, as a number, but never write to it;
    nothing else takes a CPU tensor (torch.equal does not)."""
    first = func._schema.arguments[0] if func._schema.arguments else None
    written = args[0] if first is not None and first.alias_info is not None and first.alias_info.is_write else None
    return (torch.Tag.pointwise in func.tags and torch.Tag.data_dependent_output not in func.tags
            and all(t.dim() == 0 and t is not written for t in host))


# Ranks that run with the rank's device told apart need gloo: on NCCL the rank's device is a GPU, apart for real.
ON_GLOO = pytest.mark.skipif(harness.BACKEND != "gloo", reason="emulates on gloo what a GPU shows: on NCCL the "
                             "rank's device is a GPU, told apart from the CPU for real")


def rank_device() -> torch.device:
    return RANK_DEVICE


def no_tag_of_its_own(storage):
    """torch.save already tags a storage of the rank's device "cpu:0", as it tags a GPU's "cuda:0"."""
    return None


def loaded_onto_the_rank_device(storage, location):
    """torch.load of a "cpu:0" storage (or with map_location the rank's device): CPU memory, as a GPU's loads
    onto the GPU; torch itself restores only "cpu" and the accelerators it knows."""
    return storage if location == str(RANK_DEVICE) else None


def on_rank_device(fn, *args):
    """fn(*args) on this rank of a pool, the rank's device told apart from the CPU: launch.device() and a demo's
    env.device are RANK_DEVICE (torch.save and torch.load know it, as they know cuda:0), and a demo's conclude
    leaves the pool's group standing (a barrier)."""
    if not getattr(torch.serialization, "_mini_dist_rank_device", False):
        torch.serialization.register_package(5, no_tag_of_its_own, loaded_onto_the_rank_device)
        torch.serialization._mini_dist_rank_device = True
    setup = launch.setup

    def setup_on_rank_device(*a, **k):
        return dataclasses.replace(setup(*a, **k), device=RANK_DEVICE)

    with RankDevice(), mock.patch.object(launch, "device", rank_device), \
            mock.patch.object(launch, "setup", setup_on_rank_device), \
            mock.patch.object(launch, "shutdown", dist.barrier):
        return fn(*args)


def demo(module: str, argv: list) -> int:
    """A demo's exit status: 0 passed, 1 a check failed, 2 a configuration it refuses (UsageError)."""
    m = importlib.import_module(f"mini_dist.{module}")
    try:
        return m.demo(m.parser().parse_args(argv))
    except launch.UsageError:
        return 2


@ON_GLOO
@pytest.mark.parametrize("world", [1, 2])
def test_reshards_demo_passes_with_the_ranks_device_told_apart_from_the_cpu(world):
    """The GPU run's failure, seen on the CPU: the FSDP -> FSDP step compared Adam's step counter, kept on the host
    by torch's Adam, with the one a load had put on the rank's device (torch.equal takes no CPU tensor)."""
    assert run(world, on_rank_device, demo, "reshard", []) == [0] * world


ON_THE_RANK = ("a factory given the rank's device", "its result", "a factory given its .device", "a layer moved there",
               "the layer's gradient", "Adam's exp_avg")
ON_THE_HOST = ("its .cpu()", "a factory naming no device", "Adam's step")


TOUR = sorted({entry.split()[0].strip('"') for entry in open(os.path.join(ROOT, "run.sh")).read().split(
    "TOUR=(")[1].split(")")[0].split("\n") if entry.strip()})
NOT_ON_THE_RANKS_DEVICE = {  # demos this in-process run cannot hold, and why
    "recovery": "it kills its own ranks and needs torchrun to restart them",
    "planner": "it starts no ranks: a plan is arithmetic",
    "fsdp": "its reference, torch's fully_shard, places its buffers by the mesh's device type, 'cpu': the host here",
}


@ON_GLOO
@pytest.mark.slow
@pytest.mark.parametrize("module", [m for m in TOUR if m not in NOT_ON_THE_RANKS_DEVICE])
def test_every_demo_runs_on_one_rank_with_the_ranks_device_told_apart_from_the_cpu(module):
    """The tour on one rank, the world size one GPU gives, with every host tensor that meets the rank's caught:
    each demo passes (0) or refuses one rank (2). Slow (about a minute): CI runs it with -m slow."""
    assert run(1, on_rank_device, demo, module.replace("/", "."), [], timeout=600) in ([0], [2])


@pytest.mark.single_process
def test_the_ranks_device_places_tensors_where_a_gpu_run_would():
    with RankDevice():
        made = torch.zeros(3, device=RANK_DEVICE)
        layer = nn.Linear(3, 2).to(RANK_DEVICE)
        layer(torch.randn(4, 3).to(RANK_DEVICE)).sum().backward()
        adam = torch.optim.Adam(layer.parameters())
        adam.step()
        state = adam.state[layer.weight]
        found = [made, made * 2, torch.ones(1, device=made.device), layer.weight, layer.weight.grad, state["exp_avg"],
                 made.cpu(), torch.ones(1), state["step"]]
        placed = {what: t.device for what, t in zip(ON_THE_RANK + ON_THE_HOST, found)}
    assert placed == {**dict.fromkeys(ON_THE_RANK, RANK_DEVICE), **dict.fromkeys(ON_THE_HOST, torch.device("cpu"))}


def tensors() -> dict:
    return {"torch": torch, "rank": torch.ones(3, device=RANK_DEVICE), "host": torch.ones(3),
            "scalar": torch.tensor(2.0)}  # cpu: a 0-dim host tensor, as Adam's step


@pytest.mark.single_process
@pytest.mark.parametrize("mix", ["torch.equal(rank, host)", "torch.equal(rank.sum(), scalar)", "rank @ host",
                                 "torch.cat([rank, host])", "rank + host", "scalar.add_(rank.sum())", "rank.numpy()"])
def test_an_operation_meeting_the_ranks_device_and_the_host_raises_as_on_a_gpu(mix):
    with RankDevice():
        with pytest.raises((RuntimeError, TypeError), match="same device|numpy"):
            eval(mix, tensors())


@pytest.mark.single_process
@pytest.mark.parametrize("fine", ["rank * scalar", "rank[torch.tensor([0, 2])]", "host.copy_(rank)", "rank.copy_(host)",
                                  "rank.cpu() + host", "host.to(rank.device) + rank", "torch.equal(rank.cpu(), host)",
                                  "torch.zeros(3, device=rank.device) + rank", "rank.tolist() == host.tolist()"])
def test_what_a_gpu_takes_passes_on_the_ranks_device(fine):
    with RankDevice():
        eval(fine, tensors())


# ----- checkpoints and resharding with the rank's device told apart: where CPU copies are made on purpose

FLAT_SHARD = reshard.flat_shard


def cpu_copy_of_each_shard(data, shape, start):
    """reshard.flat_shard with a CPU copy planted: a box of `data.cpu()`, a copy on a GPU, data itself on a CPU."""
    return FLAT_SHARD(data.cpu(), shape, start)


def planted_cpu_copy(fn, *args):
    with mock.patch.object(reshard, "flat_shard", cpu_copy_of_each_shard):
        return fn(*args)


def run_as(world: int, wrappers: tuple, fn, *args) -> list:
    """run(world, fn, *args), fn inside each wrapper (on_rank_device, planted_cpu_copy), the first outermost."""
    return run(world, *wrappers, fn, *args)


def saved_then_loaded(kind: str, world: int, world_after: int, wrappers: tuple) -> tuple:
    """test_checkpoint's training saved at K = world (ZeRO-1 or FSDP) and loaded at K' (ZeRO-2 or FSDP): the
    state saved, and each rank's state right after the load (it then trains on, beside an uninterrupted run)."""
    path = tempfile.mkdtemp(prefix="test_devices_")
    try:
        saved = run_as(world, wrappers, test_checkpoint.train_and_save, kind, path)[0]
        return saved, [r[0] for r in run_as(world_after, wrappers, test_checkpoint.resume_beside_uninterrupted,
                                             kind, path)]
    finally:
        shutil.rmtree(path)


def differing(saved: dict, loaded: dict) -> list:
    return [n for n, v in saved.items() if not (torch.equal(loaded[n], v) if torch.is_tensor(v) else loaded[n] == v)]


@ON_GLOO
@pytest.mark.parametrize("kind, world, world_after", [("zero", 2, 3), ("fsdp", 3, 2)])
def test_zero_and_fsdp_resumed_at_k_prime_on_the_ranks_device_told_apart_load_what_was_saved(kind, world, world_after):
    """Saving reads each shard's bytes through a CPU copy (checkpoint.save), loading reads a file into a CPU buffer and
    copies it in, ZeRO keeps Adam's step on the host: with the rank's device told apart none of these meets the
    rank's tensors in an operation, and the state loaded is the state saved."""
    saved, loaded = saved_then_loaded(kind, world, world_after, (on_rank_device,))
    assert all(not differing(saved, state) for state in loaded)


@ON_GLOO
@pytest.mark.parametrize("world, world_after", [(2, 1), (1, 3)])
def test_tensor_parallel_state_resharded_on_the_ranks_device_told_apart_is_what_was_saved(world, world_after):
    path = tempfile.mkdtemp(prefix="test_devices_")
    try:
        saved = run(world, on_rank_device, test_checkpoint.tensor_parallel_state, path, 0, True)[0]
        loaded = run(world_after, on_rank_device, test_checkpoint.tensor_parallel_state, path, 1, False)
    finally:
        shutil.rmtree(path)
    assert all(not differing(saved, state) for state in loaded)


@ON_GLOO
def test_a_cpu_copy_planted_in_reshards_fsdp_path_passes_on_the_cpu_and_is_caught_on_the_ranks_device():
    """The negative control: FSDP boxes made of `shard.cpu()` load into copies on a GPU, leaving the model as it was;
    on the CPU `.cpu()` is the shard itself, so the plain CPU run cannot see it, and the rank's device must."""
    saved, loaded = saved_then_loaded("fsdp", 2, 2, (planted_cpu_copy,))
    assert all(not differing(saved, state) for state in loaded)
    saved, loaded = saved_then_loaded("fsdp", 2, 2, (on_rank_device, planted_cpu_copy))
    assert all("model.0.weight" in differing(saved, state) for state in loaded)
