"""Expert parallelism: the all-to-all from isend/irecv against dist.all_to_all_single, alone and in the layer.

PyTorch has no MoE layer to compare with, so the native side is the same ExpertParallelMoE with
transport=comm.all_to_all_single: the difference is the transport only. Rows are fp32, splits uneven.
"""
import torch
import torch.distributed as dist

from mini_dist import bench, comm
from mini_dist.kit import launch
from mini_dist import expert_parallel as ep
from mini_dist.moe import MoE


def uneven_splits(W, rows, seed=0):
    """splits[i, j]: rows from rank i to rank j, between 0.5 and 1.5 times an even share (same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    return (rows / W * (0.5 + torch.rand(W, W, generator=g))).long()  # cpu: a table of counts, read by .tolist()


def all_to_all_rows(args) -> list[bench.Result]:
    W = dist.get_world_size()
    me = dist.get_rank()
    dev = launch.device()
    results = []
    for rows, h in [(512, 256), (4096, 1024)]:  # ~0.5 MiB and 16 MiB per rank
        splits = uneven_splits(W, rows)
        send = splits[me].tolist()
        recv = splits[:, me].tolist()
        x = torch.randn(sum(send), h, device=dev)
        out = x.new_empty((sum(recv), h))
        results.append(bench.compare(
            f"ep all-to-all ~{rows * h * 4 / 2 ** 20:g} MiB/rank", lambda: ep.p2p_all_to_all(out, x, recv, send),
            lambda: comm.all_to_all_single(out, x, recv, send), repeats=20, target=1.5,
            note="uneven splits, p2p vs dist.all_to_all_single"))
    return results


def moe_layer(args) -> list[bench.Result]:
    W = dist.get_world_size()
    dev = launch.device()
    h = 256
    E = 2 * W
    n = 1024 + 128 * dist.get_rank()  # uneven tokens per rank
    torch.manual_seed(0)
    dense = MoE(h, 2 * h, E, k=2, capacity_factor=1.25, device=dev)
    layers = {name: ep.shard_from_dense(ep.ExpertParallelMoE(h, 2 * h, E, 2, 1.25, transport=transport,
                                                             device=dev), dense)
              for name, transport in (("p2p", ep.p2p_all_to_all), ("native", comm.all_to_all_single))}
    x = torch.randn(n, h, device=dev)

    def step(layer):
        return lambda: layer(x).sum().backward()
    return [bench.compare(f"ep MoE layer fwd+bwd (E={E}, top-2, h={h})", step(layers["p2p"]), step(layers["native"]),
                          repeats=10, target=1.25, note="same layer, transport p2p vs all_to_all_single")]


BENCHES = {"ep_all_to_all": all_to_all_rows, "ep_layer": moe_layer}
