"""Everything at once: the figures that answer questions 21 and 27 (mini_dist/questions/questions.md).

    21. What a 7B model needs, and what fits on one 80 GB GPU   memory_for_7b  (cost_model.py, planner.py)
    27. How the five axes combine, and which goes innermost     five_axes      (mesh.py, train_5d.py, cost_model.py)

Each runs on every rank of its group and returns (figure, holds), as `./run.sh ask N` and
tests/test_questions.py call it. The measuring is the concepts' own: what torch.optim holds after a step
(cost_model's demo), the planner's pick, a 5D run beside one process (train_5d), a grid's groups (mesh), so a
figure here cannot drift from the demos. Question 26 (why adding GPUs stops helping) is step_time's demo's own
figure: step_time.scaling_stops.
"""
from mini_dist.cost_model import Cluster, Model, Plan, measured_model_state_bytes, model_state_bytes
from mini_dist.planner import recommend


def memory_for_7b() -> tuple[str, bool]:
    """Question 21: the 16 bytes per parameter counted in what torch.optim holds after an Adam step, 7B of them
    against an 80 GB GPU, fully sharded over 8, and the plan the method picks for 8 x 80 GB."""
    b = 10 ** 9
    numel = 10_000
    per = sum(measured_model_state_bytes(numel, "bf16", "adam")) / numel
    best = recommend(Model(7 * b, 32, 4096, 32, 4096), Cluster(8), Plan(8, microbatches=8))
    sharded = sum(model_state_bytes(7 * b, 8, 3)) / b
    figure = (f"torch holds {per:g} B per parameter after an Adam step with bf16 weights and an fp32 master copy "
              f"(counted on {numel:,}); 7B x {per:g} B = {7 * per:g} GB > 80 GB; one 80 GB GPU holds the states of "
              f"{80 / per:.1f}B parameters at most; fully sharded over 8: {sharded:g} GB per GPU; the planner's pick "
              f"for 8 x 80 GB, seq 4096: {best.plan.name}, {best.total / b:.1f} GB per GPU")
    return figure, per == 16 and sharded == 14
