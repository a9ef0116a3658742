"""Everything at once: the figures that answer questions 21 and 27 (mini_dist/questions/questions.md).

    21. What a 7B model needs, and what fits on one 80 GB GPU   memory_for_7b  (cost_model.py, planner.py)
    27. How the five axes combine, and which goes innermost     five_axes      (mesh.py, measure_5d.py, cost_model.py)

Each runs on every rank of its group and returns (figure, holds), as `./run.sh ask N` and
tests/test_questions.py call it. The measuring is the concepts' own: what torch.optim holds after a step
(cost_model's demo), the planner's pick, a 5D run beside one process and its bytes by axis (train_5d,
measure_5d), a grid's groups (mesh), so a figure here cannot drift from the demos. Question 26 (why adding GPUs
stops speeding training up) is step_time's demo's own figure: step_time.scaling_stops.
"""
import torch.distributed as dist

from mini_dist import cost_model
from mini_dist.cost_model import Cluster, Model, Plan, measured_model_state_bytes, model_state_bytes
from mini_dist.kit.wire import LEDGER
from mini_dist.measure_5d import measured_run
from mini_dist.mesh import Mesh, RankGrid
from mini_dist.planner import recommend
from mini_dist.tiny_gpt import Config, padded_vocab
from mini_dist.train_5d import train_dense


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


def five_axes() -> tuple[str, bool]:
    """Question 27, on every rank of the world: the axes multiply, the chattiest goes innermost, and however they
    combine the run trains like one process: a step on dp x tp 2 beside one process, with the bytes each axis
    sent; a 2x2x2x2 grid's groups; a 7B model's TP and DP bytes by the cost model."""
    mesh = Mesh(dp=dist.get_world_size() // 2, tp=2)
    g = mesh.grid
    cfg = Config(vocab=padded_vocab(g.tp), layers=2, hidden=16, heads=2, seq=8, batch=2 * g.dp)
    run = measured_run(cfg, mesh, steps=1)
    diff = max(abs(a - b) for a, b in zip(run.losses, train_dense(cfg, len(run.losses))))
    sent = run.bytes[-1]
    calls = LEDGER.calls["all_reduce"]  # the last step's, forward and backward
    grid = RankGrid(dp=2, pp=2, cp=2, tp=2)
    groups = ", ".join(f"{a} {grid.groups(a)[0]}" for a in ("tp", "cp", "pp", "dp"))
    big = Model(7 * 10 ** 9, 32, 4096, 32, 4096)
    plan = Plan(8, tp=8, microbatches=8)
    tp = cost_model.tp_traffic(big, plan)
    dp = sum(cost_model.dp_traffic(big.params // 8, plan).values())
    figure = (f"a tiny GPT on dp {g.dp} x pp {g.pp} x cp {g.cp} x tp {g.tp}: the loss = one process's to {diff:.0e}; "
              f"this rank sent per step TP {sent['tp']:,} B in {calls} blocking all-reduces (forward and backward), DP "
              f"{sent['dp']:,} B once per step, during backward; a 7B model as TP 8 x DP 8, 8 microbatches of 4096 "
              f"tokens: TP {tp / 1e9:.0f} GB, DP {dp / 1e9:.1f} GB per GPU per step (cost model); in a dp 2 x pp 2 x "
              f"cp 2 x tp 2 grid rank 0's groups are {groups}: the chattiest axis on the nearest ranks")
    return figure, diff <= 1e-13 and (g.tp == 1 or calls > 1) and grid.groups("tp")[0] == [0, 1] and tp > 10 * dp
