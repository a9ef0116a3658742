"""mini_dist: how large models are trained across many devices, one small module per idea.

Each module is a concept (ring all-reduce, DDP, ZeRO, FSDP, tensor and pipeline parallelism, mixed
precision) built on raw torch.distributed point-to-point and collective calls, with a demo under
`torchrun` and property tests that compare it with PyTorch's own implementation.
"""
import os as _os

# ./run.sh check MODULE: the learner's exercises/MODULE.py stands in for mini_dist/MODULE.py, and only that
# module (kit/stand_in.py)
if _os.environ.get("MINI_DIST_EXERCISE"):
    from mini_dist.kit.stand_in import name_peers, stand_in
    stand_in(_os.environ["MINI_DIST_EXERCISE"])
    name_peers()  # a learner's blocking send / recv that times out names the rank it waited for
    del name_peers, stand_in
