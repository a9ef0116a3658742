"""Splitting the model: the figures that answer questions 10, 11 and 12 (mini_dist/questions/questions.md).

    10. When is tensor parallelism the right choice?         tensor_parallel_traffic    (tensor_parallel.py)
    11. Megatron's f and g, all-reduces per layer             all_reduces_per_layer      (parallel_transformer.py)
    12. What sequence parallelism saves and costs             sequence_parallel_savings  (parallel_transformer.py)

Each runs on every rank of its group and returns (figure, holds), as `./run.sh ask N` and
tests/test_questions.py call it; the measuring is the concepts' own (tensor_parallel.mlp_step_counted,
parallel_transformer.block_three_ways and its formulas), so a figure here cannot drift from its demo.
"""
import torch.distributed as dist

from mini_dist import parallel_transformer
from mini_dist.tensor_parallel import ParallelMLP, mlp_step_counted


def tensor_parallel_traffic(hidden=32, group=None) -> tuple[str, bool]:
    """Question 10, on every rank of `group`: a Megatron MLP's bytes per step grow with the tokens (2 x 8,
    then 4 x 8), where data parallelism would all-reduce the same gradient bytes whatever the batch."""
    T = dist.get_world_size(group)
    h = hidden
    fwd2, bwd2, diff2 = mlp_step_counted(ParallelMLP, 2, 8, h, group)
    fwd4, bwd4, diff4 = mlp_step_counted(ParallelMLP, 4, 8, h, group)
    payload2 = fwd2[1] + bwd2[1]
    payload4 = fwd4[1] + bwd4[1]
    calls = sum(fwd2[0].values()) + sum(bwd2[0].values())
    worst = max(diff2, diff4)
    grads = 8 * (8 * h * h + 5 * h)  # the dense MLP's fp64 gradients: two [4h, h] weights and their biases
    figure = (f"MLP {h} -> {4 * h} -> {h} on T = {T} (= dense to {worst:.0e}): {calls} all-reduces of activations "
              f"per step, payload {payload2:,} B at 2 x 8 tokens, {payload4:,} B at 4 x 8: TP's bytes grow with "
              f"the tokens, where data parallelism all-reduces this layer's {grads:,} B of gradients once per step "
              f"whatever the batch")
    return figure, worst < 1e-12 and payload4 == 2 * payload2 and calls == (2 if T > 1 else 0)


def all_reduces_per_layer(block=None) -> tuple[str, bool]:
    """Question 11: a transformer layer under TP all-reduces twice forward (g after attention, g after the MLP)
    and twice backward (f before each), one [b, s, h] activation each time."""
    block = block or parallel_transformer.block_three_ways()
    calls, nbytes = block.tp.fwd
    back_calls, _ = block.tp.bwd
    n = calls.get("all_reduce", 0)
    figure = (f"a block b={block.b} s={block.s} h={block.h} on T = {dist.get_world_size()} (= dense to "
              f"{block.tp.diff:.0e}): forward {n} all-reduces (g after attention, g after the MLP), backward "
              f"{back_calls.get('all_reduce', 0)} (f before each), {nbytes // max(n, 1):,} B = b*s*h*8 each")
    want_tp, _ = parallel_transformer.expected(block)
    return figure, block.tp.diff < 1e-12 and block.tp[:2] == want_tp[:2]


def _words(calls: dict) -> str:
    """{kind: calls} as words: '2 all-gather + 2 reduce-scatter'."""
    return " + ".join(f"{n} {kind.replace('_', '-')}" for kind, n in sorted(calls.items())) or "none"


def sequence_parallel_savings(block=None) -> tuple[str, bool]:
    """Question 12: SP keeps 1/T of every activation per rank, where TP keeps the layer norms' whole; its
    collectives are the all-reduces' halves, plus an all-gather per column layer again in backward."""
    block = block or parallel_transformer.block_three_ways()
    one = block.one
    tp = block.tp
    sp = block.sp
    worst = max(one.diff, tp.diff, sp.diff)
    figure = (f"a block b={block.b} s={block.s} h={block.h} on T = {dist.get_world_size()} (= dense to "
              f"{worst:.0e}): activations saved for backward per rank {one.acts:,} B alone, {tp.acts:,} B = "
              f"1/{one.acts / tp.acts:.2f} under TP, {sp.acts:,} B = 1/{one.acts / sp.acts:.2f} with SP; forward "
              f"TP {_words(tp.fwd[0])}, SP {_words(sp.fwd[0])} (same bytes on a ring); backward TP "
              f"{_words(tp.bwd[0])}, SP {_words(sp.bwd[0])}")
    want_tp, want_sp = parallel_transformer.expected(block)
    return figure, worst < 1e-12 and [tp[:3], sp[:3]] == [want_tp[:3], want_sp[:3]]
