"""Questions learners ask about distributed training, each answered by a number measured on the spot.

Each entry below is one question: an answer in a few sentences, the demo that shows it in full, and a
measure that runs just the part of mini_dist's modules that settles it (seconds, not the whole demo) and
returns the figure it prints and whether that figure holds (the assertion the demo makes). A question
that needs several ranks runs on RANKS gloo ranks this module starts itself (forkserver, a free port, a
timeout on every collective and on every question: a rank that fails or hangs is reported, not waited for).

    python -m mini_dist.questions                 # list the questions
    python -m mini_dist.questions 7 14            # measure them; exit status 1 if a figure is off
    python -m mini_dist.questions --all           # measure every one
    python -m mini_dist.questions --markdown      # the page: question, answer, command, figure measured now
    ./run.sh ask [N ...]                          # the same, through run.sh

tests/test_questions.py runs every measure, so an answer's number cannot drift from the code.
"""
import atexit
import contextlib
import datetime
import math
import os
import shutil
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from multiprocessing import connection, get_context
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

if not __package__:  # run as `python mini_dist/questions.py`: put the repo, not mini_dist/, on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist import (activation_checkpoint, checkpoint, comm, compression, context_parallel, cost_model, ddp,
                       expert_parallel, fsdp_ledger, loss_scaling, mixed_precision, moe, parallel_transformer, pipeline,
                       pipeline_bubble, planner, reducer, reshard, sharded_state,
                       tensor_parallel, topology, ulysses, zero, zero_ledger)
from mini_dist.kit import debug, launch, models
from mini_dist import ring_allreduce
from mini_dist.ring_allreduce import LEDGER, ring_all_reduce

RANKS = 4                # the group every multi-rank question runs on
RANK_TIMEOUT_S = "30"    # each collective of a rank gives up after this
QUESTION_TIMEOUT_S = 90  # and a whole question after this
f64 = torch.float64


@dataclass(frozen=True)
class Question:
    number: int
    question: str
    answer: str
    command: str   # the demo that shows it in full
    measure: object  # () -> (figure, holds), run on every rank of a group of `ranks` (1: in this process)
    ranks: int = 1


QUESTIONS: dict[int, Question] = {}


def question(number: int, text: str, command: str, answer: str, ranks: int = 1):
    """Register the function below as the measure of question `number`."""
    def register(measure):
        QUESTIONS[number] = Question(number, text, " ".join(answer.split()), command, measure, ranks)
        return measure
    return register


def _max(x: float, op=dist.ReduceOp.MAX) -> float:
    """The largest of every rank's x (or another reduction): the figure rank 0 prints speaks for every rank."""
    t = torch.tensor([float(x)], dtype=f64, device=launch.device())
    dist.all_reduce(t, op=op)
    return t.item()


def _sum(x: float) -> float:
    return _max(x, dist.ReduceOp.SUM)


def _data(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """fp64 data on this rank's device, the same on every rank for the same seed."""
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed), dtype=f64).to(launch.device())


# ----------------------------------------------------------------------------- data parallelism

@question(1, "Why average gradients rather than parameters across replicas, and is the result exactly the "
          "full-batch gradient?", "./run.sh demo ddp 4", ranks=RANKS, answer="""
    A batch's loss is the mean of its samples' losses, so its gradient is the mean of the ranks' own mean
    gradients: one all-reduce that averages gradients gives every replica exactly the full-batch gradient (up to
    the order of the sums), and every replica then takes the same step (Li et al., PyTorch Distributed, 2020;
    torch.nn.parallel.DistributedDataParallel). Averaging parameters after each replica's own step agrees with it
    only for plain SGD, whose update is linear in the gradient; with momentum or Adam the average of the steps is
    another step.""")
def gradients_not_parameters():
    return ddp.gradients_vs_parameters()


@question(2, "What do buckets buy in DDP, and how much communication hides behind backward?",
          "./run.sh demo reducer 4", ranks=RANKS, answer="""
    An all-reduce costs a fixed latency plus a time per byte: one per gradient pays the latency once per
    parameter, one for the whole model cannot start before backward ends. DDP packs gradients into buckets (torch's
    bucket_cap_mb, 25 MiB) in reverse layer order, the order backward produces them, and starts each bucket's
    all-reduce the moment its last gradient lands, while backward computes the earlier layers. How much hides
    depends on how long backward computes per byte; the naive sync after backward hides nothing.""")
def buckets():
    return reducer.buckets_hide_communication()


