"""A run for tests/test_checkpoint.py: FSDP training in which one rank leaves quietly (sys.exit(0)) before
step --leave-at, while the others go on into the step's all-gather.

    torchrun --standalone --nproc_per_node=2 tests/leave_mid_fsdp.py --leave-at 3 --rank 1
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mini_dist.fsdp import FullyShardedDataParallel  # noqa: E402
from mini_dist.kit import launch  # noqa: E402
from mini_dist.kit.models import Block, block_stack, regression_step  # noqa: E402


def demo(args) -> int:
    env = launch.setup()
    model = FullyShardedDataParallel(block_stack(8, 16, 2, torch.float64, env.device), Block)
    adam = torch.optim.Adam(model.parameters(), lr=0.01)
    x = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(env.rank)).to(env.device)
    for step in range(1, 6):
        if step == args.leave_at and env.rank == args.rank:
            sys.exit(0)  # a rank that thinks it is done: status 0, no traceback, no word to the others
        regression_step(model, adam, x, x)
    return launch.conclude("leave_mid_fsdp", True, "trained", True, "")


if __name__ == "__main__":
    parser = launch.demo_parser(__doc__)
    parser.add_argument("--leave-at", type=int, default=3)
    parser.add_argument("--rank", type=int, default=1)
    raise SystemExit(launch.main(parser, demo))
