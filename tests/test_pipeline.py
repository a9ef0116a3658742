"""Pipeline parallelism: schedules checked as data (no processes), then the executor checked against
single-process full-batch training and against torch.distributed.pipelining on the same split."""
import itertools

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from harness import RankFailure, device, rank_generator, run, subgroup
from mini_dist.pipeline import (HEADER_LEN, SCHEDULES, Action, balanced_split, bubble_fraction,
                                gpipe_schedule, live_microbatches, one_f_one_b_schedule, pipeline_stage,
                                pipeline_step, simulate, split_model, timeline_picture, torch_pipelining)

schedule_names = st.sampled_from(sorted(SCHEDULES))


def times_of(timeline, op):
    """{(stage, microbatch): (start, end)} of every `op` in a simulated timeline."""
    return {(s, m): (a, b) for s, events in enumerate(timeline) for o, m, a, b in events if o == op}


# ----- schedules as data, without processes -----

@given(st.integers(1, 6), st.integers(1, 16), schedule_names)
def test_each_microbatch_goes_forward_through_the_stages_in_order_and_backward_in_reverse(P, M, name):
    schedule = SCHEDULES[name](P, M)
    for s, actions in enumerate(schedule):
        for kind in ("forward", "backward"):
            assert sorted(m for op, m in actions if op == kind) == list(range(M))  # once per stage
        for m in range(M):
            assert actions.index(Action("forward", m)) < actions.index(Action("backward", m))
    timeline = simulate(schedule)
    forward, backward = times_of(timeline, "forward"), times_of(timeline, "backward")
    for m in range(M):
        for s in range(1, P):
            assert forward[s, m][0] >= forward[s - 1, m][1]  # stage s starts m once s-1 has finished it
            assert backward[s - 1, m][0] >= backward[s, m][1]  # and backward runs the other way
        assert backward[P - 1, m][0] >= forward[P - 1, m][1]


@given(st.integers(1, 6), st.integers(1, 16), schedule_names)
def test_every_send_meets_a_receive_of_the_same_microbatch_in_the_same_order(P, M, name):
    schedule = SCHEDULES[name](P, M)

    def mbs(s, op):
        return [m for o, m in schedule[s] if o == op]
    assert mbs(0, "recv_act") == mbs(0, "send_grad") == []  # the ends talk to one neighbour only
    assert mbs(P - 1, "send_act") == mbs(P - 1, "recv_grad") == []
    for s in range(P - 1):  # messages between two ranks are matched in the order they were posted
        assert mbs(s, "send_act") == mbs(s + 1, "recv_act") and len(mbs(s, "send_act")) == M
        assert mbs(s + 1, "send_grad") == mbs(s, "recv_grad") and len(mbs(s, "recv_grad")) == M


def test_the_simulation_reports_a_deadlock_a_mismatch_and_a_lost_message():
    waits_for_grad_first = [[Action("recv_grad", 0), Action("forward", 0), Action("send_act", 0)],
                            [Action("recv_act", 0), Action("forward", 0), Action("backward", 0),
                             Action("send_grad", 0)]]
    with pytest.raises(RuntimeError, match=r"deadlock: stage 0 at Action\(op='recv_grad', mb=0\)"):
        simulate(waits_for_grad_first)
    swapped = gpipe_schedule(2, 2)
    swapped[1][0], swapped[1][3] = swapped[1][3], swapped[1][0]  # stage 1 receives microbatch 1 first
    with pytest.raises(RuntimeError, match="stage 1 recv_act 1 would receive microbatch 0"):
        simulate(swapped)
    with pytest.raises(RuntimeError, match="sent but never received: 0->1"):
        simulate([[Action("forward", 0), Action("send_act", 0)], [Action("forward", 0)]])


@given(st.integers(1, 6), st.integers(1, 16))
def test_1f1b_holds_at_most_P_minus_s_microbatches_where_gpipe_holds_M(P, M):
    for s in range(P):
        assert live_microbatches(one_f_one_b_schedule(P, M)[s]) == min(M, P - s)
        assert live_microbatches(gpipe_schedule(P, M)[s]) == M


