"""The ring all-reduce: the exercise's bank (kit/exercise.py); MISTAKES: tests/ring_exercise.py."""
from mini_dist.kit.exercise import planted

HINTS = {
    "textbook_reduce_scatter_steps": [
        "Follow one chunk around the ring rather than one rank: at each step it moves on to the next rank, which "
        "adds its own copy in. After N-1 moves it has met every rank, so it must end where it belongs: chunk c on "
        "rank c. Where must it start?",
        "Sending to the left (to r-1, receiving from r+1), chunk c starts on rank c+1. At each step a rank sends the "
        "chunk it completed a step further at the step before (at step 0: chunk r+1, mod N), and adds what arrives "
        "(received into a scratch tensor: torch.empty_like) into the chunk its right neighbour sent.",
        "For s in 0 .. N-2: send chunks[(r+1+s) % N] to (r-1) % N, receive from (r+1) % N, and reduce it into "
        "chunks[(r+2+s) % N]. A ring sent to the right works too, with every index mirrored.",
    ],
    "textbook_all_gather_steps": [
        "The same ring as the reduce-scatter, but a step copies: what arrives is final, so it can be received "
        "straight into its place in chunks.",
        "Sending to the left, rank r sends its own chunk at step 0, and at every later step passes on the chunk it "
        "received at the step before. After N-1 steps it has received every chunk but its own.",
        "For s in 0 .. N-2: send chunks[(r+s) % N] to (r-1) % N and receive chunks[(r+1+s) % N] from (r+1) % N.",
    ],
}

LEFT_ALL_GATHER = """
    r, n = dist.get_rank(group), dist.get_world_size(group)
    for s in range(n - 1):
        send_recv(chunks[(r + s) % n], (r - 1) % n, chunks[(r + 1 + s) % n], (r + 1) % n, group, "all-gather")
"""

RIGHT = {
    "the ring sent to the right, as Patarasuk & Yuan draw it (sums in another order than gloo's)": {
        "textbook_reduce_scatter_steps": """
            r, n = dist.get_rank(group), dist.get_world_size(group)
            for s in range(n - 1):
                mine = chunks[(r - 2 - s) % n]
                incoming = torch.empty_like(mine)
                send_recv(chunks[(r - 1 - s) % n], (r + 1) % n, incoming, (r - 1) % n, group, "reduce-scatter")
                reduce_into(mine, incoming, op)
        """,
        "textbook_all_gather_steps": """
            r, n = dist.get_rank(group), dist.get_world_size(group)
            for s in range(n - 1):
                send_recv(chunks[(r - s) % n], (r + 1) % n, chunks[(r - 1 - s) % n], (r - 1) % n, group, "all-gather")
        """,
    },
    "the ring sent to the left, following the chunk each step completed": {
        "textbook_reduce_scatter_steps": """
            r, n = dist.get_rank(group), dist.get_world_size(group)
            sending = (r + 1) % n
            for _ in range(n - 1):
                arriving = (sending + 1) % n
                incoming = torch.empty_like(chunks[arriving])
                send_recv(chunks[sending], (r - 1) % n, incoming, (r + 1) % n, group, "reduce-scatter")
                reduce_into(chunks[arriving], incoming, op)
                sending = arriving
        """,
        "textbook_all_gather_steps": """
            r, n = dist.get_rank(group), dist.get_world_size(group)
            passing = r
            for _ in range(n - 1):
                arriving = (passing + 1) % n
                send_recv(chunks[passing], (r - 1) % n, chunks[arriving], (r + 1) % n, group, "all-gather")
                passing = arriving
        """,
    },
}

# the ring sent to the left, its indices written out: each wrong solution below plants one mistake in it
LEFT_REDUCE_SCATTER = """
    r, n = dist.get_rank(group), dist.get_world_size(group)
    for s in range(n - 1):
        mine = chunks[(r + 2 + s) % n]
        incoming = torch.empty_like(mine)
        send_recv(chunks[(r + 1 + s) % n], (r - 1) % n, incoming, (r + 1) % n, group, "reduce-scatter")
        reduce_into(mine, incoming, op)
"""
SEND = 'send_recv(chunks[(r + 1 + s) % n], (r - 1) % n, incoming, (r + 1) % n, group, "reduce-scatter")'

WRONG = {
    "every index one lower: rank r ends with block r-1": ("one step off", {
        "textbook_reduce_scatter_steps": planted(LEFT_REDUCE_SCATTER, {
            "mine = chunks[(r + 2 + s) % n]": "mine = chunks[(r + 1 + s) % n]",
            SEND: 'send_recv(chunks[(r + s) % n], (r - 1) % n, incoming, (r + 1) % n, group, "reduce-scatter")'}),
        "textbook_all_gather_steps": LEFT_ALL_GATHER,
    }),
    "sent to the right with the indices of a ring sent to the left": ("turned the wrong way", {
        "textbook_reduce_scatter_steps": planted(LEFT_REDUCE_SCATTER, {
            SEND: 'send_recv(chunks[(r + 1 + s) % n], (r + 1) % n, incoming, (r - 1) % n, group, "reduce-scatter")'}),
        "textbook_all_gather_steps": LEFT_ALL_GATHER,
    }),
    "what arrives added into the chunk just sent": ("added into the wrong chunk", {
        "textbook_reduce_scatter_steps": planted(LEFT_REDUCE_SCATTER, {
            "mine = chunks[(r + 2 + s) % n]": "send = chunks[(r + 1 + s) % n]",
            "incoming = torch.empty_like(mine)": "incoming = torch.empty_like(chunks[(r + 2 + s) % n])",
            SEND: 'send_recv(send, (r - 1) % n, incoming, (r + 1) % n, group, "reduce-scatter")',
            "reduce_into(mine, incoming, op)": "reduce_into(send, incoming, op)"}),
        "textbook_all_gather_steps": LEFT_ALL_GATHER,
    }),
    "each sum made a new tensor (mine = mine + incoming), the chunks left as they were": ("not reduced in place", {
        "textbook_reduce_scatter_steps": planted(LEFT_REDUCE_SCATTER, {
            "reduce_into(mine, incoming, op)": "mine = mine + incoming"}),
        "textbook_all_gather_steps": LEFT_ALL_GATHER,
    }),
    "every op added (mine.add_(incoming))": ("op ignored", {
        "textbook_reduce_scatter_steps": planted(LEFT_REDUCE_SCATTER, {
            "reduce_into(mine, incoming, op)": "mine.add_(incoming)"}),
        "textbook_all_gather_steps": LEFT_ALL_GATHER,
    }),
    "AVG divided in the steps as well as by the caller": ("divided twice", {
        "textbook_reduce_scatter_steps": LEFT_REDUCE_SCATTER + """\
    if op == AVG:
        chunks[r].div_(n)
""",
        "textbook_all_gather_steps": LEFT_ALL_GATHER,
    }),
    "the all-gather one step short": ("all-gather incomplete", {
        "textbook_reduce_scatter_steps": LEFT_REDUCE_SCATTER,
        "textbook_all_gather_steps": planted(LEFT_ALL_GATHER, {"for s in range(n - 1):": "for s in range(n - 2):"}),
    }),
}
