"""Column- and row-parallel linear layers: the exercise's bank (kit/exercise.py); MISTAKES: tests/tp_exercise.py."""
HINTS = {
    "column_parallel_linear": [
        "Forward needs nothing from the other ranks: every rank holds all of x, and its rows of the weight give its "
        "own output features. Backward is where the ranks meet: x reached every rank's columns, so dL/dx is a sum "
        "over the ranks of what each one's columns give back.",
        "Megatron's f (comm) is the identity forward and all-reduces the gradient backward: exactly what x needs. "
        "nn.Linear's weight is [out, in]: F.linear(x, weight, bias) computes x @ weight.T + bias.",
        "F.linear(f(x, group), weight, bias).",
    ],
    "row_parallel_linear": [
        "x W^T sums over the input features, and each rank holds only its in/T of them: its x @ weight.T is one "
        "partial sum of the whole output. What adds the T partial sums, forward, so that every rank has them all?",
        "g (comm) all-reduces forward and passes the gradient through backward. The bias is whole on every rank: "
        "added to each partial sum it would be counted T times.",
        "y = g(F.linear(x, weight), group), then y + bias (when there is a bias).",
    ],
}

RIGHT = {
    "F.linear on f's output; the bias added after g": {
        "column_parallel_linear": """
            return F.linear(f(x, group), weight, bias)
        """,
        "row_parallel_linear": """
            y = g(F.linear(x, weight), group)
            if bias is not None:
                y = y + bias
            return y
        """,
    },
    "matmuls written out (einsum, @), summed in another order": {
        "column_parallel_linear": """
            y = f(x, group) @ weight.t()
            return y if bias is None else y + bias
        """,
        "row_parallel_linear": """
            partial = torch.einsum("...i,oi->...o", x, weight)
            total = g(partial, group)
            return total + bias if bias is not None else total
        """,
    },
}

COLUMN = {
    "column_parallel_linear": """
        return F.linear(f(x, group), weight, bias)
    """,
}
ROW = {
    "row_parallel_linear": """
        y = g(F.linear(x, weight), group)
        return y if bias is None else y + bias
    """,
}

WRONG = {
    "the column layer without f": ("f missing", {
        "column_parallel_linear": """
            return F.linear(x, weight, bias)
        """,
        **ROW,
    }),
    "the row layer returns its own partial product": ("g missing", {
        **COLUMN,
        "row_parallel_linear": """
            return F.linear(x, weight, bias)
        """,
    }),
    "the bias added to each partial product, then summed": ("bias added on every rank", {
        **COLUMN,
        "row_parallel_linear": """
            return g(F.linear(x, weight, bias), group)
        """,
    }),
    "a T-th of the bias added on each rank before the sum": ("bias divided among the ranks", {
        **COLUMN,
        "row_parallel_linear": """
            share = None if bias is None else bias / dist.get_world_size(group)
            return g(F.linear(x, weight, share), group)
        """,
    }),
    "g before the column layer's output, f after the row layer's": ("f and g swapped", {
        "column_parallel_linear": """
            return g(F.linear(x, weight, bias), group)
        """,
        "row_parallel_linear": """
            y = f(F.linear(x, weight), group)
            return y if bias is None else y + bias
        """,
    }),
    "x @ weight, the weight read as [in, out]": ("weight read as [in, out]", {
        "column_parallel_linear": """
            y = f(x, group) @ weight
            return y if bias is None else y + bias
        """,
        **ROW,
    }),
    "my rows of the weight taken again from my slice": ("the slice cut again", {
        "column_parallel_linear": """
            T = dist.get_world_size(group)
            r = dist.get_rank(group)
            mine = weight.chunk(T, 0)[r]
            return F.linear(f(x, group), mine, None if bias is None else bias.chunk(T, 0)[r])
        """,
        **ROW,
    }),
}
