"""PowerSGD step time against torch's powerSGD_hook, and what compression costs on one machine.

    ./run.sh bench 4 compression

An MLP (1024 -> 2048 -> 2048 -> 1024, fp32, 6.3M parameters) in one bucket, local batch 32, SGD; PowerSGD
rank 4 after two plain steps (the timed steps all compress). Rows: mini DDP + our hook against native DDP + torch's hook
(the whole step), then both hooks on native DDP (the hook alone), then native DDP with torch's hook against
plain native DDP: on 2 cores over loopback, bandwidth is cheap and the matmuls of compression are not, so
PowerSGD can cost more than it saves here; it pays where the network is the bottleneck.
"""
import copy

import torch

from mini_dist import bench
from mini_dist.compression import PowerSGDState, powerSGD_hook
from mini_dist.ddp import DistributedDataParallel
from mini_dist.kit import models
from mini_dist.kit.launch import device


# torch's powerSGD_hook issues the all-reduces of P and Q from callbacks on gloo's thread while the next
# bucket's hook issues its first all-reduce from the autograd thread: with several buckets, ranks can issue
# them in different orders (measured on gloo: "Received data size doesn't match", then a hang). One bucket
# for every side keeps torch's hook working; ours runs every bucket on one thread and has no such race.
ONE_BUCKET_MB = 1000


def _step(model, x, optimizer):
    def step():
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return step


def powersgd_step(args, widths=(1024, 2048, 2048, 1024), rank=4, repeats=9) -> list[bench.Result]:
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as native
    from torch.nn.parallel import DistributedDataParallel as NativeDDP
    base = models.linears(widths)
    x = torch.randn(32, widths[0], device=device())
    state = dict(matrix_approximation_rank=rank, start_powerSGD_iter=2)
    sides = {}
    for name, wrap, hook, make_state in [
            ("mini+ours", DistributedDataParallel, powerSGD_hook, PowerSGDState),
            ("native+ours", NativeDDP, powerSGD_hook, PowerSGDState),
            ("native+torch", NativeDDP, native.powerSGD_hook, native.PowerSGDState),
            ("native", NativeDDP, None, None)]:
        model = wrap(copy.deepcopy(base), bucket_cap_mb=ONE_BUCKET_MB)
        if hook is not None:
            model.register_comm_hook(make_state(None, **state), hook)
        step = _step(model, x, torch.optim.SGD(model.parameters(), lr=1e-3))
        for _ in range(3):  # the plain steps and the first compressed one (random Q) stay out of the timing
            step()
        sides[name] = step
    note = f"MLP {'-'.join(map(str, widths))} fp32, batch 32, r={rank}"
    return [bench.compare("PowerSGD step: mini DDP + our hook vs native DDP + torch's", sides["mini+ours"],
                          sides["native+torch"], repeats, target=1.3, note=note),
            bench.compare("PowerSGD step: our hook vs torch's, both on native DDP", sides["native+ours"],
                          sides["native+torch"], repeats, target=1.2, note=note),
            bench.compare("native DDP: torch's PowerSGD hook vs no hook", sides["native+torch"], sides["native"],
                          repeats, target=None, note=note + "; what compression costs on this machine")]


BENCHES = {"compression": powersgd_step}
