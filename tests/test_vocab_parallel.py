"""Vocabulary parallelism equals nn.Embedding + F.cross_entropy: the loss and the all-gathered gradients
of the embedding and of a column-parallel output layer, in fp64, for TP sizes 1-4 on groups that need not
span the pool, with and without sequence parallelism; the vocab-parallel loss never builds a [..., V]
tensor and all-reduces 3 numbers per token; ranks that disagree on shapes are named. The TP groups, the
comparison and its tolerance are those of test_tensor_parallel.py.

Tolerance. TOL = 1000 * eps(fp64), relative, as there: the loss here reorders sums of at most ~40 O(1)
terms (a softmax over V <= 32 logits assembled from T shards, a mean over <= 36 tokens, matmuls over
h <= 4), so reordering moves it by well under 100 eps; with logits of 1e4 the loss is a difference of
numbers near 1e4, whose rounding is eps relative to them. A token looked up on two ranks, a max or a sum
taken over one shard only, or a target logit subtracted on a rank that does not own it is an O(1) error.
"""
import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from harness import device, run
from mini_dist import comm
from mini_dist import tensor_parallel as tp
from mini_dist import vocab_parallel as vp
from test_tensor_parallel import (F64, TOL, assert_named_on_every_rank, assert_same_clear_errors, compare,
                                  error_messages, provoke, rel_err, seed_group, tp_group, worlds_and_sizes)


def holds_full_logits(shape, tokens, V) -> bool:
    """Could a tensor of this shape hold every token's V logits? It has as many elements as tokens x V or
    more, and V is one of its dims (or it is flat). A rank's own logits [tokens, V/T] have T times fewer
    elements; the weights [V/T, h] have no dim V (h < V): neither is mistaken for them, even where the
    token count equals V and [V/T, tokens] would end in V."""
    numel = math.prod(shape)
    return numel >= tokens * V and (V in shape or len(shape) == 1)


class ShapeRecorder(TorchDispatchMode):
    """The shape of every floating-point tensor any op produces on this rank: proof of what was (not)
    materialised. (Integer tensors are ids, targets, masks, and debug mode's pickled shape agreements.)"""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self.shapes.append(tuple(t.shape))
        return out


def vocab_worker(seed, T, batch, seq, vocab_k, h, sp):
    group, index = tp_group(T)
    if group is None:
        return None
    seed_group(seed, index)
    V, s = vocab_k * T, seq * T
    dense = nn.Sequential(nn.Embedding(V, h), nn.Linear(h, V, bias=False)).to(device(), F64)
    ids = torch.randint(0, V, (batch, s), device=device())
    target = torch.randint(0, V, (batch, s), device=device())
    ref_loss = F.cross_entropy(dense(ids).flatten(0, 1), target.flatten())
    ref_loss.backward()
    kw = dict(sequence_parallel=sp, group=group, device=device(), dtype=F64)
    results = []
    for loss_fn in (vp.vocab_parallel_cross_entropy, vp.naive_vocab_cross_entropy):
        parallel = nn.Sequential(vp.VocabParallelEmbedding(V, h, **kw),
                                 tp.ColumnParallelLinear(h, V, bias=False, **kw))
        tp.shard_from_dense(parallel, dense, group)
        with ShapeRecorder() as recorder:
            loss = loss_fn(parallel(ids), target, group).mean()
            loss.backward()
        full_logits = [shape for shape in recorder.shapes if holds_full_logits(shape, batch * s, V)]
        results.append((compare(parallel, dense, group, loss, ref_loss, []), full_logits))
    return results


@settings(max_examples=15)
@given(worlds_and_sizes, st.integers(1, 3), st.integers(1, 3), st.integers(5, 8), st.integers(1, 4),
       st.booleans(), st.integers(0, 2**16))
@example(T_world=(2, 2), batch=2, seq=3, vocab_k=6, h=1, sp=False, seed=0)  # tokens = V = 12: [V/T, tokens]
@example(T_world=(2, 2), batch=1, seq=1, vocab_k=5, h=4, sp=False, seed=0)  # weights [V/T, 4] = tokens x V
def test_vocab_parallel_embedding_and_cross_entropy_equal_dense_without_full_logits(T_world, batch, seq,
                                                                                   vocab_k, h, sp, seed):
    T, world = T_world  # vocab_k >= 5 > h: no dim of the weights or activations other than the logits' is V
    for ours, naive in [r for r in run(world, vocab_worker, seed, T, batch, seq, vocab_k, h, sp) if r]:
        assert ours[0] < TOL and naive[0] < TOL, (ours, naive)
        assert ours[1] == [] or T == 1, f"the vocab-parallel loss built full logits {ours[1]}"
        assert naive[1] != [], "the recorder must see the naive loss all-gather the full logits"


