"""Megatron's f and g: the exercise's bank (kit/exercise.py); MISTAKES: tests/test_comm.py."""
HINTS = {
    "CopyToParallelRegion.forward": [
        "backward(ctx, grad) is given no group: whatever it needs from forward travels on ctx.",
        "Keep the group on ctx (ctx.group = group), then return x itself: f's forward changes nothing.",
    ],
    "CopyToParallelRegion.backward": [
        "Every rank used the same x, each through its own shard of the next layer, so each rank's grad holds only "
        "its share of dL/dx. What combines the shares?",
        "dL/dx is the sum over the ranks of every rank's grad, and every rank needs it: an all-reduce. backward "
        "returns one gradient per input of forward, in order: x, then group.",
        "all_reduce(grad, ctx.group), and None for the group.",
    ],
    "ReduceFromParallelRegion.forward": [
        "Each rank's x is one term of y = x_0 + x_1 + ... + x_(T-1) (a row-parallel layer's partial product), and "
        "every rank needs all of y.",
        "all_reduce(x, group) returns that sum as a new tensor.",
    ],
    "ReduceFromParallelRegion.backward": [
        "y = x_0 + x_1 + ... + x_(T-1), so dy/dx_r = 1: how does L change with x_r?",
        "Every rank computed its loss from the same y, so its grad already is the whole dL/dy: summing it over the "
        "ranks again would count it T times. Return it as it is, with None for the group.",
    ],
}

RIGHT = {
    "torch.distributed.all_reduce on copies": {
        "CopyToParallelRegion.forward": """
            ctx.group = group
            return x
        """,
        "CopyToParallelRegion.backward": """
            dx = grad.clone()
            dist.all_reduce(dx, group=ctx.group)
            return dx, None
        """,
        "ReduceFromParallelRegion.forward": """
            y = x.clone()
            dist.all_reduce(y, group=group)
            return y
        """,
        "ReduceFromParallelRegion.backward": """
            return grad, None
        """,
    },
    "comm's all_reduce, forward returning a view and backward a copy": {
        "CopyToParallelRegion.forward": """
            ctx.group = group
            return x.view_as(x)
        """,
        "CopyToParallelRegion.backward": """
            return all_reduce(grad.contiguous(), ctx.group, op=dist.ReduceOp.SUM), None
        """,
        "ReduceFromParallelRegion.forward": """
            return all_reduce(x, group)
        """,
        "ReduceFromParallelRegion.backward": """
            return grad.clone(), None
        """,
    },
}

REFERENCE_F = {
    "CopyToParallelRegion.forward": """
        ctx.group = group
        return x
    """,
    "CopyToParallelRegion.backward": """
        return all_reduce(grad, ctx.group), None
    """,
}
REFERENCE_G = {
    "ReduceFromParallelRegion.forward": """
        return all_reduce(x, group)
    """,
    "ReduceFromParallelRegion.backward": """
        return grad, None
    """,
}

WRONG = {
    "f's backward passes dy on as it is": ("f's backward does not reduce", {
        **REFERENCE_F,
        "CopyToParallelRegion.backward": """
            return grad, None
        """,
        **REFERENCE_G,
    }),
    "g's backward sums dy over the ranks again": ("reduced twice", {
        **REFERENCE_F,
        "ReduceFromParallelRegion.forward": """
            ctx.group = group
            return all_reduce(x, group)
        """,
        "ReduceFromParallelRegion.backward": """
            return all_reduce(grad, ctx.group), None
        """,
    }),
    "f and g each with the other's forward and backward": ("forward and backward swapped", {
        "CopyToParallelRegion.forward": """
            ctx.group = group
            return all_reduce(x, group)
        """,
        "CopyToParallelRegion.backward": """
            return grad, None
        """,
        "ReduceFromParallelRegion.forward": """
            ctx.group = group
            return x.clone()
        """,
        "ReduceFromParallelRegion.backward": """
            return all_reduce(grad, ctx.group), None
        """,
    }),
    "g's forward divides the sum by the group's size": ("an average for a sum", {
        **REFERENCE_F,
        "ReduceFromParallelRegion.forward": """
            return all_reduce(x, group) / dist.get_world_size(group)
        """,
        "ReduceFromParallelRegion.backward": """
            return grad, None
        """,
    }),
}
