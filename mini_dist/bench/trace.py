"""What recording a trace costs (mini_dist/kit/trace.py): the same call traced and untraced, in turns.

    ./run.sh bench 2 trace        (and ./run.sh bench 4 trace)

A trace records every message the wire posts (its peer, bytes, the k of the matching rule), every wait for
one and every collective: a few microseconds of Python per message. The worst case is a call that is all
messages and little data, the ring all-reduce of 4 KiB (2(N-1) steps of two messages each); at 1 MiB the
bytes dominate; a DDP step (bucketed, gloo's all-reduce, backward's spans and each bucket's marks) is what
a training loop pays. Untraced, the wire pays one `if` per call, which these rows cannot tell from noise:
"traced vs untraced" is the whole price of asking. Targets: within 1.5x on the 4 KiB ring, 1.2x at 1 MiB,
1.1x on the DDP step (a trace is for looking at a run, and should not change much what it shows). Measured on
the project's 2-core machine under load (November 2026), 2 ranks: 1.28x, 1.11-1.15x, 1.03-1.07x; 4 ranks:
1.23x, 1.20x, 1.07x. The ring pays about 0.1 ms a call on 2 ranks, more than the trace's own Python (about
25 us): a rank busy for longer between its messages lengthens each exchange.
"""
import torch
import torch.distributed as dist

from mini_dist import bench, ddp, ring_pipelined
from mini_dist.kit import launch, models, trace

REPEATS = 41


def traced(fn):
    """fn, with every rank recording a trace of the call (the records kept, as a run keeps them)."""
    def call():
        with trace.recording():
            fn()
    return call


def run_trace(args) -> list[bench.Result]:
    results = []
    for kib, target in ((4, 1.5), (1024, 1.2)):
        x = torch.zeros(kib << 8, device=launch.device())

        def ring(x=x):
            ring_pipelined.ring_all_reduce(x)
        results.append(bench.compare(f"ring all_reduce {kib} KiB, traced vs untraced", traced(ring), ring, REPEATS,
                                     target, note=f"{dist.get_world_size()} ranks"))
    model = models.mlp([256, 512, 512, 512, 16], torch.float32).to(launch.device())
    wrapped = ddp.DistributedDataParallel(model, bucket_cap_mb=0.25)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(64, 256, device=launch.device())

    def step():
        models.accumulation_step(wrapped, optimizer, [(x, x[:, :16])])
    results.append(bench.compare("DDP step (4 buckets), traced vs untraced", traced(step), step, REPEATS, 1.1,
                                 note="spans, bucket marks, all-reduce flights"))
    return results


BENCHES = {"trace": run_trace}
