"""FSDP's state dicts (mini_dist/fsdp_state.py) as a PyTorch user holds them: torch.save(model.state_dict())
writes the unwrapped module's keys with whole tensors; a fresh model sharded over any number of ranks, any
wrap, loads the file with load_state_dict and takes the same next step, bit for bit, as the run it came from
and as the plain module loaded from the same file. Bad dicts are one clear error on every rank.

Bit for bit: the next step is plain SGD (no optimizer state to carry), on each rank's own batch. Two models
that hold the same values, sharded the same way, run the same operations on the same numbers.
"""
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch import nn

from harness import RankFailure, device, rank_generator, run, subgroup
from mini_dist.fsdp import FullyShardedDataParallel as FSDP
from mini_dist.kit.models import Block

WIDTH = 4
WRAPS = {"blocks": Block, "children": None, "one unit": ()}


class Scale(nn.Module):
    """A buffer the forward uses: a state dict without it would change what the model computes."""

    def __init__(self, width):
        super().__init__()
        self.register_buffer("scale", torch.rand(width).to(device()) + 0.5)

    def forward(self, x):
        return x * self.scale


def build(seed, tied=False):
    """Linear -> Block -> Scale -> Block -> Linear (the outer Linears tied if asked), fp64."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), Block(WIDTH, 5), Scale(WIDTH), Block(WIDTH, 3),
                          nn.Linear(WIDTH, WIDTH)).to(device(), torch.float64)
    if tied:
        model[-1].weight = model[0].weight
    return model


def sgd_step(model, x, y) -> float:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def batch(step):
    g = rank_generator(step)
    return [torch.randn(3, WIDTH, generator=g, dtype=torch.float64).to(device()) for _ in range(2)]


def equal(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k].cpu(), b[k].cpu()) for k in a)


def save_then_load_elsewhere(world, world_after, wrap_after, tied):
    """Train FSDP on the first `world` ranks, torch.save its state_dict(); load it on the first `world_after`
    ranks, wrapped by `wrap_after`; one more step everywhere."""
    rank = dist.get_rank()
    first = subgroup(range(world))
    after = subgroup(range(world_after))
    where = [os.path.join(tempfile.mkdtemp(prefix="mini_dist_test_fsdp_state_"), "model.pt") if rank == 0 else None]
    dist.broadcast_object_list(where)
    found = {}
    if rank < world:
        ours = FSDP(build(seed=1, tied=tied), wrap=Block, group=first)
        for step in range(2):
            sgd_step(ours, *batch(step))
        state = ours.state_dict()
        plain = build(seed=2, tied=tied)
        found["keys"] = list(state) == list(plain.state_dict()) and all(  # the unwrapped module's, whole
            state[k].shape == v.shape for k, v in plain.state_dict().items())
        if rank == 0:
            torch.save(state, where[0])
        found["continued"] = (sgd_step(ours, *batch(2)), ours.state_dict(), state)
    dist.barrier()
    if rank < world_after:
        saved = torch.load(where[0], map_location=device())
        fresh = FSDP(build(seed=3, tied=tied), wrap=WRAPS[wrap_after], group=after)
        result = fresh.load_state_dict(saved)
        found["loaded"] = equal(fresh.state_dict(), saved) and not result.missing_keys + result.unexpected_keys
        plain = build(seed=4, tied=tied)
        plain.load_state_dict(saved)  # strict: the file is the plain module's state dict
        reference = FSDP(plain, wrap=WRAPS[wrap_after], group=after)
        found["resumed"] = (sgd_step(fresh, *batch(2)), fresh.state_dict())
        found["reference"] = (sgd_step(reference, *batch(2)), reference.state_dict())
    dist.barrier()
    if rank == 0:
        os.remove(where[0])
        os.rmdir(os.path.dirname(where[0]))
    return found


@settings(max_examples=10)
@given(world=st.integers(1, 5), world_after=st.integers(1, 5), wrap_after=st.sampled_from(sorted(WRAPS)),
       tied=st.booleans())
def test_torch_save_of_state_dict_loads_at_any_world_size_and_wrap_and_takes_the_same_next_step_bit_for_bit(
        world, world_after, wrap_after, tied):
    assume(not (tied and wrap_after == "children"))  # the tied Linears would be two units: refused (test_fsdp)
    results = run(max(world, world_after), save_then_load_elsewhere, world, world_after, wrap_after, tied)
    for rank, found in enumerate(results):
        if rank < world:
            assert found["keys"], f"rank {rank}: state_dict() is not the plain module's keys, whole"
        if rank < world_after:
            assert found["loaded"], f"rank {rank}: the loaded model's state_dict() is not the file's"
            assert found["resumed"][0] == found["reference"][0], f"rank {rank}: the next loss differs"
            assert equal(found["resumed"][1], found["reference"][1]), f"rank {rank}: the next step differs"
        if rank < min(world, world_after) and world == world_after and wrap_after == "blocks":
            assert found["resumed"][0] == found["continued"][0]  # the run it came from, uninterrupted
            assert equal(found["resumed"][1], found["continued"][1])


def nested_and_partial():
    """A parent module's state_dict() collects FSDP's under its prefix; strict=False loads what is there."""
    ours = FSDP(build(seed=1), wrap=Block)
    parent = nn.ModuleDict({"body": ours})
    collected = parent.state_dict()
    whole = ours.state_dict()
    nested = list(collected) == [f"body.{k}" for k in whole] and all(
        torch.equal(collected[f"body.{k}"], v) for k, v in whole.items())
    fresh = FSDP(build(seed=2), wrap=Block)
    before = fresh.state_dict()
    partial = {k: v for k, v in whole.items() if k != "1.up.weight"}
    result = fresh.load_state_dict(partial, strict=False)
    after = fresh.state_dict()
    loaded = all(torch.equal(after[k], partial[k]) for k in partial) and torch.equal(
        after["1.up.weight"], before["1.up.weight"])
    return nested, result.missing_keys, result.unexpected_keys, loaded


def test_a_parent_collects_the_state_dict_under_its_prefix_and_strict_false_loads_what_is_there():
    for nested, missing, unexpected, loaded in run(3, nested_and_partial):
        assert nested and missing == ["1.up.weight"] and unexpected == [] and loaded


def load_badly(case):
    ours = FSDP(build(seed=1), wrap=Block)
    state = ours.state_dict()
    if case == "missing":
        state.pop("3.down.bias")
    elif case == "missing on rank 1 only" and dist.get_rank() == 1:
        state.pop("3.down.bias")
    elif case == "unexpected":
        state["extra"] = torch.zeros(1, device=device())
    elif case == "misshapen":
        state["1.up.weight"] = torch.zeros(5, WIDTH + 1, dtype=torch.float64, device=device())
    ours.load_state_dict(state)


@pytest.mark.parametrize("case,message", [
    ("missing", r"does not fit the module \(rank 0: missing keys \['3.down.bias'\]; rank 1: .*\): pass"),
    ("missing on rank 1 only", r"does not fit the module \(rank 1: missing keys \['3.down.bias'\]\)"),
    ("unexpected", r"unexpected keys \['extra'\]"),
    ("misshapen", r"1.up.weight \(want shape \(5, 4\), got \(5, 5\)\)"),
])
def test_a_state_dict_that_does_not_fit_is_one_clear_error_on_every_rank(case, message):
    with pytest.raises(RankFailure, match=message) as info:
        run(3, load_badly, case)
    assert all(f"rank {r} failed" in str(info.value) for r in range(3))  # everyone raised the same error


def checkpoint_layout():
    from mini_dist.reshard import fsdp_layout
    model = build(seed=1)
    norm_like = [model[1].up.bias, model[4].bias]  # two parameters left whole
    ours = FSDP(model, wrap=Block, ignored_params=set(norm_like))
    layout = fsdp_layout(ours)
    whole = [isinstance(layout[n][1](p.detach()), torch.Tensor) == any(p is q for q in norm_like)
             for n, p in ours.named_parameters()]  # a plain tensor is replicated; a slice becomes boxes
    return list(layout) == [n for n, _ in model.named_parameters()], whole


def test_a_checkpoint_of_fsdp_holds_every_parameter_the_ones_left_whole_replicated():
    """reshard.fsdp_layout, what checkpoints save FSDP through: sharded parameters as boxes of their slice,
    ignored ones as whole tensors (replicated: rank 0 writes them), none left out."""
    for names, whole in run(2, checkpoint_layout):
        assert names and all(whole)
