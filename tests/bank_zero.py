"""ZeRO-1's step: the exercise's bank (kit/exercise.py); MISTAKES: tests/zero_exercise.py."""
from mini_dist.kit.exercise import planted

HINTS = {
    "zero1_step": [
        "ZeRO-1 is DDP's step with the optimizer's work split K ways: every rank still needs the mean gradient, "
        "as in DDP, but steps only the shard it owns. The other K-1 shards are stepped elsewhere: what brings "
        "them to this rank afterwards?",
        "Rank r owns the r-th of the K equal slices of flat (S = flat.numel() // K elements). Slicing flat gives a "
        "view, so step_shard's update lands in flat; hand it the same slice of the summed gradient.",
        "c.all_reduce(grad, group), then step_shard on slice r of flat and of grad, then c.all_gather(flat, "
        "group), and return grad.",
    ],
}

RIGHT = {
    "all-reduce, step my chunk, all-gather (chunk: the same slices)": {
        "zero1_step": """
            c = COLLECTIVES[collectives]
            K = dist.get_world_size(group)
            r = dist.get_rank(group)
            c.all_reduce(grad, group)
            step_shard(flat.chunk(K)[r], grad.chunk(K)[r])
            c.all_gather(flat, group)
            return grad
        """,
    },
    "reduce-scatter the gradient, step, then all-gather both the gradient and the parameters": {
        "zero1_step": """
            c = COLLECTIVES[collectives]
            K = dist.get_world_size(group)
            r = dist.get_rank(group)
            S = flat.numel() // K
            shard = c.reduce_scatter(grad.clone(), group)
            step_shard(flat.narrow(0, r * S, S), shard)
            mean = torch.zeros_like(grad)
            mean[r * S:(r + 1) * S] = shard
            c.all_gather(mean, group)
            c.all_gather(flat, group)
            return mean
        """,
    },
}

# a right ZeRO-1 step, written plainly: each wrong solution below plants one mistake in it
PLAIN = """
    c = COLLECTIVES[collectives]
    K = dist.get_world_size(group)
    r = dist.get_rank(group)
    S = flat.numel() // K
    mine = slice(r * S, (r + 1) * S)
    c.all_reduce(grad, group)
    step_shard(flat[mine], grad[mine])
    c.all_gather(flat, group)
    return grad
"""
REDUCED = "c.all_reduce(grad, group)"
STEPPED = "step_shard(flat[mine], grad[mine])"
GATHERED = "c.all_gather(flat, group)"

WRONG = {
    "no all-reduce: each rank steps its shard with its own gradient": ("gradient not averaged", {
        "zero1_step": planted(PLAIN, {REDUCED: ""}),
    }),
    "the all-reduced gradient divided by K again": ("divided twice", {
        "zero1_step": planted(PLAIN, {REDUCED: REDUCED + "\ngrad /= K"}),
    }),
    "every rank steps the whole vector": ("every element stepped", {
        "zero1_step": planted(PLAIN, {STEPPED: "step_shard(flat, grad)"}),
    }),
    "rank r steps the shard of rank r + 1": ("the wrong shard", {
        "zero1_step": planted(PLAIN, {
            STEPPED: "theirs = slice(((r + 1) % K) * S, ((r + 1) % K + 1) * S)\n"
                     "step_shard(flat[theirs], grad[theirs])"}),
    }),
    "my shard stepped with the next shard's gradient": ("the gradient of another shard", {
        "zero1_step": planted(PLAIN, {STEPPED: "step_shard(flat[mine], grad.roll(-S)[mine])"}),
    }),
    "the shard cloned before the step": ("stepped a copy", {
        "zero1_step": planted(PLAIN, {STEPPED: "step_shard(flat[mine].clone(), grad[mine])"}),
    }),
    "no all-gather": ("not gathered after the step", {
        "zero1_step": planted(PLAIN, {GATHERED: ""}),
    }),
    "the all-gather before the step": ("not gathered after the step", {
        "zero1_step": planted(PLAIN, {STEPPED: GATHERED, GATHERED: STEPPED}),
    }),
}
