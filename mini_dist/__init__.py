"""mini_dist: how large models are trained across many devices, one small module per idea.

Each module is a concept (ring all-reduce, DDP, ZeRO, FSDP, tensor and pipeline parallelism, mixed
precision) built on raw torch.distributed point-to-point and collective calls, with a demo under
`torchrun` and property tests that compare it with PyTorch's own implementation.
"""
import os as _os

# ./run.sh check MODULE: the learner's copy in exercises/ stands in for mini_dist/MODULE.py (see kit/exercise.py)
if _os.environ.get("MINI_DIST_EXERCISES"):
    __path__.insert(0, _os.environ["MINI_DIST_EXERCISES"])
    from mini_dist.kit.exercise import name_peers
    name_peers()  # a learner's blocking send / recv that times out names the rank it waited for
    del name_peers