@question(3, "How does gradient accumulation work without extra code, and why must the loss be divided by the "
          "number of steps?", "./run.sh demo ddp 4 --accumulation 4", ranks=RANKS, answer="""
    backward adds into .grad, it never overwrites it: K backward passes over K micro-batches leave the sum of
    their gradients. Each micro-batch's loss is a mean over its samples, so that sum is K times the gradient of the
    mean over all K*B samples: divide each loss by K (or the learning rate by K). Under DDP the first K-1 backward
    passes run inside no_sync(), so the ranks communicate once per optimizer step, not K times.""")
def accumulation():
    return ddp.accumulation_divides_the_loss()


@question(4, "What does each rank hold before and after all-reduce, reduce-scatter and all-gather?",
          "./run.sh demo ring_allreduce 4", ranks=RANKS, answer="""
    Before, rank r holds its own tensor x_r. After an all-reduce every rank holds the whole sum
    x_0 + ... + x_(N-1); after a reduce-scatter rank r holds only block r of that sum (1/N of it); an all-gather
    takes one block from each rank and gives every rank all of them, concatenated in rank order. These three, with
    all-to-all and point-to-point send and receive, are every pattern of communication in this repository
    (torch.distributed.all_reduce, reduce_scatter_tensor, all_gather_into_tensor).""")
def what_each_rank_holds():
    return ring_allreduce.what_each_rank_holds()


def _bytes_sent(fn, size: int, numel: int) -> tuple[float, float]:
    """fn(a tensor of numel fp32) on the first `size` ranks: (mean, largest) bytes one of them sent."""
    group = launch.new_group(range(size))  # every rank creates it; the others sit this one out
    LEDGER.reset()
    if dist.get_rank() < size:
        fn(torch.ones(numel, device=launch.device()), group=group)
    return _sum(LEDGER.sent) / size, _max(LEDGER.sent)


@question(5, "What does a ring all-reduce cost per rank, and why does it not grow with the number of ranks?",
          "./run.sh demo ring_allreduce 4", ranks=RANKS, answer="""
    In a ring each rank cuts its D bytes into N chunks and, in N-1 steps of reduce-scatter and N-1 of all-gather,
    sends one chunk per step to its neighbour: 2(N-1)/N * D bytes, which approaches 2D and never exceeds it however
    many ranks join (Patarasuk & Yuan 2009; Baidu's ring all-reduce, 2017). Every link is busy at every step, so
    the time is bandwidth-bound; what grows with N is the number of steps, 2(N-1) latencies. Sending everything to
    a root instead makes the root move (N-1)*D.""")
def ring_cost():
    return ring_allreduce.ring_bytes_per_rank()


@question(6, "Is all-reduce the same as reduce-scatter followed by all-gather (bytes and result)?",
          "./run.sh demo ring_allreduce 4", ranks=RANKS, answer="""
    Yes. A ring all-reduce is a reduce-scatter ((N-1)/N * D per rank) followed by an all-gather of the reduced
    blocks (another (N-1)/N * D), and run in the same chunk order the result is the same bit for bit. This identity
    is why ZeRO and FSDP can split DDP's all-reduce into its halves and put other work between them (Rajbhandari et
    al. 2020), and why sequence parallelism costs the same bytes as tensor parallelism (Korthikanti et al. 2022).""")
def all_reduce_is_two_halves():
    return ring_allreduce.all_reduce_is_reduce_scatter_plus_all_gather()


# ----------------------------------------------------------------------------- sharded data parallelism

@question(7, "What changes from ZeRO-1 to ZeRO-2 to ZeRO-3, in memory per rank and bytes per step?",
          "./run.sh demo zero_ledger 4", ranks=RANKS, answer="""
    ZeRO-1 shards the optimizer state over the K data-parallel ranks, ZeRO-2 the gradients too, ZeRO-3 (FSDP) the
    weights too (Rajbhandari et al. 2020). With fp32 Adam (4 + 4 + 8 bytes per parameter) that is 16N -> 8N + 8N/K
    -> 4N + 12N/K -> 16N/K per rank; the often-quoted 4N + 12N/K for ZeRO-1 is the mixed-precision count (2 + 2 +
    12 bytes), not fp32's. Bytes: ZeRO-2 sends exactly what DDP sends, not less (its reduce-scatter saves half the
    all-reduce, the all-gather of the updated weights spends it again); ZeRO-1 as built here all-reduces the
    gradients and then gathers the weights, 1.5x (DeepSpeed's reduce-scatters: 1x); ZeRO-3 gathers every weight
    twice, 1.5x.""")
def zero_stages():
    return zero_ledger.stages_memory_and_traffic()


