"""Pipeline parallelism against torch.distributed.pipelining: one training step, every schedule.

    ./run.sh bench 4 pipeline

A stack of Linear(h, h) + GELU layers (fp32), cut into P stages (P*v virtual stages for the interleaved
schedules), M = 2P microbatches, ours and torch's PipelineStage + schedule on the same chunks, in turns:
first the textbook loops (mini_dist/pipeline.py, GPipe and 1F1B), then the executor of every schedule
(mini_dist/pipeline_executor.py). Both run the same matmuls and send the same activations; what differs is
the bookkeeping: the textbook posts each step's send and receive as one batch and waits for it; the executor
agrees on the schedule once per step (an all-gather of four integers) and posts each send with the next
receive; torch posts its own batches of sends and receives. With 4 ranks on 2 cores the stages cannot
compute side by side, so these are the executors' costs, not the bubble (mini_dist/pipeline_bubble.py
measures the bubble on sleeping stages). The last row is the price of MINI_DIST_DEBUG=1 (a header checked
with every message). Many pairs a row: with few, a row moves from one run to the next more than the difference.
"""
import torch
import torch.distributed as dist
from torch import nn

from mini_dist import bench
from mini_dist.kit.launch import device
from mini_dist.kit.references import torch_step
from mini_dist.pipeline import STEPS
from mini_dist.pipeline_executor import pipeline_step
from mini_dist.pipeline_schedules import SCHEDULES, TORCH_SCHEDULES
from mini_dist.pipeline_stages import pipeline_chunks


def stack(P: int, v: int, h: int, batch: int) -> tuple:
    """2 Linear(h, h) + GELU per virtual stage, the same on every rank, this rank's chunks, and a batch."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(2 * P * v) for m in (nn.Linear(h, h), nn.GELU())]).to(device())
    x = torch.randn(batch, h, device=device())
    y = torch.randn(batch, h, device=device())
    return model, pipeline_chunks(model, None, v), x, y


def textbook(P: int, M: int, h: int, batch: int, repeats: int) -> list[bench.Result]:
    """The textbook GPipe and 1F1B loops against torch's ScheduleGPipe and Schedule1F1B."""
    results = []
    for name, (step, schedule) in STEPS.items():
        model, chunks, x, y = stack(P, 1, h, batch)
        native = torch_step(chunks, schedule, M, nn.MSELoss())

        def ours():
            step(chunks[0], x, y, nn.MSELoss(), M, (batch // M, h), torch.float32)

        def theirs():
            native(x, y)
        results.append(bench.compare(f"pipeline textbook {name} P={P} M={M}", ours, theirs, repeats, target=1.25,
                                     note=f"{len(model) // 2} x Linear({h}) + GELU, batch {batch}, fp32"))
    return results


def schedules(args, h=512, batch=128, repeats=31) -> list[bench.Result]:
    P = dist.get_world_size()
    M = 2 * P
    results = textbook(P, M, h, batch, repeats)
    for name in SCHEDULES:
        v = 2 if name == "interleaved" else 1
        model, chunks, x, y = stack(P, v, h, batch)
        plan = SCHEDULES[name](P, M, v)
        native = torch_step(chunks, TORCH_SCHEDULES[name], M, nn.MSELoss())

        def ours():
            pipeline_step(chunks, plan, x, y, nn.MSELoss(), trace=False)

        def theirs():
            native(x, y)
        shown = f"pipeline {name} P={P} M={M}" if v == 1 else f"pipeline {name} P={P} M={M} v={v}"
        results.append(bench.compare(shown, ours, theirs, repeats, target=1.25,
                                     note=f"{len(model) // 2} x Linear({h}) + GELU, batch {batch}, fp32"))
        if name == "1f1b":
            debug = bench.compare(f"pipeline {name}, debug on vs off", bench.with_debug(ours, True),
                                  bench.with_debug(ours, False), repeats, target=None,
                                  note="MINI_DIST_DEBUG=1: a header with every message")
    return results + [debug]


BENCHES = {"pipeline": schedules}
