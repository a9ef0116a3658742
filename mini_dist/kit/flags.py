"""Command-line flags that several demos share, so that the same flag means the same thing in each of them.

    adam_check   --steps and --widths of an fp64 Adam run checked against PyTorch (zero, zero_optimizer)
    pipeline     --microbatches and --width of a pipeline step checked against one process (pipeline,
                 pipeline_executor); pipeline_ranks checks them and gives P, refused where torch refuses
    attention    --seq, --heads, --head-dim and --batch of an attention split over ranks (context_parallel,
                 ulysses); zigzag_ranks reads back C, the ranks, refused where the zigzag layout cannot cut --seq
    grid_5d      a 5D run: the mesh's degrees, experts, microbatches, schedule, ZeRO stage (train_5d, measure_5d)
    tokens       --batch, --seq and --hidden of the [b, s, h] activations a layer is split over (tensor_parallel,
                 vocab_parallel, parallel_transformer); token_sizes checks them and gives b, s, h
"""
import argparse

from mini_dist.kit import launch


def adam_check(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--steps", type=int, default=3, help="Adam steps of the equivalence check (fp64)")
    p.add_argument("--widths", type=int, nargs="+", default=[19, 60, 60],
                   help="MLP widths; the default's N = 4,860 divides by K = 1..5: no padding")
    return p


def pipeline(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--microbatches", type=int, default=8, help="M, microbatches per step (at least P)")
    p.add_argument("--width", type=int, default=24, help="features of every activation")
    return p


def pipeline_ranks(args) -> int:
    """P, the pipeline's ranks, once the flags are checked: --microbatches >= P, as torch's Schedule1F1B asks."""
    P = launch.env_world_size()
    launch.require(args.width >= 1, "--width must be at least 1")
    launch.require(args.microbatches >= P,
                   f"--microbatches must be at least the rank count, {P}: torch's Schedule1F1B refuses fewer")
    return P


def tokens(p: argparse.ArgumentParser, hidden: int, hidden_help: str = "h") -> argparse.ArgumentParser:
    p.add_argument("--batch", type=int, default=2, help="b, sequences per batch")
    p.add_argument("--seq", type=int, default=24, help="s, tokens per sequence")
    p.add_argument("--hidden", type=int, default=hidden, help=hidden_help)
    return p


def token_sizes(args) -> tuple[int, int, int]:
    """b, s and h, once each is checked: at least 1."""
    launch.require(min(args.batch, args.seq, args.hidden) >= 1, "--batch, --seq and --hidden must be at least 1")
    return args.batch, args.seq, args.hidden


def attention(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--seq", type=int, default=48, help="sequence length S (a multiple of 2C: zigzag's chunks)")
    p.add_argument("--heads", type=int, default=12, help="attention heads H (Ulysses: a multiple of C)")
    p.add_argument("--head-dim", type=int, default=16, help="head dimension d")
    p.add_argument("--batch", type=int, default=2, help="sequences in the batch")
    return p


def zigzag_ranks(args) -> int:
    """C, the ranks the sequence is split over: --seq a multiple of 2C, as the zigzag layout cuts it."""
    C = launch.env_world_size()
    launch.require(min(args.seq, args.heads, args.head_dim, args.batch) > 0, "sizes must be positive")
    launch.require(args.seq % (2 * C) == 0, f"--seq {args.seq} on {C} ranks: use a multiple of 2C = {2 * C} "
                                            f"(the zigzag layout cuts the sequence into 2C equal chunks)")
    return C


def grid_5d(p: argparse.ArgumentParser, schedules) -> argparse.ArgumentParser:
    for axis in ("dp", "pp", "cp", "tp"):
        p.add_argument(f"--{axis}", type=int, help=f"{axis} degree (default: tp 2, cp 1, pp 2 if the world allows, "
                                                   "dp the rest)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel ranks, a divisor of dp x cp (needs --moe)")
    p.add_argument("--moe", type=int, default=0, help="E experts per block, top-2 routing (0: an MLP)")
    p.add_argument("--microbatches", type=int, default=2, help="M per replica (the global batch: a multiple of dp x M)")
    p.add_argument("--schedule", choices=tuple(schedules), default="1f1b")
    p.add_argument("--chunks", type=int, default=1, help="model chunks per pipeline rank (interleaved)")
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0, help="0 DDP, 1-2 ZeRO, 3 FSDP on dp x cp")
    p.add_argument("--checkpoint", action="store_true", help="recompute each block in backward")
    return p