@question(8, "Why does FSDP gather the same parameters twice per step, and what would go wrong without the "
          "second gather?", "./run.sh demo fsdp_ledger 4", ranks=RANKS, answer="""
    FSDP (Zhao et al. 2023; torch.distributed.fsdp.fully_shard) keeps a 1/K shard of each unit and all-gathers the
    unit just before its forward, then frees it, so about one unit is whole at a time. Backward needs those weights
    again (dL/dx = dL/dy W), so it gathers them a second time. Without the second gather the freed weights would
    simply be missing in backward; the alternative is to keep every unit after forward (reshard_after_forward=False
    in torch): one gather less, but at the turn from forward to backward the whole model is alive on every rank,
    which is the memory FSDP exists to save.""")
def fsdp_gathers_twice():
    return fsdp_ledger.gathers_twice()


@question(9, "How does FSDP's traffic compare with DDP's (about 1.5x), and where does the extra half come from?",
          "./run.sh demo fsdp_ledger 4", ranks=RANKS, answer="""
    DDP's ring all-reduce of the gradients is a reduce-scatter plus an all-gather: 2(K-1)/K of the model's bytes
    per rank. FSDP keeps the reduce-scatter of the gradients and, instead of gathering gradients, gathers weights,
    once for forward and once more for backward: 3(K-1)/K, 1.5x DDP. The extra half is the backward re-gather, the
    price of never holding the whole model; prefetching the next unit hides it behind compute but does not remove
    it.""")
def fsdp_traffic():
    return fsdp_ledger.traffic_vs_ddp()


# ----------------------------------------------------------------------------- tensor and sequence parallelism

@question(10, "When is tensor parallelism the right choice, and why does it want the fastest links?",
          "./run.sh demo tensor_parallel 4", ranks=RANKS, answer="""
    Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) cuts every weight matrix, so it divides a layer's
    weights, its compute and most of its activations by T: the choice when one layer's weights or activations do
    not fit, or when the batch per GPU is already small. Its price is communication inside every layer: an
    all-reduce of the layer's activations, b*s*h numbers, forward and backward, and the next matmul waits for it.
    Those bytes grow with the tokens, not with the parameters, and sit on the critical path, so TP stays inside a
    node, on NVLink, typically T <= 8.""")
def tensor_parallel_traffic():
    return tensor_parallel.tensor_parallel_traffic()


@question(11, "What are Megatron's f and g, and how many all-reduces does a transformer layer cost forward and "
          "backward?", "./run.sh demo parallel_transformer 4", ranks=RANKS, answer="""
    f is identity forward and all-reduce backward: it sits before a column-parallel layer, where every rank needs
    all of x and ends up holding only a partial gradient of it. g is its mirror, an all-reduce forward of a
    row-parallel layer's partial sums and identity backward (Shoeybi et al. 2019; mini_dist/comm.py). Attention
    (Q, K, V cut by heads, output projection cut by rows) and the MLP (column, GeLU, row) each need one f and one
    g, so a transformer layer costs 2 all-reduces forward and 2 backward, each of one b*s*h activation.""")
def f_and_g():
    return parallel_transformer.all_reduces_per_layer(parallel_transformer.block_three_ways(2, 8, 32, 4))


@question(12, "What does sequence parallelism save, and what does it cost in collectives?",
          "./run.sh demo parallel_transformer 4", ranks=RANKS, answer="""
    Under plain tensor parallelism the layer norms, dropouts and residuals run on the whole sequence on every
    rank, so their activations are replicated T times. Sequence parallelism (Korthikanti et al. 2022) cuts them
    along the sequence and splits each all-reduce into its halves: a reduce-scatter after a row-parallel layer, an
    all-gather before a column-parallel one. The same bytes travel (a ring all-reduce is a reduce-scatter plus an
    all-gather), plus one all-gather per column layer again in backward, since the input is gathered again rather
    than kept whole; in return every activation of the layer is 1/T per rank.""")
def sequence_parallel():
    return parallel_transformer.sequence_parallel_savings(parallel_transformer.block_three_ways(2, 16, 32, 4))


# ----------------------------------------------------------------------------- pipeline parallelism

@question(13, "What flows between pipeline stages, and in which pattern?", "./run.sh demo pipeline 4",
          ranks=RANKS, answer="""
    Only neighbours talk: stage s sends each microbatch's output activation to stage s+1 and gets the gradient of
    that output back from it, point to point (isend/irecv), M of each per step. The schedule decides the order,
    and two neighbours must post matching sends and receives in the same order or both wait forever, which is why
    schedules are best written as data and checked before they run (ShallowSpeed; torch.distributed.pipelining).
    A middle stage sends M activations forward and M gradients back, an end stage half of that.""")
def pipeline_flow():
    return pipeline.what_flows_between_stages()


