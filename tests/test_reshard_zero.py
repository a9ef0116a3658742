"""ZeRO's state as boxes (mini_dist/reshard_zero.py): a ZeroOptimizer of any stage saved at K ranks loads into
one of any stage at K' ranks, and into the plain module with torch's own optimizer, bit for bit.

Each property trains a ZeroOptimizer two steps (parameters of any shapes, a frozen one, one or two param groups,
Adam, AdamW or SGD with momentum, fp32 or bf16 with fp32 master weights), saves it, and loads it into a model
whose parameters, the frozen one too, were zeroed first, so all it holds must come from the checkpoint. The
comparison is torch.optim's state dict of the whole (sharded_state.consolidated_state_dict) and the parameters,
with torch.equal: a checkpoint moves bytes, so anything short of identical bits is a bug. (Training on after a
change of world size is in tests/test_checkpoint.py.)
"""
import shutil
import tempfile

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import run
from mini_dist import checkpoint, reshard_zero  # looked up at call time, as an exercise would swap them
from mini_dist.reshard import load_module_state, module_layout
from mini_dist.sharded_state import consolidated_state_dict
from mini_dist.zero_optimizer import ZeroOptimizer
from test_zero import Toy, shapes, train

OPTIMIZERS = {"Adam": (torch.optim.Adam, {"lr": 0.01}), "AdamW": (torch.optim.AdamW, {"lr": 0.01}),
              "SGD": (torch.optim.SGD, {"lr": 0.01, "momentum": 0.9})}


def named_groups(model, grouped: bool, lr: float) -> list:
    """Named parameters (the checkpoint's names are the module's), in one group or two: the frozen one and
    the first without weight decay, the rest (if any) at half the learning rate."""
    named = list(model.named_parameters())
    if not grouped:
        return [{"params": named}]
    groups = [{"params": named[-1:] + named[:1], "weight_decay": 0.0}]
    if named[1:-1]:  # torch refuses an empty group of named parameters
        groups.append({"params": named[1:-1], "lr": lr / 2})
    return groups


def zero_of(shapes, stage: int, opt: str, half: bool, grouped: bool, zeroed: bool) -> tuple:
    """A Toy model (its parameters zeroed: nothing of the saved run) and a ZeroOptimizer over it."""
    model = Toy(shapes, torch.bfloat16 if half else torch.float32)
    if zeroed:
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
    cls, hyper = OPTIMIZERS[opt]
    return model, ZeroOptimizer(named_groups(model, grouped, hyper["lr"]), cls, stage=stage, **hyper)


def whole(model, zero) -> tuple:
    """The parameters, and torch.optim's state dict of the whole optimizer (on every rank), on the CPU."""
    params = [p.detach().cpu() for p in model.parameters()]  # cpu: compared in the test process, frozen one too
    state = consolidated_state_dict(zero)
    tensors = {i: {k: v.cpu() for k, v in s.items()} for i, s in state["state"].items()}  # cpu: as above
    return params, tensors, [{k: v for k, v in g.items() if k != "params"} for g in state["param_groups"]]


def save_worker(path, shapes, stage, opt, half, grouped):
    model, zero = zero_of(shapes, stage, opt, half, grouped, zeroed=False)
    train(model, zero, range(2))
    checkpoint.save(reshard_zero.zero_state(zero), path)
    return whole(model, zero)


def load_worker(path, shapes, stage, opt, half, grouped):
    model, zero = zero_of(shapes, stage, opt, half, grouped, zeroed=True)
    reshard_zero.load_zero_state(path, zero)
    return whole(model, zero)


def same(saved: tuple, loaded: tuple) -> str | None:
    """None if the two are equal bit for bit, else what differs first."""
    params, state, groups = saved
    params_after, state_after, groups_after = loaded
    for i, (a, b) in enumerate(zip(params, params_after)):
        if not torch.equal(a, b):
            return f"parameter {i}"
    if state.keys() != state_after.keys():
        return f"the parameters with state: {sorted(state)} saved, {sorted(state_after)} loaded"
    for i, s in state.items():
        if s.keys() != state_after[i].keys():
            return f"parameter {i}'s state keys: {sorted(s)} saved, {sorted(state_after[i])} loaded"
        for k, v in s.items():
            if not torch.equal(v, state_after[i][k]):
                return f"parameter {i}'s {k}"
    return None if groups == groups_after else f"the param groups' settings: {groups} saved, {groups_after} loaded"


@settings(max_examples=8)
@given(world=st.integers(1, 4), world_after=st.integers(1, 4), stage=st.integers(0, 2),
       stage_after=st.integers(0, 2), opt=st.sampled_from(sorted(OPTIMIZERS)), half=st.booleans(),
       grouped=st.booleans(), shapes=shapes)
def test_zero_of_any_stage_saved_at_k_loads_at_any_stage_and_k_prime_bit_for_bit(
        world, world_after, stage, stage_after, opt, half, grouped, shapes):
    path = tempfile.mkdtemp(prefix="test_reshard_zero_")
    try:
        saved = run(world, save_worker, path, shapes, stage, opt, half, grouped)[0]
        for rank, loaded in enumerate(run(world_after, load_worker, path, shapes, stage_after, opt, half, grouped)):
            difference = same(saved, loaded)
            assert difference is None, (f"ZeRO-{stage} at K = {world} -> ZeRO-{stage_after} at K' = {world_after}, "
                                        f"rank {rank}: {difference} differs")
    finally:
        shutil.rmtree(path)


def plain_worker(path, shapes, opt, grouped):
    """The same checkpoint into the Toy module (its parameters zeroed) and torch's own optimizer, in one process."""
    model = Toy(shapes, torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    cls, hyper = OPTIMIZERS[opt]
    plain = cls(named_groups(model, grouped, hyper["lr"]), **hyper)
    load_module_state(path, module_layout(model), plain)
    state = plain.state_dict()
    tensors = {i: {k: v.cpu() for k, v in s.items()} for i, s in state["state"].items()}  # cpu: compared
    groups = [{k: v for k, v in g.items() if k not in ("params", "param_names")} for g in state["param_groups"]]
    return [p.detach().cpu() for p in model.parameters()], tensors, groups  # cpu: as above


@settings(max_examples=6)
@given(world=st.integers(1, 4), stage=st.integers(0, 2), opt=st.sampled_from(sorted(OPTIMIZERS)),
       grouped=st.booleans(), shapes=shapes)
def test_a_zero_checkpoint_loads_into_the_plain_module_and_torch_optimizer_bit_for_bit(
        world, stage, opt, grouped, shapes):
    path = tempfile.mkdtemp(prefix="test_reshard_zero_")
    try:
        params, state, groups = run(world, save_worker, path, shapes, stage, opt, False, grouped)[0]
        loaded = run(1, plain_worker, path, shapes, opt, grouped)[0]
        plain_groups = [{k: v for k, v in g.items() if k != "param_names"} for g in groups]
        difference = same((params, state, plain_groups), loaded)
        assert difference is None, f"ZeRO-{stage} at K = {world} -> torch.optim.{opt} in one process: {difference}"
    finally:
        shutil.rmtree(path)
