"""DDP's reducer (mini_dist/reducer.py): when each bucket's all-reduce starts (during backward, bucket 0 before
the last bucket has its gradients). Which gradients share a bucket, and the timeline: tests/test_buckets.py;
what the reducer computes, against native DDP: tests/test_ddp.py."""
import pytest
import torch
import torch.distributed as dist

from harness import device, run
from mini_dist import ddp
from mini_dist.ring_pipelined import ring_all_reduce
from test_ddp import F64, Net, trainable_bytes


def launch_order(widths, collective):
    model = Net(widths)
    all_reduce = ring_all_reduce if collective == "ring" else dist.all_reduce
    mini = ddp.DistributedDataParallel(model, bucket_cap_mb=trainable_bytes(model) / 4 / 2 ** 20,
                                       all_reduce=all_reduce)
    x = torch.randn(3, widths[0], dtype=F64, device=device())
    mini(x).square().sum().backward()
    t = mini.timeline
    return len(mini.buckets), t.start[0] < t.ready[-1], max(t.start) < t.backward_end


@pytest.mark.exercise
@pytest.mark.parametrize("world,collective", [(2, "native"), (3, "ring"), (5, "native")])
def test_all_reduces_start_during_backward_for_multi_bucket_models(world, collective):
    for rank, (n_buckets, first_before_last_ready, during) in enumerate(run(world, launch_order, [8] * 6,
                                                                            collective)):
        assert n_buckets >= 3
        # bucket 0 (the last layers) went out before the first layer's gradients existed
        assert first_before_last_ready, f"rank {rank}: bucket 0's all-reduce started after the last bucket filled"
        assert during, f"rank {rank}: an all-reduce started only after backward ended"