@question(14, "GPipe vs 1F1B: same bubble, different what?", "./run.sh demo pipeline_bubble 4 --schedules gpipe 1f1b",
          answer="""
    The often-repeated claim that 1F1B has a smaller bubble is wrong: with uniform stages both leave ranks idle for
    (P-1)/(M+P-1) of the step (Huang et al. 2019; Narayanan et al. 2021). What 1F1B changes is memory: GPipe runs
    all M forwards before any backward, so every stage keeps the activations of M microbatches, while 1F1B starts
    each backward as early as it can and stage r never keeps more than P-r. That is what lets you raise M, and
    raising M is what shrinks the bubble.""")
def gpipe_vs_1f1b():
    return pipeline_bubble.gpipe_vs_1f1b()


@question(15, "How much do interleaving and zero-bubble schedules shrink the bubble?",
          "./run.sh demo pipeline_bubble 4", answer="""
    Interleaved 1F1B (Narayanan et al. 2021) gives each rank v model chunks, so filling and draining the pipe take
    v times less: (P-1)/(v*M+P-1), paid with v times the messages. Zero bubble (Qi et al. 2023) splits each backward
    into B, the input's gradient that the previous stage waits for, and W, the weights' gradient that nobody waits
    for, and fills the drain with the deferred W's: ZB-H1 reaches (P-1)/(3M+P-1) when F = B = W, with 1F1B's
    peak memory.""")
def interleaved_and_zero_bubble():
    return pipeline_bubble.interleaved_and_zero_bubble()


# ----------------------------------------------------------------------------- sequences and experts

@question(16, "What are context parallelism and Ulysses for, and how can attention run when no rank holds the "
          "whole sequence?", "./run.sh demo ulysses 4", ranks=RANKS, answer="""
    They are for sequences whose activations do not fit one GPU: each of C ranks holds S/C tokens. Ring attention
    (Liu et al. 2023; torch's context_parallel) leaves the queries in place and passes K/V blocks round the ring;
    each block gives a partial attention and its log-sum-exp, merged online as FlashAttention merges tiles, so no
    rank ever holds the S x S scores. DeepSpeed-Ulysses (Jacobs et al. 2023) all-to-alls the tokens into whole heads
    instead: fewer bytes, but C can never exceed the number of heads. Under a causal mask a zigzag layout gives
    every rank the same work.""")
def context_parallel_attention():
    return ulysses.ring_vs_ulysses()


@question(17, "What does expert parallelism send, and why do bad routers make stragglers?",
          "./run.sh demo expert_parallel 4", ranks=RANKS, answer="""
    Each of W ranks holds E/W experts, and every token goes to its top-k experts: its rows travel to those experts'
    ranks by an all-to-all with uneven splits and come back by the reverse one, forward and again backward (GShard,
    Lepikhin et al. 2020; Megatron-LM's MoE). A router that sends most tokens to a few experts makes the ranks
    holding them compute longest, and the returning all-to-all waits for them; capacity limits drop the excess
    tokens, and Switch's auxiliary loss (Fedus et al. 2021) pushes the router toward balance.""")
def expert_parallel_traffic():
    return expert_parallel.traffic_and_stragglers()


# ----------------------------------------------------------------------------- memory and precision

@question(18, "What does activation checkpointing save and cost, and why sqrt(L) segments?",
          "./run.sh demo activation_checkpoint 1", answer="""
    Backward needs tensors from forward; checkpointing a segment keeps only its input and recomputes the rest
    during backward (Chen et al. 2016; torch.utils.checkpoint). Checkpointing every layer keeps one input per layer
    and costs one more forward, 4/3 of the step's compute when backward costs two forwards. With L layers in k
    segments a rank holds k inputs plus the L/k layers being recomputed, k*I + (L/k)*A, least at
    k = sqrt(L*A/I): sqrt(L) when a layer keeps about as much as its input. A transformer layer keeps some 20
    times its input, so checkpointing every layer is close to the best there, which is what Megatron-LM does.""")
def activation_checkpointing():
    return activation_checkpoint.memory_and_compute()


@question(19, "fp16 training produces NaN: overflow or underflow, and how does loss scaling fix it? Why does bf16 "
          "not need it?", "./run.sh demo loss_scaling 4", answer="""
    NaN comes from overflow: past 65504 fp16 rounds to inf, and inf - inf or 0 * inf is NaN. Underflow is the
    silent failure: gradients below 6e-8 become 0 and training stalls. Loss scaling (Micikevicius et al. 2018;
    torch.amp.GradScaler) multiplies the loss by S so that every gradient is S times larger and clear of the
    underflow zone, divides by S in fp32 before the step, and skips the step and halves S whenever an inf or NaN
    appears (under ZeRO or FSDP every rank must agree on that skip). bf16 has fp32's 8 exponent bits, hence fp32's
    range: nothing to scale.""")
