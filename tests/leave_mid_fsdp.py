"""A run for tests/test_checkpoint.py and tests/test_dead_rank.py: FSDP training over 3 units (blocks) in which
one rank ends at step --leave-at, while the others go on into the step's collectives. --how: sys.exit(0) (a
rank that thinks it is done: status 0, no traceback), os._exit(0), SIGKILL or SIGSEGV (no exit handler runs),
or an exception; --unit: before the step (-1), or in the forward of that unit, mid-step.

    torchrun --standalone --nproc_per_node=2 tests/leave_mid_fsdp.py --leave-at 3 --rank 1
    torchrun --standalone --nproc_per_node=3 tests/leave_mid_fsdp.py --leave-at 2 --rank 2 --how os._exit --unit 1
"""
import os
import signal
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mini_dist.fsdp import FullyShardedDataParallel  # noqa: E402
from mini_dist.kit import launch  # noqa: E402
from mini_dist.kit.models import Block, block_stack, regression_step  # noqa: E402

WAYS = ("exit", "os._exit", "SIGKILL", "SIGSEGV", "raise")


def end(how: str) -> None:
    """End this rank the way `how` names."""
    if how == "exit":
        sys.exit(0)
    if how == "os._exit":
        os._exit(0)
    if how == "raise":
        raise ValueError("this rank fails on its own")
    os.kill(os.getpid(), getattr(signal, how))


def demo(args) -> int:
    env = launch.setup()
    model = FullyShardedDataParallel(block_stack(8, 16, 3, torch.float64, env.device), Block)
    adam = torch.optim.Adam(model.parameters(), lr=0.01)
    x = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(env.rank)).to(env.device)
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    for step in range(1, 6):
        if step == args.leave_at and env.rank == args.rank:
            if args.unit < 0:
                end(args.how)
            blocks[args.unit].register_forward_hook(lambda *_: end(args.how))
        regression_step(model, adam, x, x)
    return launch.conclude("leave_mid_fsdp", True, "trained", True, "")


if __name__ == "__main__":
    parser = launch.demo_parser(__doc__)
    parser.add_argument("--leave-at", type=int, default=3)
    parser.add_argument("--rank", type=int, default=1)
    parser.add_argument("--how", choices=WAYS, default="exit")
    parser.add_argument("--unit", type=int, default=-1, help="-1: before the step; else in that unit's forward")
    raise SystemExit(launch.main(parser, demo))
