"""Tensor parallelism equals the dense PyTorch modules it splits: nn.Linear, an nn.Sequential MLP,
nn.MultiheadAttention and a pre-norm block of them (the vocabulary is tested in test_vocab_parallel.py).
Outputs, input gradients and all-gathered weight gradients, in fp64, for TP sizes 1-4 on groups that need
not span the pool (a TP group of 3 inside a pool of 4 or 5; two groups of 2 side by side in a pool of 4),
with and without sequence parallelism. The collectives per layer are counted at torch.distributed itself.

Tolerance. Both sides compute the same sums in a different order: a matmul split in T pieces whose
partial results are added by an all-reduce, a softmax whose max and sum come from T shards. Reordering a
K-term sum changes it by at most K*eps*sum|terms|; here K <= ~300 (hidden, 4*hidden, tokens) and the terms
are O(1), so differences stay below ~1e-13 of the largest value (seen: <= 1.1e-15 over 60 drawn cases).
We allow TOL = 1000 * eps(fp64) = 2.2e-13 relative to max(1, largest value). A wrong shard, a missing or
doubled reduction or a bias added T times is an O(1) error.
"""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import device, run, subgroup
from mini_dist import tensor_parallel as tp

F64 = torch.float64
TOL = 1000 * torch.finfo(F64).eps


def tp_group(T):
    """Cut the pool into consecutive TP groups of T; ranks left over get None. Every rank creates every
    group (new_group is collective over the world)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = [subgroup(range(i * T, (i + 1) * T)) for i in range(world // T)]
    return (groups[rank // T], rank // T) if rank // T < len(groups) else (None, None)


def seed_group(seed, index):
    """Ranks of one TP group hold the same dense model and data (TP replicates them); groups differ."""
    torch.manual_seed(seed * 1009 + index)


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1)).item() if b.numel() else 0.0


def compare(parallel, dense, group, out, ref_out, grads_in):
    """Largest relative error over the output, the input grads and every gathered weight and grad."""
    gathered = tp.gather_to_dense(parallel, _fresh_copy(dense), group)
    errors = [rel_err(out, ref_out)] + [rel_err(a, b) for a, b in grads_in]
    for (name, p), q in zip(gathered.named_parameters(), dense.parameters()):
        assert p.grad is not None, f"{name} got no gradient"
        errors += [rel_err(p, q), rel_err(p.grad, q.grad)]
    return max(errors)


def _fresh_copy(dense):
    """A zeroed copy for gather_to_dense to fill: nothing in it can come from the dense run."""
    blank = copy.deepcopy(dense)
    for p in blank.parameters():
        p.grad = None
        p.data.zero_()
    return blank


def seq_shard(t, group):
    return t.chunk(dist.get_world_size(group), 1)[dist.get_rank(group)]


def feature_shard(t, group):
    return t.chunk(dist.get_world_size(group), -1)[dist.get_rank(group)]


def run_both(dense, parallel, group, x, shard_in, shard_out, sp, ref=None):
    """Forward and backward through dense and parallel; x is the full input, shard_in/out pick this
    rank's part of the input and output; returns the largest relative error."""
    x = x.requires_grad_()
    ref_out = (ref or dense)(x)
    dy = torch.randn_like(ref_out)
    ref_out.backward(dy)
    xin = shard_in(x.detach()).requires_grad_()
    out = parallel(xin)
    out.backward(shard_out(dy))
    if sp:
        tp.allreduce_sequence_parallel_grads(parallel, group)
    return compare(parallel, dense, group, out, shard_out(ref_out), [(xin.grad, shard_in(x.grad))])


worlds_and_sizes = st.integers(1, 4).flatmap(lambda T: st.tuples(st.just(T), st.integers(T, 5)))  # (T, pool)


# ----- the conjugate operators -----

OPERATORS = {  # name: (forward on rank r, backward on rank r), from every rank's inputs xs / output grads dys
    "f": (lambda xs, r, T: xs[r], lambda dys, r, T: sum(dys)),
    "g": (lambda xs, r, T: sum(xs), lambda dys, r, T: dys[r]),
    "gather_from_tp": (lambda xs, r, T: torch.cat(xs, -1), lambda dys, r, T: dys[r].chunk(T, -1)[r]),
    "split_to_tp": (lambda xs, r, T: xs[r].chunk(T, -1)[r], lambda dys, r, T: torch.cat(dys, -1)),
    "gather_from_sp": (lambda xs, r, T: torch.cat(xs, 1), lambda dys, r, T: sum(dys).chunk(T, 1)[r]),
    "reduce_scatter_to_sp": (lambda xs, r, T: sum(xs).chunk(T, 1)[r], lambda dys, r, T: torch.cat(dys, 1)),
    "split_to_sp": (lambda xs, r, T: xs[r].chunk(T, 1)[r], lambda dys, r, T: torch.cat(dys, 1)),
}