def overflow_or_underflow():
    return loss_scaling.overflow_or_underflow()


@question(20, "Why keep fp32 master weights when computing in fp16?", "./run.sh demo mixed_precision 1", answer="""
    An update w - lr*g only lands if it is larger than half the spacing between neighbouring numbers near w:
    fp16's spacing at 1.0 is 2^-10 (about 1e-3), bf16's 2^-7. Updates smaller than that round away and the weights
    stop moving, so the optimizer steps an fp32 copy, where small updates accumulate, and the model computes with
    that copy rounded to half after each step (Micikevicius et al. 2018; the master copy of FSDP's
    MixedPrecisionPolicy and apex's O2).""")
def master_weights():
    return mixed_precision.master_weights_vs_half()


@question(21, "How much memory does training a 7B model with Adam in mixed precision need, and what fits on one "
          "80 GB GPU?", "./run.sh demo planner", answer="""
    The model states alone take 16 bytes per parameter: 2 for bf16 weights, 2 for their gradients, 12 for the fp32
    master weights and Adam's two moments (Rajbhandari et al. 2020). That is 112 GB for 7B parameters before a
    single activation, so 7B does not fit one 80 GB GPU; about 5B would, with nothing left for activations.
    Sharding the states fixes it (fully sharded over 8 GPUs, 14 GB each); mini_dist's planner tries the simplest
    plans first and picks the first that fits with its traffic hidden behind compute.""")
def seven_billion():
    return planner.memory_for_7b()


# ----------------------------------------------------------------------------- the cluster

@question(22, "What do the hierarchical all-reduce and a slow inter-node link teach about placement?",
          "./run.sh demo topology 4 --ranks-per-node 2", ranks=RANKS, answer="""
    A step of a ring lasts as long as its slowest message, and in a ring across nodes some rank sends every one of
    its chunks over the slow network. The hierarchical all-reduce (reduce-scatter inside each node, all-reduce of
    the 1/G shard across nodes, all-gather inside; NCCL's trees and Horovod's hierarchical mode play the same
    trick) sends the same bytes in all but only 1/G of them between nodes. The lesson for placement: keep the
    chatty traffic on the fast links, and let only the smallest share cross nodes.""")
def hierarchical():
    return topology.slow_link_bytes()


@question(23, "What does gradient compression save, and why does it need error feedback?",
          "./run.sh demo compression 4", ranks=RANKS, answer="""
    PowerSGD (Vogels et al. 2019; torch.distributed.algorithms.ddp_comm_hooks) sends a rank-r approximation P Q^T
    of each n x m gradient matrix, r(n + m) numbers instead of n*m; casting to fp16 merely halves the bytes. The
    compressor is biased: what it drops this step it drops again next step, so small steady directions of the
    gradient never get through. Error feedback adds what was not sent to the next step's gradient: nothing is lost,
    only delayed.""")
def powersgd():
    return compression.powersgd_with_and_without_error_feedback()


@question(24, "What does a recoverable sharded checkpoint require, and can it load on a different number of "
          "ranks?", "./run.sh demo reshard 4", ranks=RANKS, answer="""
    Every rank writes its own shard in parallel (to a temporary name, fsync, rename) and one rank writes the
    manifest last: a checkpoint without a manifest does not exist, so a crash in the middle of a save leaves the
    previous one intact. To resume the same run it must hold everything that decides the next step: parameters,
    optimizer state, the position in the data and the RNG states (mini_dist/recovery.py). Saved as boxes of global
    tensors (torch.distributed.checkpoint's chunks), it loads on any number of ranks and in any layout: each rank
    reads only the saved boxes that overlap its own.""")
