"""Tensor parallelism against torch.distributed.tensor.parallel: one MLP, forward + backward.

    ./run.sh bench 4 tensor_parallel

One MLP (h -> 4h -> h, fp32) on every rank of the world, cut two ways: mini_dist's ParallelMLP and PyTorch's
parallelize_module with ColwiseParallel + RowwiseParallel (DTensor), first plain (one all-reduce each way),
then with sequence parallelism (input Shard(1) in, output Shard(1) out: all-gather + reduce-scatter each
way). Both sides run the same matmuls and move the same bytes; what differs is the bookkeeping around them:
DTensor dispatches every op through its sharding propagation, we call F.linear and one collective.
Targets: plain TP <= 1.0x; TP + SP <= 1.3x, because our backward all-gathers each column layer's input again
where DTensor kept the gathered input: one more all-gather per step, the price of SP's 1/T activation memory.
The last row is the price of MINI_DIST_DEBUG=1 (every layer and collective first agrees on shapes).
"""
import copy

import torch
import torch.distributed as dist
import torch.nn as nn

from mini_dist import bench, comm
from mini_dist.kit.launch import device
from mini_dist.tensor_parallel import ParallelMLP
from mini_dist.tp_layout import shard_from_dense


def _step(module, x):
    return lambda: module(x).sum().backward()


def mlp(args, b=4, s=192, h=384, repeats=15) -> list[bench.Result]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    T, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh(device().type, (T,))
    torch.manual_seed(0)  # every rank: the same dense MLP and the same input
    dense = nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h)).to(device())
    x = torch.randn(b, s, h, device=device())
    results, ours_plain = [], None
    for sp in (False, True):
        layout = Shard(comm.SEQ) if sp else None  # None: DTensor's default, the whole sequence on every rank
        ours = shard_from_dense(ParallelMLP(h, sequence_parallel=sp, device=device()), dense)
        native = parallelize_module(copy.deepcopy(dense), mesh, {"0": ColwiseParallel(input_layouts=layout),
                                                                 "2": RowwiseParallel(output_layouts=layout)})
        xin = x.chunk(T, comm.SEQ)[rank].contiguous() if sp else x
        with torch.no_grad():  # both compute the dense MLP (on this rank's tokens under SP)
            want = dense(x).chunk(T, comm.SEQ)[rank] if sp else dense(x)
            error = max((ours(xin) - want).abs().max().item(), (native(xin) - want).abs().max().item())
        results.append(bench.compare(f"tensor_parallel MLP h={h} TP{'+SP' * sp}", _step(ours, xin),
                                     _step(native, xin), repeats, target=1.0 if not sp else 1.3,
                                     note=f"b={b} s={s} fp32, max |out - dense| {error:.0e}"))
        ours_plain = ours_plain or (ours, xin)
    results.append(bench.compare(f"tensor_parallel MLP h={h} TP, debug on vs off",
                                 bench.with_debug(_step(*ours_plain), True),
                                 bench.with_debug(_step(*ours_plain), False), repeats,
                                 target=None, note="MINI_DIST_DEBUG=1: a shape agreement per layer and collective"))
    return results


BENCHES = {"tensor_parallel": mlp}