def operators_worker(seed, T, shape):
    group, index = tp_group(T)
    if group is None:
        return None
    r = dist.get_rank(group)

    def every_ranks(kind, shape):  # each rank can rebuild what every rank of its group drew
        return [torch.randn(shape, dtype=F64, generator=torch.Generator().manual_seed(
            seed * 1009 + index * 101 + kind * 11 + q)).to(device()) for q in range(T)]
    errors = []
    for name, (forward, backward) in OPERATORS.items():
        xs = every_ranks(0, shape)
        x = xs[r].clone().requires_grad_()
        out = getattr(tp, name)(x, group)
        dys = every_ranks(1, out.shape)
        out.backward(dys[r])
        errors += [(name, rel_err(out, forward(xs, r, T)), rel_err(x.grad, backward(dys, r, T)))]
    return errors


@settings(max_examples=10)
@given(worlds_and_sizes, st.integers(1, 2), st.integers(1, 2), st.integers(1, 2), st.integers(0, 2**16))
def test_conjugate_operators_do_the_collective_they_name_forward_and_its_conjugate_backward(T_world, b, s_k,
                                                                                         h_k, seed):
    T, world = T_world
    for result in run(world, operators_worker, seed, T, (b, s_k * T, h_k * T)):
        for name, forward_error, backward_error in result or []:
            assert forward_error < TOL and backward_error < TOL, (name, forward_error, backward_error)


# ----- linear layers -----

def linear_worker(seed, T, batch, seq, in_k, out_k, column, option, sp, bias):
    group, index = tp_group(T)
    if group is None:
        return None
    seed_group(seed, index)
    in_f, out_f, s = in_k * T, out_k * T, seq * T
    dense = nn.Linear(in_f, out_f, bias=bias, device=device(), dtype=F64)
    kw = dict(bias=bias, sequence_parallel=sp, group=group, device=device(), dtype=F64)
    ident = lambda t: t  # noqa: E731
    seq_part = (lambda t: seq_shard(t, group)) if sp else ident
    feat_part = lambda t: feature_shard(t, group)  # noqa: E731
    if column:
        layer = tp.ColumnParallelLinear(in_f, out_f, gather_output=option, **kw)
        shard_in, shard_out = seq_part, ident if option else feat_part
    else:
        layer = tp.RowParallelLinear(in_f, out_f, input_is_parallel=option, **kw)
        shard_in, shard_out = feat_part if option else ident, seq_part
    tp.shard_from_dense(layer, dense, group)
    x = torch.randn(batch, s, in_f, device=device(), dtype=F64)
    return run_both(dense, layer, group, x, shard_in, shard_out, sp)


@settings(max_examples=20)
@given(worlds_and_sizes, st.integers(1, 3), st.integers(1, 3), st.integers(1, 3), st.integers(1, 3),
       st.booleans(), st.booleans(), st.booleans(), st.booleans(), st.integers(0, 2**16))
def test_column_and_row_parallel_linear_equal_nn_linear(T_world, batch, seq, in_k, out_k, column, option,
                                                         sp, bias, seed):
    T, world = T_world
    errors = [e for e in run(world, linear_worker, seed, T, batch, seq, in_k, out_k, column, option, sp, bias)
              if e is not None]
    assert errors and max(errors) < TOL, errors


# ----- MLP, attention, block -----

def module_worker(kind, seed, T, batch, seq, heads_k, head_dim, causal, sp):
    group, index = tp_group(T)
    if group is None:
        return None
    seed_group(seed, index)
    heads, s = heads_k * T, seq * T
    h = heads * head_dim
    kw = dict(sequence_parallel=sp, group=group, device=device(), dtype=F64)
    mask = torch.ones(s, s, dtype=torch.bool, device=device()).triu(1) if causal else None
    ref = None
    if kind == "mlp":
        dense = nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h)).to(device(), F64)
        parallel = tp.ParallelMLP(h, **kw)
    elif kind == "attention":
        dense = nn.MultiheadAttention(h, heads, batch_first=True, device=device(), dtype=F64)
        parallel = tp.ParallelAttention(h, heads, causal, **kw)
        ref = lambda x: dense(x, x, x, attn_mask=mask, need_weights=False)[0]  # noqa: E731
    else:
        dense = tp.TransformerBlock(h, heads, causal, device=device(), dtype=F64)
        parallel = tp.ParallelTransformerBlock(h, heads, causal, **kw)
    with torch.no_grad():  # layer norms start at weight 1, bias 0: randomise them so their grads matter
        for p in dense.parameters():
            p.add_(0.1 * torch.randn_like(p))
    tp.shard_from_dense(parallel, dense, group)
    x = torch.randn(batch, s, h, device=device(), dtype=F64)
    shard = (lambda t: seq_shard(t, group)) if sp else (lambda t: t)
    return run_both(dense, parallel, group, x, shard, shard, sp, ref)