def sharded_checkpoint():
    K, r = dist.get_world_size(), dist.get_rank()

    def zero_adam(seed, stage, group=None):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(8, 24), nn.Tanh(), nn.Linear(24, 8)).double()
        return model, zero.ZeroOptimizer(model.named_parameters(), torch.optim.Adam, stage, group, lr=0.01)
    model, opt = zero_adam(0, 1)
    models.random_batch_steps(model, model, opt, 2)
    where = [tempfile.mkdtemp(prefix="mini_dist_questions_") if r == 0 else None]
    dist.broadcast_object_list(where)
    path, half = os.path.join(where[0], "step_2"), launch.new_group(range(K // 2))
    try:
        checkpoint.save(reshard.zero_state(opt), path)  # if it fails, it fails on every rank
        files = sorted(os.listdir(path))
        sizes = [os.path.getsize(os.path.join(path, f)) for f in files]
        saved = sharded_state.consolidated_state_dict(opt, to=None)
        same, problem = True, None
        if r < K // 2:  # ZeRO-2 on half the ranks, from another initialisation
            try:
                model2, opt2 = zero_adam(1, 2, half)
                reshard.load_zero_state(path, opt2, half)
                again = sharded_state.consolidated_state_dict(opt2, to=None)
                same = all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters())) and all(
                    torch.equal(again["state"][i][k], v) for i, st in saved["state"].items() for k, v in st.items())
            except Exception as e:  # noqa: BLE001  said on every rank: the other half must not wait for it
                problem = f"rank {r}: {type(e).__name__}: {e}"
        everyone = [None] * K
        dist.all_gather_object(everyone, (same, problem))
        if any(p for _, p in everyone):
            raise RuntimeError("; ".join(p for _, p in everyone if p))
        same = all(s for s, _ in everyone)
        dist.barrier()
        if r == 0:
            os.remove(os.path.join(path, checkpoint.MANIFEST))
        dist.barrier()
        try:
            checkpoint.load(reshard.zero_state(opt), path)
            refused = False
        except checkpoint.CheckpointError:
            refused = True
    finally:
        if r == 0:
            shutil.rmtree(where[0], ignore_errors=True)
    return (f"ZeRO-1 with Adam on {K} ranks saved {', '.join(f'{f} {s:,} B' for f, s in zip(files, sizes))} (the "
            f"manifest written last); loaded as ZeRO-2 on {K // 2} ranks: parameters and Adam state bit for bit: "
            f"{same}; with the manifest gone, the load is refused on every rank: {refused}"), \
        same and refused and len(files) == K + 1 and checkpoint.MANIFEST in files


@question(25, "Why does global batch size matter when adding ranks, and what does it change?",
          "./run.sh demo ddp 4", ranks=RANKS, answer="""
    The optimizer sees the global batch, local batch x ranks x accumulation steps: N ranks with B/N samples each
    take exactly the step one process takes with B. Adding ranks at a fixed local batch therefore grows the global
    batch: each step's gradient is less noisy (its variance falls as 1/B) and an epoch takes fewer steps, so the
    learning rate has to follow, e.g. the linear scaling rule with warm-up (Goyal et al. 2017), and past a critical
    batch size a larger batch stops paying for itself (McCandlish et al. 2018).""")
def global_batch():
    return ddp.global_batch()


@question(26, "Adding GPUs stopped speeding training up: what are the usual culprits, and what does Amdahl's law "
          "cap?", "./run.sh demo planner --params 7B --serial 0.05", answer="""
    At a fixed global batch each added GPU gets less to compute, but its share of communication does not shrink: a
    ring all-reduce still sends 2(N-1)/N of the gradients per rank, so communication takes a growing share of the
    step until backward can no longer hide it. The other usual culprits: a batch per GPU too small to keep it busy,
    pipeline bubbles, stragglers (a slow node, unbalanced experts), and data loading. Amdahl (1967): if a fraction
    f of the step cannot be split, the speed-up never exceeds 1/f, 20x for f = 5%.""")
def scaling_stops():
    return planner.scaling_stops()


@question(27, "How do data, tensor, pipeline, context and expert parallelism combine, and which axis goes "
          "innermost?", "./run.sh demo train_5d 8 --dp 2 --pp 2 --tp 2", ranks=RANKS, answer="""
    They multiply: the world is a dp x pp x cp x tp grid of ranks, each rank in one group per axis, and expert
    parallelism reuses the ranks of dp x cp (torchtitan, Megatron-LM). The axis that talks most often, and cannot
    overlap its talk with compute, goes innermost on the fastest links: TP (activations in every layer), then CP
    (K/V blocks in every layer, to a neighbour), then PP (one activation per microbatch), and DP outermost (one
    gradient reduction per step, hidden behind backward). However they are combined, the result must equal one
    process on the whole batch.""")
def five_axes():
    from mini_dist import train_5d  # here: the other answers do not need it to import
    return train_5d.five_axes()


@question(28, "What fails in multi-node training, and how does a job notice a dead or disagreeing rank?",
          "./run.sh demo kit/debug 3", ranks=RANKS, answer="""
    A rank can die (a lost GPU, an out-of-memory, a preempted node), hang, or call a collective with other shapes
    than its peers. The last is the most dangerous: with the same number of elements the sum runs and mixes
    unrelated data, silently. Agreeing before communicating (TORCH_DISTRIBUTED_DEBUG=DETAIL; MINI_DIST_DEBUG=1
    here) names the rank at fault; a timeout on every process group turns a dead peer into an error instead of a
    hang, gloo's monitored_barrier names the ranks that never arrived, and torchrun restarts the group from the last
    complete checkpoint (mini_dist/recovery.py).""")