@given(st.integers(1, 6), st.integers(1, 16), st.integers(1, 3), st.integers(1, 3))
def test_gpipe_and_1f1b_have_the_same_bubble_the_formula_predicts(P, M, t_forward, t_backward):
    # Integer durations: both sides are one correctly rounded division of the same rational, so exact ==.
    expected = (P - 1) / (M + P - 1)
    for build in (gpipe_schedule, one_f_one_b_schedule):
        assert bubble_fraction(simulate(build(P, M), t_forward, t_backward)) == expected


def test_a_timeline_prints_stages_as_rows_and_time_as_columns():
    assert timeline_picture(simulate(gpipe_schedule(2, 2), 1, 1)) == ("stage 0 |F0 F1 .  .  B0 B1\n"
                                                                       "stage 1 |.  F0 F1 B0 B1 .")
    assert timeline_picture(simulate(one_f_one_b_schedule(2, 2), 1, 2)) == (
        "stage 0 |F0 F1 .  .  B0 B0 .  B1 B1\n"
        "stage 1 |.  F0 B0 B0 F1 B1 B1 .  .")


@given(st.lists(st.integers(0, 50), min_size=1, max_size=8), st.data())
def test_balanced_split_minimises_the_costliest_stage(costs, data):
    P = data.draw(st.integers(1, len(costs)))
    sizes = balanced_split(costs, P)
    assert len(sizes) == P and min(sizes) >= 1 and sum(sizes) == len(costs)

    def costliest(cuts):
        bounds = [0, *cuts, len(costs)]
        return max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
    brute_force = min(costliest(cuts) for cuts in itertools.combinations(range(1, len(costs)), P - 1))
    assert costliest(list(itertools.accumulate(sizes))[:-1]) == brute_force


def test_split_model_and_schedules_reject_impossible_shapes():
    model = nn.Sequential(nn.Linear(2, 2), nn.Tanh())
    with pytest.raises(ValueError, match="cannot cut 2 layers into 3 pipeline stages"):
        split_model(model, 3)
    with pytest.raises(ValueError, match=r"sizes \[2, 1\] must be 2 positive layer counts summing to 2"):
        split_model(model, 2, [2, 1])
    assert [len(stage) for stage in split_model(model, 2)] == [1, 1]
    for build in (gpipe_schedule, one_f_one_b_schedule):
        with pytest.raises(ValueError, match="at least one stage and one microbatch"):
            build(2, 0)


# ----- the executor, on ranks -----

def build_model(seed, widths, frozen):
    """Linear+Tanh blocks; `frozen` freezes the first Linear (a first stage may need no backward)."""
    torch.manual_seed(seed)
    layers = []
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        layers += [nn.Linear(a, b)] + [nn.Tanh()] * (i < len(widths) - 2)
    model = nn.Sequential(*layers).double().to(device())
    model[0].requires_grad_(not frozen)
    return model


def make_loss(kind):
    return nn.MSELoss() if kind == "mse" else nn.CrossEntropyLoss()


def draw_batch(seed, widths, batch, kind):
    g = rank_generator(seed)  # each rank its own data: only stage 0's inputs and stage P-1's targets count
    x = torch.randn(batch, widths[0], generator=g, dtype=torch.float64).to(device())
    y = (torch.randn(batch, widths[-1], generator=g, dtype=torch.float64) if kind == "mse"
         else torch.randint(widths[-1], (batch,), generator=g)).to(device())
    return x, y


def grads_by_index(model, stage):
    index = {id(p): i for i, p in enumerate(model.parameters())}
    return {index[id(p)]: p.grad.cpu() for p in stage.parameters() if p.grad is not None}


def pipelined(seed, widths, frozen, batch, M, name, kind, sizes, ranks):
    """One step of our pipeline on the ranks `ranks` (the default group if that is all of them), then,
    where torch runs it, the same step by torch.distributed.pipelining; returns what the test process
    needs to redo the step in a single process."""
    group = subgroup(ranks) if len(ranks) < dist.get_world_size() else None
    if dist.get_rank() not in ranks:
        return None
    model = build_model(seed, widths, frozen)
    x, y = draw_batch(seed, widths, batch, kind)
    stage = pipeline_stage(model, group, sizes)
    P, s = len(ranks), dist.get_rank(group)
    loss, stats = pipeline_step(stage, SCHEDULES[name](P, M), x, y, make_loss(kind), group)
    result = dict(stage=s, loss=loss, grads=grads_by_index(model, stage), x=x.cpu(), y=y.cpu(), stats=stats)
    # Importing torch.distributed.pipelining takes seconds per rank: only the 4-rank pool pays it (its
    # subgroups give every P from 1 to 4). torch's Schedule1F1B refuses M < P.
    if dist.get_world_size() == 4 and (name == "gpipe" or M >= P):
        stage.zero_grad()
        result["torch_loss"] = torch_pipelining(stage, name, M, make_loss(kind), group)(x, y)
        result["torch_grads"] = grads_by_index(model, stage)
    return result


