"""shard_from_dense and gather_to_dense move any layout of parameters (cut along a dim, cut part by part as a
stacked [q; k; v], whole) between a dense module and its parallel twin, bit for bit, on TP groups of 1-4 inside
pools of up to 5, and gather_to_dense puts each weight and gradient in the dense parameter's own dtype and
device, whatever its parallel twin's (a dense model on the CPU beside a model on GPUs; here fp64 into fp32,
which takes the same path). The layers' layouts are tested through the layers in test_tensor_parallel.py.
"""
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import device, run
from mini_dist import tp_layout
from test_tensor_parallel import seed_group, tp_group, worlds_and_sizes


def round_trip_worker(seed, T, h_k, dense_dtype):
    """A dense [q; k; v] + projection pair, sharded into its parallel twin, each shard's gradient set to the
    shard itself, then gathered into a blank dense pair of `dense_dtype`: (weight, gradient that came back, what
    both should be) for every parameter."""
    group, index = tp_group(T)
    if group is None:
        return None
    seed_group(seed, index)
    h = h_k * T
    dense = nn.Sequential(nn.Linear(h, 3 * h), nn.Linear(h, h)).to(device(), torch.float64)
    twin = tp_layout.shard_from_dense(tp_layout.ShardedPair(h, T, device()), dense, group)
    for p in twin.parameters():
        p.grad = p.detach().clone()
    blank = nn.Sequential(nn.Linear(h, 3 * h), nn.Linear(h, h)).to(device(), dense_dtype)
    back = tp_layout.gather_to_dense(twin, blank, group)
    return [(q.detach(), q.grad, p.detach()) for p, q in zip(dense.parameters(), back.parameters())]


@settings(max_examples=8)
@given(worlds_and_sizes, st.integers(1, 3), st.sampled_from([torch.float64, torch.float32]), st.integers(0, 2**16))
def test_dense_to_parallel_and_back_is_exact_for_weights_and_gradients_in_the_dense_dtype(T_world, h_k, dtype,
                                                                                         seed):
    T, world = T_world
    for pairs in run(world, round_trip_worker, seed, T, h_k, dtype):
        for got, grad, want in pairs or []:
            assert got.dtype == grad.dtype == dtype and got.device == grad.device, (got.dtype, grad)
            assert torch.equal(got, want.to(dtype)) and torch.equal(grad, want.to(dtype)), (T, got, grad, want)