@pytest.mark.parametrize("kind", ["mlp", "attention", "block"])  # vs nn.Sequential / nn.MultiheadAttention / both
@settings(max_examples=12)
@given(worlds_and_sizes, st.integers(1, 2), st.integers(1, 3), st.integers(1, 2), st.integers(1, 4),
       st.booleans(), st.booleans(), st.integers(0, 2**16))
def test_parallel_mlp_attention_and_block_equal_their_dense_pytorch_modules(kind, T_world, batch, seq, heads_k,
                                                                           head_dim, causal, sp, seed):
    T, world = T_world
    errors = [e for e in run(world, module_worker, kind, seed, T, batch, seq, heads_k, head_dim, causal, sp)
              if e is not None]
    assert errors and max(errors) < TOL, errors


def native_worker(seed, T):
    """ParallelMLP beside PyTorch's own tensor parallelism (DTensor) on the same TP group."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    group, index = tp_group(T)
    if group is None:
        return None
    seed_group(seed, index)
    mesh = DeviceMesh.from_group(group, device().type)
    dense = nn.Sequential(nn.Linear(3 * T, 12 * T), nn.GELU(), nn.Linear(12 * T, 3 * T)).to(device(), F64)
    x = torch.randn(2, 2 * T, 3 * T, device=device(), dtype=F64)
    errors = []
    for sp in (False, True):
        native = parallelize_module(copy.deepcopy(dense), mesh, {
            "0": ColwiseParallel(input_layouts=Shard(1)) if sp else ColwiseParallel(),
            "2": RowwiseParallel(output_layouts=Shard(1)) if sp else RowwiseParallel()})
        mine = tp.shard_from_dense(tp.ParallelMLP(3 * T, sequence_parallel=sp, group=group, device=device(),
                                                  dtype=F64), dense, group)
        xin = seq_shard(x, group) if sp else x
        outs = [module(xin) for module in (native, mine)]
        for out in outs:
            out.square().sum().backward()
        tp.allreduce_sequence_parallel_grads(mine, group)
        errors.append(rel_err(outs[1], outs[0]))
        errors += [rel_err(p.grad, q.grad.to_local()) for p, q in zip(mine.parameters(), native.parameters())]
    return errors


def test_parallel_mlp_equals_torch_distributed_tensor_parallel_with_and_without_sequence_parallel():
    for world, T in [(3, 3), (4, 2)]:  # one group spanning the pool; two groups of 2 side by side
        errors = [e for e in run(world, native_worker, world, T) if e is not None]
        assert errors and max(max(e) for e in errors) < TOL, errors


# ----- collectives, counted at torch.distributed -----

def count_worker(T, layers, sp):
    group, index = tp_group(T)
    if group is None:
        return None
    seen = {}
    originals = {name: getattr(dist, name) for name in ("all_reduce", "all_gather_single",
                                                        "reduce_scatter_single")}

    def counting(name):
        def call(*args, **kwargs):
            seen[name] = seen.get(name, 0) + 1
            return originals[name](*args, **kwargs)
        return call
    b, s, h, heads = 2, 2 * T, 4 * T, T
    block = nn.Sequential(*[tp.ParallelTransformerBlock(h, heads, sequence_parallel=sp, group=group,
                                                        device=device()) for _ in range(layers)])
    x = torch.randn(b, s // T if sp else s, h, device=device(), requires_grad=True)
    for name in originals:
        setattr(dist, name, counting(name))
    try:
        tp.COUNTER.reset()
        out = block(x)
        forward, forward_seen, forward_bytes = dict(tp.COUNTER.calls), dict(seen), dict(tp.COUNTER.bytes)
        tp.COUNTER.reset()
        seen.clear()
        out.sum().backward()
        backward, backward_seen, backward_bytes = dict(tp.COUNTER.calls), dict(seen), dict(tp.COUNTER.bytes)
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    payload = b * s * h * 4  # every collective of a layer moves one [b, s, h] fp32 activation
    for calls, nbytes in [(forward, forward_bytes), (backward, backward_bytes)]:
        assert nbytes == {k: payload * n for k, n in calls.items()}, (nbytes, calls, payload)
    return forward, forward_seen, backward, backward_seen


@settings(max_examples=10)
@given(worlds_and_sizes, st.integers(1, 3), st.booleans())
def test_two_all_reduces_per_layer_each_way_or_their_reduce_scatter_all_gather_halves(T_world, layers, sp):
    T, world = T_world
    names = {"all_reduce": "all_reduce", "all_gather": "all_gather_single",
             "reduce_scatter": "reduce_scatter_single"}
    if T == 1:
        want_fwd = want_bwd = {}
    elif sp:  # backward gathers each column layer's input again instead of storing it (SP paper, 4.2.2)
        want_fwd, want_bwd = {"all_gather": 2 * layers, "reduce_scatter": 2 * layers}, {
            "all_gather": 4 * layers, "reduce_scatter": 2 * layers}
    else:
        want_fwd = want_bwd = {"all_reduce": 2 * layers}
    for result in run(world, count_worker, T, layers, sp):
        if result is None:
            continue
        forward, forward_seen, backward, backward_seen = result
        assert forward == want_fwd and backward == want_bwd, result
        assert forward_seen == {names[k]: v for k, v in want_fwd.items()}, result  # the counter tells the truth
        assert backward_seen == {names[k]: v for k, v in want_bwd.items()}, result


# ----- errors: clear, identical on every rank, before anyone blocks -----

def error_messages(builds):
    """What each call raises (None if it returns) on this rank, then a barrier that a rank blocked in a
    collective would never reach."""
    messages = []
    for build in builds:
        try:
            build()
            messages.append(None)
        except ValueError as e:
            messages.append(str(e))
    dist.barrier()
    return messages


def assert_same_clear_errors(results, expected):
    assert all(r == results[0] for r in results), "ranks disagree: some would block in a collective"
    assert len(results[0]) == len(expected)
    for message, want in zip(results[0], expected):
        assert message is not None and message.startswith(want), (message, want)


def errors_worker():
    group, _ = tp_group(2)
    x = lambda *shape: torch.randn(shape, device=device())  # noqa: E731
    return error_messages([lambda: tp.ParallelAttention(9, 3, group=group),
                           lambda: tp.ParallelAttention(10, 4, group=group),
                           lambda: tp.ColumnParallelLinear(4, 5, group=group),
                           lambda: tp.RowParallelLinear(5, 4, group=group),
                           lambda: tp.ColumnParallelLinear(4, 6, group=group)(x(2, 3, 5)),
                           lambda: tp.RowParallelLinear(4, 6, group=group)(x(2, 3, 4)),
                           lambda: tp.ParallelMLP(4, sequence_parallel=True, group=group)(x(2, 4)),
                           lambda: tp.split_to_sp(x(2, 3, 4), group),
                           lambda: tp.shard_from_dense(tp.ColumnParallelLinear(4, 6, group=group),
                                                       nn.Linear(4, 8), group),
                           lambda: tp.shard_from_dense(tp.ParallelMLP(4, group=group), nn.Linear(4, 4), group)])


def test_bad_sizes_and_shapes_raise_clear_errors_on_every_rank_without_blocking():
    assert_same_clear_errors(run(4, errors_worker), [
        "num_heads=3 is not divisible by the tensor-parallel size 2",
        "hidden=10 is not divisible by num_heads=4",
        "out_features=5 is not divisible by the tensor-parallel size 2",
        "in_features=5 is not divisible by the tensor-parallel size 2",
        "ColumnParallelLinear expects inputs [..., 4], got (2, 3, 5)",
        "RowParallelLinear expects inputs [..., 2], got (2, 3, 4)",
        "sequence parallel needs [batch, seq/T, hidden] inputs, got (2, 4)",
        "size 3 along dim 1 is not divisible by the tensor-parallel size 2",
        "shard of shape (4, 4) does not fit a parameter of shape (3, 4)",
        "the dense module has no parameter '0.weight'"])


def outsider_worker():
    subgroup([0, 1])
    if dist.get_rank() != 2:
        return None
    try:
        tp.ColumnParallelLinear(4, 4, group=subgroup([0, 1]))
    except ValueError as e:
        return str(e)


def test_a_rank_outside_the_group_is_told_so():
    assert "is not in this tensor-parallel group" in run(3, outsider_worker)[2]