def disagreeing_rank():
    n, r, dev = dist.get_world_size(), dist.get_rank(), launch.device()
    shape = (3, 2, 6) if r == 1 else (2, 3, 6)  # [batch, seq, hidden]: the same number of tokens
    b, t = torch.meshgrid(torch.arange(shape[0]), torch.arange(shape[1]), indexing="ij")
    x = (10.0 * b + t).unsqueeze(-1).expand(shape).to(dev)  # token (b, t) holds 10b + t on every rank
    before, named = debug.DEBUG, ""
    try:
        debug.DEBUG = False
        silent = comm.g(x)
        debug.DEBUG = True
        try:
            comm.g(x)
        except debug.Disagreement as e:
            named = str(e)
    finally:
        debug.DEBUG = before
    wrong = (silent != n * x).any(-1).nonzero()
    at = tuple(wrong[0].tolist()) if len(wrong) else (0, 0)
    # the last rank never arrives (dead, or hung): a barrier with a timeout names it instead of waiting forever
    group, missing = dist.new_group(list(range(n)), timeout=datetime.timedelta(seconds=1), backend="gloo"), ""
    if r < n - 1:
        with open(os.devnull, "w") as quiet, contextlib.redirect_stderr(quiet), _fd2_to(quiet):
            try:
                dist.monitored_barrier(group, timeout=datetime.timedelta(seconds=1), wait_all_ranks=True)
            except RuntimeError as e:
                missing = str(e).split("]: ")[-1]
    dist.barrier()
    found = "rank 1 calls" in named and "(3, 2, 6)" in named and (r > 0 or f"Ranks {n - 1} failed" in missing)
    return (f"rank 1 passes its tokens as [3, 2, 6], the others as [2, 3, 6]: unchecked, the all-reduce runs and "
            f"rank 0's token {at} reads {silent[at][0].item():g} instead of {n * x[at][0].item():g}; checked "
            f"(MINI_DIST_DEBUG=1), every rank raises a Disagreement naming rank 1 and both shapes; rank {n - 1} never "
            f"reaching a barrier with a 1 s timeout: rank 0 raises '{missing}'"), \
        len(wrong) > 0 and _max(not found) == 0


