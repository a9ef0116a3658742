"""The references that demos and tests share: a concept's result beside PyTorch's, or beside one process.

    against_sdpa(attention, full, causal, split, sent)        attention on this rank's part of the sequence
                                                                vs F.scaled_dot_product_attention on all of it
    against_one_process(model, chunks, x, y, ours, theirs)    a pipeline step (ours, and torch's) vs the
                                                                whole model on the whole batch

A kit module imports no concept: the concept's functions come in as arguments (the attention, how a tensor
is cut into this rank's part, the step). Run by context_parallel.py, ulysses.py, pipeline.py and
pipeline_bubble.py, and by their tests.
"""
import torch
import torch.nn.functional as F
from torch import nn

from mini_dist.kit.wire import LEDGER


def against_sdpa(attention, full, causal: bool, split, sent) -> tuple:
    """attention(q, k, v, causal=causal) forward and backward on this rank's part of full = (q, k, v, dout)
    ([b, H, S, d], the same on every rank), cut by split(tensor): the largest |difference| from
    F.scaled_dot_product_attention on the whole sequence over out, dq, dk, dv; then sent(), the bytes this
    rank sent, read after forward and after backward (LEDGER reset before each)."""
    whole = [t.clone().requires_grad_() for t in full[:3]]
    ref = F.scaled_dot_product_attention(*whole, is_causal=causal)
    ref.backward(full[3])
    mine = [split(t).requires_grad_() for t in full[:3]]
    LEDGER.reset()
    out = attention(*mine, causal=causal)
    forward = sent()
    LEDGER.reset()
    out.backward(split(full[3]))
    pairs = zip([out] + [t.grad for t in mine], [ref.detach()] + [t.grad for t in whole])
    return max((a - split(b)).abs().max().item() for a, b in pairs), forward, sent()


def against_one_process(model: nn.Module, chunks: list, x: torch.Tensor, y: torch.Tensor, ours, theirs,
                        repeats: int = 1) -> tuple:
    """A pipeline's training step on this rank's `chunks` of `model`, MSE loss: ours(loss_fn, first) ->
    (the batch loss on the last stage, else None; its stats), `repeats` times, then theirs(loss_fn) -> the
    loss (torch's step) once. Returns the largest difference of loss and gradients from one process on the
    whole batch (x, y): ours (the worst of its repeats), theirs; and the stats of each of ours."""
    loss_fn = nn.MSELoss()
    full_loss = loss_fn(model(x), y)
    full_loss.backward()
    expected = {p: p.grad.clone() for p in model.parameters()}
    diffs = []
    stats = []
    for k in range(repeats + 1):
        model.zero_grad()
        loss, mine = ours(loss_fn, k == 0) if k < repeats else (theirs(loss_fn), None)
        diffs.append(max([0.0 if loss is None else abs(loss - full_loss).item()] +
                         [(p.grad - expected[p]).abs().max().item() for c in chunks for p in c.parameters()]))
        if mine is not None:
            stats.append(mine)
    return max(diffs[:-1]), diffs[-1], stats
