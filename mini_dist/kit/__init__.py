"""The kit: what every concept module may import, and nothing else of mini_dist's below it.

    launch   torchrun's environment -> a process group with a timeout; the demo command line
    flags    command-line flags several demos share (an Adam check, a pipeline step, a 5D grid)
    wire     every message (send, receive, a batch of them), waited for, a lost peer named; the one byte
             ledger that messages and collectives are counted in
    debug    ranks that disagree (named before the collective runs) or vanish (named by their peers)
    fates    how each rank ended (raised, left, lost a peer, gone) and which one failed first
    measure  bytes saved for backward, activations alive over a step, a step's peak
    activations  a transformer layer that saves Korthikanti's count; checkpointing strategies measured side by side
    timing   wall-clock time of a distributed call, slowest rank, with its noise
    models   the toy models and training steps that demos, tests and benchmarks share
    references  a concept beside PyTorch or one process: attention vs SDPA, a pipeline step vs one process,
                torch.distributed.pipelining's step
    ranks    long-lived pools of ranks that run one function everywhere (tests, ./run.sh ask)
    weakly   a tensor hook that holds its owner (a DDP reducer, an FSDP wrapper) weakly

A concept imports the kit and the concepts it builds on; never bench/, never another concept's demo.
"""
import weakref

import torch.distributed as dist

if not hasattr(dist, "all_gather_single"):  # torch < 2.13 knows them as all_gather_into_tensor and
    dist.all_gather_single = dist.all_gather_into_tensor    # reduce_scatter_tensor: the same calls, older names
    dist.reduce_scatter_single = dist.reduce_scatter_tensor


def weakly(method, *args):
    """A hook calling method(*args, *hook_args) that holds the method's object and args only weakly. A tensor
    keeps its hooks in C++, where Python's garbage collector cannot see a cycle tensor -> hook -> owner ->
    tensor: a hook holding its owner strongly keeps it, its buckets and its process group until the process
    exits. Once any of them is gone, the hook does nothing."""
    refs = [weakref.WeakMethod(method), *map(weakref.ref, args)]

    def hook(*hook_args):
        alive = [r() for r in refs]
        return None if None in alive else alive[0](*alive[1:], *hook_args)
    return hook
