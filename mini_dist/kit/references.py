"""The references that demos and tests share: a concept's result beside PyTorch's, or beside one process.

    against_sdpa(attention, full, causal, split, sent)        attention on this rank's part of the sequence
                                                                vs F.scaled_dot_product_attention on all of it
    against_one_process(model, chunks, x, y, ours, theirs)    a pipeline step (ours, and torch's) vs the
                                                                whole model on the whole batch
    torch_step(chunks, schedule, M, loss_fn, group, log)      torch.distributed.pipelining's step on the
                                                                same chunks: step(inputs, targets) -> loss
    torch_schedule(chunks, schedule, M, loss_fn, group, log)  its schedule (log: what it computes, in order)

A kit module imports no concept: the concept's functions come in as arguments (the attention, how a tensor
is cut into this rank's part, the step). Run by context_parallel.py, ulysses.py, the pipeline files and
their tests.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mini_dist.kit import launch
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


def torch_schedule(chunks: list, schedule: str, n_microbatches: int, loss_fn=None, group=None, log=None):
    """torch.distributed.pipelining's `schedule` (a class name: "ScheduleGPipe", "Schedule1F1B",
    "ScheduleInterleaved1F1B", ...) over this rank's chunks, chunk c being virtual stage c*P + rank; .step(...)
    runs it. With a list `log`, each computation it runs here is appended to it as (op, microbatch, chunk)."""
    from torch.distributed import pipelining
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti
    P = dist.get_world_size(group)
    r = dist.get_rank(group)
    stages = [pipelining.PipelineStage(chunk, c * P + r, P * len(chunks), launch.device(), group=group)
              for c, chunk in enumerate(chunks)]
    for c, stage in enumerate(stages if log is not None else ()):
        stage.forward_one_chunk = logged(stage.forward_one_chunk, "forward", c, log)
        stage.backward_one_chunk = logged(stage.backward_one_chunk, "backward", c, log)
        stage.backward_weight_one_chunk = logged(stage.backward_weight_one_chunk, "backward_weight", c, log)
    kind = getattr(pipelining, schedule)
    return kind(stages if issubclass(kind, PipelineScheduleMulti) else stages[0], n_microbatches, loss_fn)


def logged(method, op: str, chunk: int, log: list):
    """method, appending (op, microbatch, chunk) to log first; B alone is backward_one_chunk(full_backward=False)."""
    def run(mb, *args, **kwargs):
        log.append((op if kwargs.get("full_backward", True) else "backward_input", mb, chunk))
        return method(mb, *args, **kwargs)
    return run


def torch_step(chunks: list, schedule: str, n_microbatches: int, loss_fn, group=None, log=None):
    """torch's training step on these chunks: step(inputs, targets) -> the batch loss on the last stage, else None
    (inputs count on the first stage only, targets on the last). `log`: as torch_schedule's."""
    P = dist.get_world_size(group)
    r = dist.get_rank(group)
    runner = torch_schedule(chunks, schedule, n_microbatches, loss_fn, group, log)

    def step(inputs, targets):
        losses = []
        args = [inputs] if r == 0 else []
        kwargs = {"target": targets, "losses": losses} if r == P - 1 else {}
        runner.step(*args, **kwargs)
        return torch.stack(losses).mean() if losses else None
    return step