def huge_logits_worker(seed, T, tokens, vocab_k):
    group, index = tp_group(T)
    if group is None:
        return None
    seed_group(seed, index)
    full = 1e4 * torch.randn(tokens, vocab_k * T, device=device(), dtype=F64)
    target = torch.randint(0, vocab_k * T, (tokens,), device=device())
    ours = vp.vocab_parallel_cross_entropy(full.chunk(T, -1)[dist.get_rank(group)], target, group)
    return rel_err(ours, F.cross_entropy(full, target, reduction="none"))


@settings(max_examples=10)
@given(worlds_and_sizes, st.integers(1, 6), st.integers(1, 5), st.integers(0, 2**16))
def test_vocab_parallel_cross_entropy_is_as_stable_as_f_cross_entropy_for_huge_logits(T_world, tokens, vocab_k,
                                                                                      seed):
    # exp(1e4) overflows and exp(-1e4) underflows: only a shift by the max over ALL ranks' logits, the same
    # on every rank, keeps the sums finite and exact (the O(1) logits above cannot tell one shift from another)
    T, world = T_world
    errors = [e for e in run(world, huge_logits_worker, seed, T, tokens, vocab_k) if e is not None]
    assert errors and max(errors) < TOL, errors


def cross_entropy_count_worker(T):
    group, _ = tp_group(T)
    if group is None:
        return None
    logits, target = torch.randn(3, 5, 7, device=device()), torch.randint(0, 7 * T, (3, 5), device=device())
    logits.requires_grad_()
    comm.COUNTER.reset()
    loss = vp.vocab_parallel_cross_entropy(logits, target, group)
    forward = dict(comm.COUNTER.calls), dict(comm.COUNTER.bytes)
    comm.COUNTER.reset()
    loss.sum().backward()
    return forward, dict(comm.COUNTER.calls)


def test_vocab_parallel_cross_entropy_all_reduces_per_token_numbers_not_logits():
    # forward: one all-reduce of the 15 per-token maxima, one of the 2 x 15 stacked sums; backward: none
    for result in run(3, cross_entropy_count_worker, 3):
        assert result == (({"all_reduce": 2}, {"all_reduce": (15 + 30) * 4}), {}), result


def errors_worker():
    group, _ = tp_group(2)
    ids, logits = torch.tensor([[0, 8]], device=device()), torch.randn(2, 3, 4, device=device())
    return error_messages([lambda: vp.VocabParallelEmbedding(11, 4, group=group),
                           lambda: vp.VocabParallelEmbedding(8, 4, group=group)(ids),
                           lambda: vp.vocab_parallel_cross_entropy(logits, ids.new_zeros(2, 4), group)])


def test_bad_vocabulary_sizes_ids_and_targets_raise_clear_errors_on_every_rank_without_blocking():
    assert_same_clear_errors(run(4, errors_worker), [
        "num_embeddings (vocabulary)=11 is not divisible by the parallel size 2",
        "token ids must lie in [0, 8)",
        "logits (2, 3, 4) and target (2, 4) must agree"])


def ids(shape):
    return torch.randint(0, 12, shape, device=device())


VOCAB_CASES = {  # name: (world, function of one input, shape on every rank but 1, shape on rank 1, output after)
    "embedding": (3, lambda: vp.VocabParallelEmbedding(12, 4, dtype=F64), (2, 3), (3, 2), (2, 3, 4), ids),
    "embedding SP": (2, lambda: vp.VocabParallelEmbedding(12, 4, sequence_parallel=True, dtype=F64), (2, 4),
                     (2, 6), (2, 2, 4), ids),
    # rank 1 holds 5 logits per token where the others hold 4: its max and sums would still all-reduce
    # (one number per token), and every target id from 4 up would be looked up in the wrong place
    "cross-entropy": (4, lambda: lambda z: vp.vocab_parallel_cross_entropy(z, torch.zeros(2, 3, dtype=torch.long,
                                                                                          device=device())),
                      (2, 3, 4), (2, 3, 5), (2, 3), lambda shape: torch.randn(shape, device=device(), dtype=F64)),
}


def vocab_disagreement_worker(case):
    _, build, good, bad, _, make = VOCAB_CASES[case]
    torch.manual_seed(0)
    return provoke(build(), good, bad, make)


def test_a_rank_whose_ids_or_logits_differ_in_shape_is_named_on_every_rank():
    for case, (world, _, good, bad, after, _) in VOCAB_CASES.items():
        name = "VocabParallelEmbedding" if "embedding" in case else "vocab_parallel_cross_entropy"
        assert_named_on_every_rank(run(world, vocab_disagreement_worker, case), name, good, bad, after)
