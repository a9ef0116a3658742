"""Bytes per parameter and per collective: the exercise's bank (kit/exercise.py); MISTAKES: tests/test_cost_model.py."""
from mini_dist.kit import exercise

HINTS = {
    "bytes_per_param": [
        "Count what torch keeps for one parameter after optimizer.step(): the weight, its .grad, and whatever the "
        "optimizer keeps beside it. Which of those are in the model's precision, and which in fp32?",
        "The weight and its .grad are in the precision's dtype. With 16-bit weights the optimizer steps an fp32 "
        "master copy (PRECISIONS' third size), and each of its state tensors (OPTIMIZERS: Adam keeps 2, momentum 1) "
        "has the master's dtype: 4 bytes, or the weight's size where that is wider (fp64).",
        "state = the master's bytes + the optimizer's state tensors x max(weight bytes, 4).",
    ],
    "model_state_bytes": [
        "A rank holds each of the three parts either whole (all numel elements) or as its shard of them: which parts "
        "does each ZeRO stage shard?",
        "Stage 1 shards the optimizer state, stage 2 the gradients too, stage 3 the weights too; a shard is "
        "shard(numel, k) elements (the last shard padded, so rounded up). Multiply each count by its size from "
        "bytes_per_param.",
    ],
    "collective_bytes": [
        "Pad the buffer to k equal chunks of ceil(numel/k) elements (shard(numel, k)). In a ring, how many steps does "
        "a reduce-scatter take, and how much does each rank send at each step?",
        "A phase (reduce-scatter or all-gather) is k-1 steps of one chunk each: (k-1) x shard(numel, k) x elem_size "
        "bytes. An all-reduce is both phases.",
    ],
}

RIGHT = {
    "a table of sizes; each part's shard decided by the first stage that shards it": {
        "bytes_per_param": """
            sizes = {"fp32": 4, "bf16": 2, "fp16": 2, "fp64": 8}
            weight = sizes[precision]
            master = 4 if weight < 4 else 0
            return weight, weight, master + OPTIMIZERS[optimizer] * max(weight, 4)
        """,
        "model_state_bytes": """
            sizes = bytes_per_param(precision, optimizer)
            sharded = [zero >= 3, zero >= 2, zero >= 1]
            return tuple(size * (shard(numel, k) if cut else numel) for size, cut in zip(sizes, sharded))
        """,
        "collective_bytes": """
            padded = k * shard(numel, k) * elem_size
            phase = (k - 1) * padded // k
            return 2 * phase if kind == "all_reduce" else phase
        """,
    },
    "torch's own element sizes, a branch per stage, ceil as (numel + k - 1) // k": {
        "bytes_per_param": """
            weight = DTYPES[precision].itemsize
            state = max(weight, torch.float32.itemsize)
            master = torch.float32.itemsize if weight < state else 0
            return weight, weight, master + OPTIMIZERS[optimizer] * state
        """,
        "model_state_bytes": """
            w, g, o = bytes_per_param(precision, optimizer)
            per_rank = (numel + k - 1) // k
            if zero == 0:
                return w * numel, g * numel, o * numel
            if zero == 1:
                return w * numel, g * numel, o * per_rank
            if zero == 2:
                return w * numel, g * per_rank, o * per_rank
            return w * per_rank, g * per_rank, o * per_rank
        """,
        "collective_bytes": """
            chunk = (numel + k - 1) // k
            steps = 2 * (k - 1) if kind == "all_reduce" else k - 1
            return steps * chunk * elem_size
        """,
    },
}

OWN = exercise.answers("cost_model")  # mini_dist's code, kept by a wrong solution where it is not wrong
MODEL_STATE_BYTES = """
    w, g, o = bytes_per_param(precision, optimizer)
    s = shard(numel, k)
    return w * (s if zero >= 3 else numel), g * (s if zero >= 2 else numel), o * (s if zero >= 1 else numel)
"""

WRONG = {
    "Adam's m and v counted at the weights' size (bf16: 2 bytes each)": ("bytes from the wrong dtype", {
        "bytes_per_param": """
            weight, grad, master = PRECISIONS[precision]
            return weight, grad, master + OPTIMIZERS[optimizer] * weight
        """,
        "model_state_bytes": MODEL_STATE_BYTES,
        "collective_bytes": OWN["collective_bytes"],
    }),
    "the state counted without the fp32 master weights": ("master copy left out", {
        "bytes_per_param": """
            weight, grad, master = PRECISIONS[precision]
            return weight, grad, OPTIMIZERS[optimizer] * max(weight, 4)
        """,
        "model_state_bytes": MODEL_STATE_BYTES,
        "collective_bytes": OWN["collective_bytes"],
    }),
    "an fp32 master copy counted for every precision, fp32 weights too": ("a master copy of fp32 weights", {
        "bytes_per_param": """
            weight, grad, _ = PRECISIONS[precision]
            return weight, grad, 4 + OPTIMIZERS[optimizer] * max(weight, 4)
        """,
        "model_state_bytes": MODEL_STATE_BYTES,
        "collective_bytes": OWN["collective_bytes"],
    }),
    "ZeRO-1 taken to shard the gradients, ZeRO-2 the optimizer state": ("sharded at the wrong stage", {
        "bytes_per_param": OWN["bytes_per_param"],
        "model_state_bytes": """
            w, g, o = bytes_per_param(precision, optimizer)
            s = shard(numel, k)
            return w * (s if zero >= 3 else numel), g * (s if zero >= 1 else numel), o * (s if zero >= 2 else numel)
        """,
        "collective_bytes": OWN["collective_bytes"],
    }),
    "a rank's shard of the parameters as numel // k": ("chunk not rounded up", {
        "bytes_per_param": OWN["bytes_per_param"],
        "model_state_bytes": """
            w, g, o = bytes_per_param(precision, optimizer)
            s = numel // k
            return w * (s if zero >= 3 else numel), g * (s if zero >= 2 else numel), o * (s if zero >= 1 else numel)
        """,
        "collective_bytes": OWN["collective_bytes"],
    }),
    "a ring step's chunk as numel // k": ("chunk not rounded up", {
        "bytes_per_param": OWN["bytes_per_param"],
        "model_state_bytes": MODEL_STATE_BYTES,
        "collective_bytes": """
            return (2 if kind == "all_reduce" else 1) * (k - 1) * (numel // k) * elem_size
        """,
    }),
    "(k-1)/k of the buffer as it is, not padded to k whole chunks": ("chunk not rounded up", {
        "bytes_per_param": OWN["bytes_per_param"],
        "model_state_bytes": MODEL_STATE_BYTES,
        "collective_bytes": """
            phase = (k - 1) * numel * elem_size // k
            return 2 * phase if kind == "all_reduce" else phase
        """,
    }),
    "every collective counted as one phase of k-1 steps": ("all-reduce counted once", {
        "bytes_per_param": OWN["bytes_per_param"],
        "model_state_bytes": MODEL_STATE_BYTES,
        "collective_bytes": """
            return (k - 1) * shard(numel, k) * elem_size
        """,
    }),
    "a ring phase of k steps, each rank sending its own chunk too": ("k steps instead of k-1", {
        "bytes_per_param": OWN["bytes_per_param"],
        "model_state_bytes": MODEL_STATE_BYTES,
        "collective_bytes": """
            return (2 if kind == "all_reduce" else 1) * k * shard(numel, k) * elem_size
        """,
    }),
}
