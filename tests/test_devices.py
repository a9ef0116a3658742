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
"""
import ast
import inspect
import os

import pytest
import torch
from torch import nn

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


def keyword(call: ast.Call, name: str):
    return next((k.value for k in call.keywords if k.arg == name), None)


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
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        kind = named(node)
        span = lines[node.lineno - 1:node.end_lineno]
        if any("# cpu:" in line for line in span):
            continue
        where = f"{os.path.relpath(path, ROOT)}:{node.lineno}: {lines[node.lineno - 1].strip()[:90]}"
        if kind in ("factory", "layer") and keyword(node, "device") is None and not moved(node, parents):
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
])
def test_what_is_on_the_device_or_says_why_not_passes(fine, tmp_path):
    path = tmp_path / "fine.py"
    path.write_text(fine + "\n")
    assert not problems(str(path)), fine