@contextlib.contextmanager
def _fd2_to(file):
    """gloo logs its errors from C++ straight to file descriptor 2: point it at `file` for a while."""
    saved = os.dup(2)
    os.dup2(file.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


# ----------------------------------------------------------------------------- running them

def measure(number: int) -> tuple[str, bool]:
    """Question `number`'s figure and whether it holds, on this rank (every rank of its group calls this)."""
    figure, holds = QUESTIONS[number].measure()
    return figure, bool(holds)


def combine(replies: list) -> tuple[str, bool]:
    """Every rank's (figure, holds) -> rank 0's figure, and whether it held on every rank."""
    return replies[0][0], all(holds for _, holds in replies)


def _rank(rank: int, world: int, port: int, conn) -> None:
    """A rank of the pool: join the group, then measure each question number it is sent (None: leave)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), MINI_DIST_TIMEOUT=RANK_TIMEOUT_S)
    torch.set_num_threads(1)  # RANKS ranks on a few cores: intra-op threads would only fight each other
    launch.setup(os.environ.get("MINI_DIST_BACKEND", "gloo"))
    while (number := conn.recv()) is not None:
        try:
            conn.send(("ok", measure(number)))
        except Exception as e:  # noqa: BLE001  every failure is reported, named by its rank
            conn.send(("error", f"rank {rank}: {type(e).__name__}: {e}"))
    launch.shutdown()


class Ranks:
    """RANKS processes in one group, started on the first question that needs them and kept for the next;
    a question that fails or runs past QUESTION_TIMEOUT_S ends them (the next question starts a fresh group)."""

    def __init__(self, world: int = RANKS):
        self.world, self.procs, self.conns = world, [], []

    def ask(self, number: int) -> list:
        if not self.procs:
            context = get_context("forkserver")  # one server imports torch once; the ranks fork from it
            context.set_forkserver_preload(["torch", "torch.distributed", "mini_dist.questions"])
            port = launch.free_port()
            for rank in range(self.world):
                mine, theirs = context.Pipe()
                self.procs.append(context.Process(target=_rank, args=(rank, self.world, port, theirs), daemon=True))
                self.procs[-1].start()
                self.conns.append(mine)
        for conn in self.conns:
            conn.send(number)
        replies, deadline = {}, time.monotonic() + QUESTION_TIMEOUT_S
        while len(replies) < self.world and time.monotonic() < deadline:
            waiting = {c: r for r, c in enumerate(self.conns) if r not in replies}
            waiting.update({self.procs[r].sentinel: r for r in waiting.values()})
            for ready in connection.wait(list(waiting), deadline - time.monotonic()):
                rank = waiting[ready]
                try:
                    replies[rank] = self.conns[rank].recv()
                except (EOFError, OSError):
                    replies[rank] = ("error", f"rank {rank} died (exit code {self.procs[rank].exitcode})")
        problems = [value for kind, value in replies.values() if kind != "ok"]
        problems += [f"rank {r}: no answer after {QUESTION_TIMEOUT_S} s" for r in range(self.world) if r not in replies]
        if problems:
            self.stop(graceful=False)
            raise RuntimeError("; ".join(problems))
        return [replies[r][1] for r in range(self.world)]

    def stop(self, graceful: bool = True) -> None:
        for conn in self.conns if graceful else ():
            with contextlib.suppress(OSError):
                conn.send(None)
        for p in self.procs:
            p.join(timeout=10 if graceful else 0)
            if p.is_alive():
                p.kill()
                p.join()
        self.procs, self.conns = [], []


def ask(number: int, ranks: Ranks) -> tuple[str, bool]:
    """Measure question `number`: in this process, or on the ranks. A failure is a figure that does not hold."""
    q = QUESTIONS[number]
    try:
        return combine(ranks.ask(number)) if q.ranks > 1 else measure(number)
    except Exception as e:  # noqa: BLE001
        return f"could not measure: {type(e).__name__}: {e}", False


def wrap(text: str, indent: str = "   ") -> str:
    return textwrap.fill(text, 112, initial_indent=indent, subsequent_indent=indent)


def page(figures: dict) -> str:
    """The markdown page: every question in `figures` ({number: figure}) with its answer and command."""
    escape = lambda s: s.replace("*", r"\*").replace("_", r"\_").replace("<", "&lt;")  # noqa: E731
    out = ["## Questions answered by measurement", "",
           "Each question below has a short answer and the figure that settles it. The figures were measured by "
           "running the modules' own functions when this page was made (`python -m mini_dist.questions "
           f"--markdown`, {RANKS} gloo ranks on the CPU); `./run.sh ask N` measures question N again in seconds, "
           "and the demo named with it shows the whole story.", ""]
    for number, figure in sorted(figures.items()):
        q = QUESTIONS[number]
        out += [f"### {number}. {q.question}", "", escape(q.answer), "",
                f"Shown in full by `{q.command}`. Measured (`./run.sh ask {number}`): {escape(figure)}", ""]
    return "\n".join(out)


def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("numbers", type=int, nargs="*", help="questions to measure (none: list them)")
    p.add_argument("--all", action="store_true", help="measure every question")
    p.add_argument("--markdown", action="store_true", help="measure, then print the page in markdown")
    return p


def demo(args) -> int:
    launch.require(launch.env_world_size() == 1, "run it as python -m mini_dist.questions (or ./run.sh ask): it "
                                                 f"starts its own {RANKS} ranks, not under torchrun")
    unknown = [n for n in args.numbers if n not in QUESTIONS]
    launch.require(not unknown, f"no question {', '.join(map(str, unknown))}: choose from 1 to {len(QUESTIONS)}")
    numbers = args.numbers or (sorted(QUESTIONS) if args.all or args.markdown else [])
    if not numbers:
        print("\n".join(f"{n:>3}. {q.question}" for n, q in QUESTIONS.items()))
        print(f"\n./run.sh ask N [N ...] measures the figure that answers question N ({RANKS} ranks where needed)")
        return 0
    ranks, figures, failed = Ranks(), {}, []
    atexit.register(ranks.stop)
    for n in numbers:
        q = QUESTIONS[n]
        figures[n], holds = ask(n, ranks)
        failed += [n] * (not holds)
        if not args.markdown:
            print(f"{n}. {q.question}\n{wrap(q.answer)}\n   shown in full by: {q.command}\n"
                  f"{wrap(('measured: ' if holds else 'OFF: ') + figures[n])}\n", flush=True)
    ranks.stop()
    if args.markdown:
        print(page(figures))
    if failed:
        print(f"figures off: questions {', '.join(map(str, failed))}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    # The ranks unpickle their functions from mini_dist.questions, imported by name. Without a __spec__ here,
    # multiprocessing prepares them from this file's path instead of re-running `-m mini_dist.questions` as
    # their __main__ (which runpy warns about: the module is already imported by then).
    __spec__ = None
    from mini_dist import questions
    raise SystemExit(launch.main(questions.parser(), questions.demo))
