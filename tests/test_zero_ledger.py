"""ZeRO's ledgers (mini_dist/zero_ledger.py): the bytes each rank sends per step and the bytes it holds, read
from the ring's LEDGER and from the live tensors' storages, equal the stage formulas exactly; on a GPU, the
memory ledger equals what the CUDA allocator counts."""
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import BACKEND, device, run
from mini_dist.kit.wire import LEDGER
from mini_dist.questions import sharding
from mini_dist.zero_optimizer import ZeroOptimizer
from mini_dist.zero_ledger import bytes_sent_formula, memory_formula, memory_ledger
from test_zero import OPTIMIZERS, Toy, hyperparameters, shapes, train


def state_buffers(opt) -> int:
    """Per-element buffers the optimizer keeps: Adam(W) 2 (+1 amsgrad), SGD 1 with momentum, else 0."""
    name, hp = opt
    return 2 + hp["amsgrad"] if name != "SGD" else int(hp["momentum"] > 0)


def ledger_worker(shapes, stage, opt_name, hp, half):
    cls = OPTIMIZERS[opt_name]
    dtype = torch.bfloat16 if half else torch.float32
    model = Toy(shapes, dtype)
    zero = ZeroOptimizer(model.named_parameters(), cls, stage=stage, collectives="ring", **hp)
    train(model, zero, [0])
    LEDGER.reset()
    train(model, zero, [1])
    sharded = {k: v.numel() for k, v in zero.optimizer.state[zero.slices[0]].items() if v.dim() > 0}
    plain_model = Toy(shapes, dtype)  # the unsharded optimizer, one step on this rank alone
    plain = cls(plain_model.ps, **hp)
    train(plain_model, plain, [0])
    unsharded = {}
    for s in plain.state.values():
        for k, v in s.items():
            if v.dim() > 0:  # per-element (no 0-dim parameters here), not Adam's `step`
                unsharded[k] = unsharded.get(k, 0) + v.numel()
    return (zero.partition, sharded, unsharded, LEDGER.sent, LEDGER.received,
            memory_ledger(model.ps, zero))


ledger_cases = dict(world=st.integers(1, 5), shapes=shapes.filter(lambda s: all(len(x) > 0 for x in s)),
                    stage=st.integers(0, 2), opt=hyperparameters, half=st.booleans())


@settings(max_examples=12)
@given(**ledger_cases)
def test_optimizer_state_per_rank_is_exactly_its_shard_of_the_unsharded_state(world, shapes, stage, opt,
                                                                               half):
    results = run(world, ledger_worker, shapes, stage, opt[0], opt[1], half)
    part, _, unsharded, *_ = results[0]
    assert len(unsharded) == state_buffers(opt) and all(v == part.numel for v in unsharded.values())
    for _, sharded, *_ in results:  # each buffer: the whole padded vector (stage 0) or ceil(N/K) elements
        assert sharded.keys() == unsharded.keys()
        assert all(c == (part.padded_numel if stage == 0 else -(-part.numel // world))
                   for c in sharded.values())
    if stage > 0:  # together exactly the unsharded state, plus at most K-1 elements of padding
        for key, n in unsharded.items():
            total = sum(sharded[key] for _, sharded, *_ in results)
            assert total == part.padded_numel and 0 <= total - n < world


@settings(max_examples=12)
@given(**ledger_cases)
def test_bytes_sent_and_received_per_step_equal_the_stage_formula_exactly(world, shapes, stage, opt, half):
    for part, _, _, sent, received, _ in run(world, ledger_worker, shapes, stage, opt[0], opt[1], half):
        assert sent == received == bytes_sent_formula(stage, part, 2 if half else 4)


@settings(max_examples=12)
@given(**ledger_cases)
def test_memory_ledger_of_params_grads_and_state_equals_the_stage_formula_exactly(world, shapes, stage, opt,
                                                                                  half):
    for part, *_, mem in run(world, ledger_worker, shapes, stage, opt[0], opt[1], half):
        state_bytes = 4 * state_buffers(opt) + (4 if half else 0)  # + fp32 master weights for bf16
        want = memory_formula(stage, part, 2 if half else 4, state_bytes)
        assert {k: mem[k] for k in want} == want


def stages_worker():
    return sharding.stages_memory_and_traffic()


@pytest.mark.parametrize("world", [1, 2, 4])
def test_each_stage_measures_its_formula_and_zero_2_sends_what_ddp_sends(world):
    for rank, (figure, holds) in enumerate(run(world, stages_worker)):
        assert holds, f"rank {rank}: {figure}"


# ----------------------------------------------------------------------------- GPU (issues 11, 35)


def cuda_memory_worker(stage):
    """What the CUDA allocator gained over a ZeroOptimizer's build and two Adam steps, and the ledger.

    Compared where the two are exactly comparable: the second of two identical runs. The first run pays
    what a process allocates once and keeps (workspaces of the first kernels and collectives) and lets
    whatever an earlier test on this rank left behind be freed; the delta of the second is the run's own
    tensors. Every storage the ledger counts is a multiple of the allocator's 512-byte blocks (384*K fp32
    elements, shards of 384), so the allocator's rounding changes none of them; the two storages outside
    the ledger (the frozen parameter, a step counter kept on the GPU) are rounded up to 512 B here."""
    import gc
    k = dist.get_world_size()
    dev = device()

    def block(nbytes):
        """nbytes rounded up to the allocator's 512-byte blocks."""
        return -(-nbytes // 512) * 512

    def once():
        model = Toy([(128 * k,), (2 * k, 128)], torch.float32)
        zero = ZeroOptimizer(model.parameters(), torch.optim.Adam, stage=stage, lr=1e-3)
        train(model, zero, range(2))
        torch.cuda.synchronize(dev)
        return model, zero
    once()
    gc.collect()
    base = torch.cuda.memory_allocated(dev)
    model, zero = once()
    gc.collect()
    mem = memory_ledger(model.ps, zero)
    extra = block(model.frozen.untyped_storage().nbytes()) + sum(
        block(v.nbytes) for v in zero.optimizer.state[zero.slices[0]].values() if v.dim() == 0 and v.is_cuda)
    return torch.cuda.memory_allocated(dev) - base, mem["params"] + mem["grads"] + mem["state"] + extra


@pytest.mark.skipif(not torch.cuda.is_available() or BACKEND != "nccl",
                    reason="needs CUDA and MINI_DIST_BACKEND=nccl (./run.sh test --gpu): the memory ledger "
                           "is checked against torch.cuda.memory_allocated, the GPU allocator's own count")
@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_memory_ledger_equals_torch_cuda_memory_allocated(world, stage):
    for rank, (allocated, ledger) in enumerate(run(world, cuda_memory_worker, stage)):
        assert allocated == ledger, f"rank {rank}: the allocator gained {allocated:,} B, the ledger counts {ledger:,} B"
