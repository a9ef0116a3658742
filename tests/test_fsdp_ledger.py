"""FSDP's bytes per rank beside DDP's (mini_dist/fsdp_ledger.py): read from the live tensors and from FSDP's
ledger, they equal the table: shards of params, grads and Adam state, plus the units gathered at the peak."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import device, run
from mini_dist import fsdp_ledger
from mini_dist.kit import models
from mini_dist.questions import sharding

KINDS = {"naive": dict(prefetch=False), "prefetch": {}, "kept": dict(reshard_after_forward=False)}


def memory_worker(depth, width, kind):
    model, adam, _ = fsdp_ledger.trained(width, 2 * width, depth, **KINDS[kind])
    return (fsdp_ledger.memory_per_rank(model, adam), sum(u.shard_numel for u in model.units),
            sum(p.numel() for p in model.parameters()), [u.full.nbytes for u in model.units])


@settings(max_examples=8)
@given(world=st.integers(1, 5), depth=st.integers(2, 4), width=st.integers(1, 6), kind=st.sampled_from(sorted(KINDS)))
def test_fsdp_holds_shards_of_params_grads_and_adam_state_plus_the_gathered_units(world, depth, width, kind):
    for rank, (got, S, mine, full) in enumerate(run(world, memory_worker, depth, width, kind)):
        peak = {"naive": full[0] + max(full[1:]), "kept": sum(full),
                "prefetch": full[0] + max(a + b for a, b in zip(full[1:], full[2:]))}[kind]
        # 4 B per element of my padded shards (params, grads), 8 B of Adam state per real element I own
        want = {"params": 4 * S, "grads": 4 * S, "state": 8 * mine, "gathered": peak}
        assert got == want, f"rank {rank}, {kind}: measured {got}, the table says {want}"


def ddp_worker():
    model = models.block_stack(4, 8, 2, torch.float32, device())
    adam = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(3, 4, device=device())).square().mean().backward()
    adam.step()
    return fsdp_ledger.memory_per_rank(model, adam), sum(p.numel() for p in model.parameters())


def test_a_model_kept_whole_holds_16_bytes_per_parameter_and_nothing_gathered():
    got, N = run(1, ddp_worker)[0]
    assert got == {"params": 4 * N, "grads": 4 * N, "state": 8 * N, "gathered": 0}


def questions_worker():
    return sharding.gathers_twice(), sharding.traffic_vs_ddp()


@pytest.mark.parametrize("world", [1, 2, 4])
def test_fsdp_gathers_twice_and_sends_one_and_a_half_times_ddp(world):
    for rank, answers in enumerate(run(world, questions_worker)):
        for figure, holds in answers:
            assert holds, f"rank {rank}: {figure}"


@pytest.mark.single_process
@pytest.mark.parametrize("steps", [0, -1])
def test_training_no_step_is_refused_before_any_collective(steps):
    with pytest.raises(ValueError, match=f"steps must be at least 1 .*got {steps}"):
        fsdp_ledger.trained(steps=steps)
