"""The kit: what every concept module may import, and nothing else of mini_dist's below it.

    launch   torchrun's environment -> a process group with a timeout; the demo command line
    debug    ranks that disagree (named before the collective runs) or vanish (named by their peers)
    measure  bytes saved for backward, activations alive over a step, a step's peak
    timing   wall-clock time of a distributed call, slowest rank, with its noise
    models   the toy models and training steps that demos, tests and benchmarks share
    ranks    long-lived pools of ranks that run one function everywhere (tests, ./run.sh ask)

A concept imports the kit and the concepts it builds on; never bench/, never another concept's demo.
"""
import torch.distributed as dist

if not hasattr(dist, "all_gather_single"):  # torch < 2.13 knows them as all_gather_into_tensor and
    dist.all_gather_single = dist.all_gather_into_tensor    # reduce_scatter_tensor: the same calls, older names
    dist.reduce_scatter_single = dist.reduce_scatter_tensor