def full_batch(seed, widths, frozen, kind, x, y):
    """Single-process training on the whole batch. Also the size of what its sums add up, sample by
    sample: a float sum's rounding error is bounded by eps times the sum of |terms|, which cancellation
    can make much larger than |sum|."""
    model, loss_fn = build_model(seed, widths, frozen).cpu(), make_loss(kind)
    loss = loss_fn(model(x), y)
    loss.backward()
    grads = {i: p.grad.clone() for i, p in enumerate(model.parameters()) if p.grad is not None}
    loss_terms, grad_terms = 0.0, {i: torch.zeros_like(g) for i, g in grads.items()}
    for n in range(len(x)):  # the batch mean is (1/N) * the sum of the samples' losses
        model.zero_grad()
        sample = loss_fn(model(x[n:n + 1]), y[n:n + 1]) / len(x)
        sample.backward()
        loss_terms += sample.abs().item()
        for i, p in enumerate(model.parameters()):
            if i in grads:
                grad_terms[i] += p.grad.abs()
    return (loss.detach(), loss_terms), {i: (g, grad_terms[i]) for i, g in grads.items()}


def assert_equal_up_to_rounding(actual, expected, terms, roundings):
    """fp64: the same per-sample terms, computed and summed in another grouping and order (per microbatch,
    each with its own 1/M, and matmuls of another batch size). To first order each computation is off the
    exact value by at most roundings*eps*sum|terms|, so the two differ by at most twice that."""
    bound = 2 * roundings * torch.finfo(torch.float64).eps * torch.as_tensor(terms)
    difference = (torch.as_tensor(actual).cpu() - expected).abs()
    assert (difference <= bound).all(), f"difference {difference.max():.3g} > bound {bound.max():.3g}"


def check_step(world, ranks, sizes, seed, widths, frozen, mb_size, M, name, kind):
    """Pipelined loss and grads = single-process full-batch training (= torch.distributed.pipelining where
    it ran: returns whether it did), and the executor's measurements = what the schedule says."""
    P = len(ranks)
    results = run(world, pipelined, seed, widths, frozen, M * mb_size, M, name, kind, sizes, ranks)
    results = sorted((r for r in results if r is not None), key=lambda r: r["stage"])
    x, y = results[0]["x"], results[-1]["y"]  # stage 0's inputs and stage P-1's targets are the batch
    (loss, loss_terms), grads = full_batch(seed, widths, frozen, kind, x, y)
    # Roundings on a term's way: the sum over the batch, and forward and backward through each Linear an
    # inner product as long as its input resp. output width.
    roundings = len(x) + 2 * sum(widths)
    assert_equal_up_to_rounding(results[-1]["loss"], loss, loss_terms, roundings)
    ours = {i: g for r in results for i, g in r["grads"].items()}
    assert sum(len(r["grads"]) for r in results) == len(ours) == len(grads)  # each parameter on one stage
    for i, (g, terms) in grads.items():
        assert_equal_up_to_rounding(ours[i], g, terms, roundings)
    if "torch_loss" in results[-1]:
        assert_equal_up_to_rounding(results[-1]["loss"], results[-1]["torch_loss"], loss_terms, roundings)
        for r in results:
            for i, g in r["torch_grads"].items():
                if M & (M - 1) == 0:  # 1/M exact and the same operations in the same order: bit for bit
                    assert torch.equal(r["grads"][i], g)
                assert_equal_up_to_rounding(r["grads"][i], g, grads[i][1], roundings)
    stages = split_model(build_model(seed, widths, frozen).cpu(), P, sizes)
    acts = list(itertools.accumulate(stages, lambda a, stage: stage(a), initial=x[:mb_size]))
    for r in results:  # what the executor measured, beside what the schedule says
        s, actions = r["stage"], SCHEDULES[name](P, M)[r["stage"]]
        assert [e[:2] for e in r["stats"].events] == actions
        assert r["stats"].peak_live == live_microbatches(actions)
        forward = (s < P - 1) * (M * acts[s + 1].numel() + HEADER_LEN) * 8  # + the shape header, once
        backward = (s > 0) * M * acts[s].numel() * 8  # fp64 activations and gradients
        assert r["stats"].bytes_sent == forward + backward
    return "torch_loss" in results[-1]


