"""The textbook 1F1B: the exercise's bank (kit/exercise.py); MISTAKES: tests/pp_exercise.py."""
from mini_dist.kit.exercise import planted

HINTS = {
    "one_f_one_b_stage": [
        "Follow microbatch 0: it goes forward through stages s+1 .. P-1 and comes back through them before stage s "
        "can run its backward. How many forwards does stage s run meanwhile? Those it runs before the first "
        "backward are the warm-up; the first backward frees one, so from then on one forward, one backward.",
        "Three loops: the warm-up (forwards only, as many as the stages after s, but no more than M), the steady "
        "state (a forward of the next microbatch, then the backward of the oldest one held, while forwards are "
        "left), the cool-down (the backwards still owed).",
        "warmup = min(P - s - 1, M); forwards 0 .. warmup-1; then for k in range(M - warmup): forward warmup + k, "
        "backward k; then backwards M - warmup .. M-1.",
    ],
}

THREE_LOOPS = """
    order = []
    warmup = min(P - s - 1, M)
    for m in range(warmup):
        order.append(("forward", m, 0))
    for k in range(M - warmup):
        order.append(("forward", warmup + k, 0))
        order.append(("backward", k, 0))
    for m in range(M - warmup, M):
        order.append(("backward", m, 0))
    return order
"""

RIGHT = {
    "three loops: warm-up, steady state, cool-down": {"one_f_one_b_stage": THREE_LOOPS},
    "one loop: a forward while fewer than P-s microbatches are held, else a backward": {
        "one_f_one_b_stage": """
            order = []
            forwards = 0
            backwards = 0
            while backwards < M:
                if forwards < M and forwards - backwards < P - s:
                    order.append(("forward", forwards, 0))
                    forwards += 1
                else:
                    order.append(("backward", backwards, 0))
                    backwards += 1
            return order
        """,
    },
}

# each a mistake planted in the three loops
WRONG = {
    "a warm-up of P - s forwards": ("warm-up of P - s", {
        "one_f_one_b_stage": planted(THREE_LOOPS, {"warmup = min(P - s - 1, M)": "warmup = min(P - s, M)"}),
    }),
    "the steady state runs the oldest backward, then the next forward": (
        "backward before forward in the steady state", {
            "one_f_one_b_stage": planted(THREE_LOOPS, {
                'order.append(("forward", warmup + k, 0))': 'order.append(("backward", k, 0))',
                'order.append(("backward", k, 0))': 'order.append(("forward", warmup + k, 0))'}),
        }),
    "the cool-down starts one microbatch late": ("cool-down missing backwards", {
        "one_f_one_b_stage": planted(THREE_LOOPS, {
            "for m in range(M - warmup, M):": "for m in range(M - warmup + 1, M):"}),
    }),
    "a warm-up of P - s - 1 whatever M is": ("warm-up ignoring M < P", {
        "one_f_one_b_stage": planted(THREE_LOOPS, {"warmup = min(P - s - 1, M)": "warmup = P - s - 1"}),
    }),
}
