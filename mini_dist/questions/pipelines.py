"""Figures for the questions about pipelines (section 9 of the reading order) that are not a demo's own.

    gpipe_vs_1f1b                question 14: the same bubble, (P-1)/(M+P-1), but not the same memory
    interleaved_and_zero_bubble  question 15: how much interleaving and zero bubble shrink the bubble

Question 13 (what flows between stages) is mini_dist/pipeline.py's own figure, what_flows_between_stages.
Each function is the measure of its question (mini_dist/questions/questions.md): every rank of the
question's group calls it and gets (figure, holds). Both simulate the schedules, so they need no ranks.
"""
from mini_dist.pipeline_actions import live_microbatches
from mini_dist.pipeline_bubble import bubble_formula, bubble_fraction, simulate
from mini_dist.pipeline_schedules import SCHEDULES


def gpipe_vs_1f1b(P: int = 4, M: int = 8) -> tuple[str, bool]:
    """GPipe and 1F1B simulated with uniform stages: the same bubble, (P-1)/(M+P-1), but GPipe keeps the
    activations of M microbatches on every stage, 1F1B min(P-r, M) on stage r. Returns (figure, holds)."""
    bubble = {}
    kept = {}
    for name in ("gpipe", "1f1b"):
        plan = SCHEDULES[name](P, M)
        bubble[name] = bubble_fraction(simulate(plan))
        kept[name] = [live_microbatches(actions) for actions in plan.actions]
    formula = bubble_formula("1f1b", P, M)
    figure = (f"P = {P}, M = {M}, simulated: bubble GPipe {bubble['gpipe']:.3f}, 1F1B {bubble['1f1b']:.3f} = "
              f"(P-1)/(M+P-1) = {formula:.3f}; activations kept at the peak per stage, in microbatches: GPipe "
              f"{kept['gpipe']}, 1F1B {kept['1f1b']}")
    same_bubble = all(abs(b - formula) < 1e-12 for b in bubble.values())
    memory = kept["gpipe"] == [M] * P and kept["1f1b"] == [min(P - r, M) for r in range(P)]
    return figure, same_bubble and memory


def interleaved_and_zero_bubble(P: int = 4, M: int = 8, v: int = 2) -> tuple[str, bool]:
    """1F1B, interleaved 1F1B (v chunks, each 1/v of a stage) and ZB-H1 simulated with F = B = W: each
    bubble beside its formula (which only 1F1B keeps for M < P). Returns (figure, holds)."""
    seen = {}
    for name, chunks in (("1f1b", 1), ("interleaved", v), ("zero_bubble", 1)):
        step = 1 / chunks  # a chunk computes 1/v of a stage
        ideal = simulate(SCHEDULES[name](P, M, chunks), step, step, step)
        seen[name] = (bubble_fraction(ideal), bubble_formula(name, P, M, v))
    figure = (f"P = {P}, M = {M}, F = B = W, simulated (formula): 1F1B {seen['1f1b'][0]:.3f} ({seen['1f1b'][1]:.3f}), "
              f"interleaved v = {v} {seen['interleaved'][0]:.3f} ({seen['interleaved'][1]:.3f}), zero bubble ZB-H1 "
              f"{seen['zero_bubble'][0]:.3f} ({seen['zero_bubble'][1]:.3f})")
    holds = True
    for name, (simulated, formula) in seen.items():
        if M >= P or name == "1f1b":
            holds = holds and abs(simulated - formula) < 1e-12
        else:  # fewer microbatches than ranks: a microbatch comes back round before there is work
            holds = holds and simulated >= formula
    return figure, holds
