"""What naming the rank that failed first costs when no rank fails (mini_dist/kit/fates.py, kit/wire.py).

    ./run.sh bench 4 naming

Nothing is added per message: a send or receive pays only once it has failed. A collective that a module
calls through wire.call (DDP's reducer, ZeRO, FSDP, the checkpoint) pays a loop over the wire's watchers and a
`with` that catches its error; against the same torch collective called bare, on a 4 KiB all-reduce (latency
bound: where a fixed cost shows most), 100 calls per timing. Once per process, setup opens one socket and
writes one key in the store (kit/fates.py's listen), before any step.
"""
import torch
import torch.distributed as dist

from mini_dist import bench
from mini_dist.kit import launch, wire

REPEATS = 21


def naming(args) -> list[bench.Result]:
    x = torch.ones(1024, device=launch.device())

    def named():
        for _ in range(100):
            wire.call(dist.all_reduce, x, group=None)

    def bare():
        for _ in range(100):
            dist.all_reduce(x)
    return [bench.compare("all_reduce of 4 KiB x100, through wire.call vs bare", named, bare, REPEATS, 1.1,
                          warmup=2)]


BENCHES = {"naming": naming}
