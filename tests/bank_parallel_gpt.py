"""Gradients averaged over replicas: the exercise's bank (kit/exercise.py); MISTAKES: tests/test_parallel_gpt.py."""
HINTS = {
    "average_gradients": [
        "Which ranks hold the same copy of a weight and saw other tokens? The loss each rank differentiated is the "
        "mean over its own tokens only: the dense model's loss is the mean over all of theirs.",
        "A replicated weight (attention, MLP, router, embedding: the same shard on every rank of the same pp and tp) "
        "is held by all dp x cp ranks of mesh.dp_cp_group. An expert (ep_dim) is not: the ranks of its EP group hold "
        "other experts, and the all-to-all already brought it their tokens. Its copies sit in mesh.edp_group.",
        "For every parameter: all_reduce its grad over dp_cp_group, or edp_group for an expert, then divide by "
        "dp x cp for both: the expert's sum over edp already counts the tokens of every dp x cp rank.",
    ],
}

RIGHT = {
    "mini_dist's all_reduce, divided after the sum": {
        "average_gradients": """
            n = mesh.grid.dp * mesh.grid.cp
            for p in model.parameters():
                group = mesh.edp_group if hasattr(p, "ep_dim") else mesh.dp_cp_group
                p.grad = all_reduce(p.grad, group) / n
        """,
    },
    "divided first, then torch.distributed's all_reduce in place, groups by name": {
        "average_gradients": """
            ranks = mesh.grid.dp * mesh.grid.cp
            for p in model.parameters():
                p.grad.div_(ranks)
                name = "edp" if hasattr(p, "ep_dim") else "dp_cp"
                dist.all_reduce(p.grad, group=mesh.group[name])
        """,
    },
}

WRONG = {
    "every gradient summed over its group, never divided": ("a sum where an average was meant", {
        "average_gradients": """
            for p in model.parameters():
                p.grad = all_reduce(p.grad, mesh.edp_group if hasattr(p, "ep_dim") else mesh.dp_cp_group)
        """,
    }),
    "averaged over the data-parallel group, as plain DDP does": ("the context-parallel ranks left out", {
        "average_gradients": """
            for p in model.parameters():
                if hasattr(p, "ep_dim"):
                    p.grad = all_reduce(p.grad, mesh.edp_group) / (mesh.grid.dp * mesh.grid.cp)
                else:
                    p.grad = all_reduce(p.grad, mesh.dp_group) / mesh.grid.dp
        """,
    }),
    "every gradient averaged over dp x cp, experts too": ("expert gradients summed with other experts'", {
        "average_gradients": """
            n = mesh.grid.dp * mesh.grid.cp
            for p in model.parameters():
                p.grad = all_reduce(p.grad, mesh.dp_cp_group) / n
        """,
    }),
    "an expert's gradient averaged over the edp group it was summed over": (
        "expert gradients averaged over their replicas only", {
            "average_gradients": """
                n = mesh.grid.dp * mesh.grid.cp
                for p in model.parameters():
                    if hasattr(p, "ep_dim"):
                        p.grad = all_reduce(p.grad, mesh.edp_group) / (n // mesh.grid.ep)
                    else:
                        p.grad = all_reduce(p.grad, mesh.dp_cp_group) / n
            """,
        }),
    "experts skipped: the all-to-all taken to have reduced them": ("expert gradients left unreduced", {
        "average_gradients": """
            n = mesh.grid.dp * mesh.grid.cp
            for p in model.parameters():
                if not hasattr(p, "ep_dim"):
                    p.grad = all_reduce(p.grad, mesh.dp_cp_group) / n
        """,
    }),
}
