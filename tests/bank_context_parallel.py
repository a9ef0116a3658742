"""Ring attention's merge: the exercise's bank (kit/exercise.py); MISTAKES: tests/cp_exercise.py."""
HINTS = {
    "merge": [
        "out is softmax attention over keys A alone: its weights sum to 1 over A. Over A and B together, A's keys "
        "hold only part of the softmax: e^lse of it against e^block_lse for B's (lse is the log of the sum of e^score "
        "over those keys). So the merged out weighs each partial out by its share, and the merged lse is the log of "
        "the two sums added.",
        "Share of A = e^lse / (e^lse + e^block_lse) = e^(lse - new), with new = log(e^lse + e^block_lse). Computed "
        "as written, e^lse overflows once scores pass ~709 (fp64; ~88 in fp32): take m, the larger of the two lse, "
        "out of the sum first.",
        "m = torch.maximum(lse, block_lse); new = m + log(e^(lse - m) + e^(block_lse - m)); return "
        "e^(lse - new) * out + e^(block_lse - new) * block_out, new. torch.logaddexp(lse, block_lse) computes new "
        "in one call. With lse = -inf, e^(lse - m) is 0: nothing to treat apart.",
    ],
}

RIGHT = {
    "torch.logaddexp for the merged log-sum-exp": {
        "merge": """
            new = torch.logaddexp(lse, block_lse)
            return torch.exp(lse - new) * out + torch.exp(block_lse - new) * block_out, new
        """,
    },
    "the running max, the two weights normalised by their sum": {
        "merge": """
            m = torch.maximum(lse, block_lse)
            mine = torch.exp(lse - m)
            theirs = torch.exp(block_lse - m)
            total = mine + theirs
            return (mine * out + theirs * block_out) / total, m + torch.log(total)
        """,
    },
}

WRONG = {
    "the two partial results averaged": ("not rescaled by the log-sum-exp", {
        "merge": """
            new = torch.logaddexp(lse, block_lse)
            return (out + block_out) / 2, new
        """,
    }),
    "out merged right, the old lse returned": ("lse not updated", {
        "merge": """
            new = torch.logaddexp(lse, block_lse)
            return torch.exp(lse - new) * out + torch.exp(block_lse - new) * block_out, lse
        """,
    }),
    "log(e^lse + e^block_lse) as written": ("max not subtracted", {
        "merge": """
            new = torch.log(torch.exp(lse) + torch.exp(block_lse))
            return torch.exp(lse - new) * out + torch.exp(block_lse - new) * block_out, new
        """,
    }),
    "lse + log1p(e^(block_lse - lse)), from lse's side only": ("max not subtracted", {
        "merge": """
            new = lse + torch.log1p(torch.exp(block_lse - lse))
            return torch.exp(lse - new) * out + torch.exp(block_lse - new) * block_out, new
        """,
    }),
    "each partial result weighed by the other's share": ("weights swapped", {
        "merge": """
            new = torch.logaddexp(lse, block_lse)
            return torch.exp(block_lse - new) * out + torch.exp(lse - new) * block_out, new
        """,
    }),
}
