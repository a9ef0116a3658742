"""Pipeline parallelism against torch.distributed.pipelining: one training step, every schedule.

    ./run.sh bench 4 pipeline

A stack of Linear(h, h) + GELU layers (fp32), cut into P stages (P*v virtual stages for the interleaved
schedules), M = 2P microbatches, our executor and torch's PipelineStage + schedule on the same chunks, in
turns. Both run the same matmuls and send the same activations; what differs is the bookkeeping: we agree
on the schedule once per step (an all-gather of four integers) and post each send with the next receive;
torch posts its own batches of sends and receives. With 4 ranks on 2 cores the stages cannot compute side
by side, so these are the executors' costs, not the bubble (mini_dist/pipeline_bubble.py measures the
bubble on sleeping stages). The last row is the price of MINI_DIST_DEBUG=1 (a header checked with every
message). Many pairs a row: with few, a row moves from one run to the next more than the difference.
"""
import torch
import torch.distributed as dist
from torch import nn

from mini_dist import bench
from mini_dist.kit.launch import device
from mini_dist.pipeline import pipeline_step, torch_step
from mini_dist.pipeline_schedules import SCHEDULES
from mini_dist.pipeline_stages import pipeline_chunks


def schedules(args, h=512, batch=128, repeats=31) -> list[bench.Result]:
    P, results = dist.get_world_size(), []
    M = 2 * P
    for name in SCHEDULES:
        v = 2 if name == "interleaved" else 1
        torch.manual_seed(0)  # every rank: the same model and batch
        model = nn.Sequential(*[m for _ in range(2 * P * v) for m in (nn.Linear(h, h), nn.GELU())]).to(device())
        chunks = pipeline_chunks(model, None, v)
        x, y = torch.randn(batch, h, device=device()), torch.randn(batch, h, device=device())
        plan, loss_fn, native = SCHEDULES[name](P, M, v), nn.MSELoss(), torch_step(chunks, name, M, nn.MSELoss())

        def ours():
            pipeline_step(chunks, plan, x, y, loss_fn, trace=False)
        results.append(bench.compare(f"pipeline {name} P={P} M={M}" + f" v={v}" * (v > 1), ours,
                                     lambda: native(x, y), repeats, target=1.25,
                                     note=f"{len(model) // 2} x Linear({h}) + GELU, batch {batch}, fp32"))
        if name == "1f1b":
            debug = bench.compare(f"pipeline {name}, debug on vs off", bench.with_debug(ours, True),
                                  bench.with_debug(ours, False), repeats, target=None,
                                  note="MINI_DIST_DEBUG=1: a header with every message")
    return results + [debug]


BENCHES = {"pipeline": schedules}