@st.composite
def pipelined_steps(draw, worlds, torch_runs=False):
    """A pipelined step: its world, pipeline ranks, model, split, batch, M, schedule and loss."""
    world, name = draw(worlds), draw(schedule_names)
    widths = draw(st.lists(st.integers(1, 6), min_size=3, max_size=6))
    n_layers = 2 * len(widths) - 3
    P = draw(st.integers(1, min(world, n_layers)))
    cuts = sorted(draw(st.sets(st.integers(1, n_layers - 1), min_size=P - 1, max_size=P - 1)))
    return dict(world=world, ranks=sorted(draw(st.permutations(range(world)))[:P]),  # may be a subgroup
                sizes=None if draw(st.booleans()) else [b - a for a, b in zip([0, *cuts], [*cuts, n_layers])],
                seed=draw(st.integers(0, 2 ** 16)), widths=widths, frozen=draw(st.booleans()),
                mb_size=draw(st.integers(1, 4)), name=name,
                kind=draw(st.sampled_from(["mse", "cross_entropy"])),
                M=draw(st.integers(P if torch_runs and name == "1f1b" else 1, 8)))  # torch's 1F1B: M >= P


@settings(max_examples=15)
@given(pipelined_steps(st.integers(1, 4)))
def test_pipelined_loss_and_grads_equal_full_batch_training(step):
    check_step(**step)


@settings(max_examples=10)
@given(pipelined_steps(st.just(4), torch_runs=True))
def test_pipelined_loss_and_grads_equal_torch_pipelining_on_the_same_split(step):
    assert check_step(**step)  # True: torch ran it too


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("P, M", [(1, 1), (2, 1), (3, 2), (4, 1), (4, 3)])
def test_fewer_microbatches_than_stages_and_a_single_stage_still_train_exactly(P, M, name):
    check_step(4, list(range(P)), None, P * 10 + M, [3, 5, 4, 2], True, 2, M, name, "mse")


def step_on_a_batch(batch, n_microbatches, first_has_inputs=True):
    """Inputs only on the first stage, targets only on the last: the middle must still reject alike."""
    P, s = dist.get_world_size(), dist.get_rank()
    stage = pipeline_stage(nn.Sequential(*[nn.Linear(2, 2) for _ in range(P)]).to(device()))
    x, y = torch.randn(batch, 2, device=device()), torch.randn(batch, 2, device=device())
    return pipeline_step(stage, gpipe_schedule(P, n_microbatches), x if s == 0 and first_has_inputs else None,
                         y if s == P - 1 else None, nn.MSELoss())[0]


def stage_of_two_layers():
    return pipeline_stage(nn.Sequential(nn.Linear(2, 2), nn.Tanh()))


@pytest.mark.parametrize("args, error", [((10, 4), "a batch of 10 inputs and 10 targets cannot be cut into 4 "
                                                    "equal microbatches"),
                                         ((12, 4, False), "the first stage needs `inputs`")])
def test_every_rank_rejects_a_bad_batch_alike_and_none_hangs(args, error):
    with pytest.raises(RankFailure) as info:
        run(3, step_on_a_batch, *args)
    for rank in range(3):
        assert f"rank {rank} failed: ValueError: {error}" in str(info.value)
    assert run(3, step_on_a_batch, 12, 4)[2] is not None  # the pool stayed in step


def test_every_rank_rejects_more_stages_than_layers():
    with pytest.raises(RankFailure) as info:
        run(3, stage_of_two_layers)
    for rank in range(3):
        assert f"rank {rank} failed: ValueError: cannot cut 2 layers into 3 pipeline" in str(info.value)
