"""mini_dist: how large models are trained across many devices, one small module per idea.

Each module is a concept (ring all-reduce, DDP, ZeRO, FSDP, tensor and pipeline parallelism, mixed
precision) built on raw torch.distributed point-to-point and collective calls, with a demo under
`torchrun` and property tests that compare it with PyTorch's own implementation.
"""
