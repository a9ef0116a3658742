"""The textbook pipeline step (mini_dist/pipeline.py): GPipe and 1F1B as loops equal single-process training on
the whole batch, the executor running the same schedule as data (bit for bit), and torch.distributed.pipelining's
ScheduleGPipe and Schedule1F1B, for drawn stage counts (subgroups of the 4-rank pool), microbatch counts, widths,
cuts and losses; each loop computes in the order pipeline_schedules writes as data; the bytes and messages are
M activations each way between neighbours. Under NCCL's in-order rule (replayed by nccl_order) both steps
complete, and 1F1B's steady state written as two calls, send then receive, is a cycle.

The helpers that redo a step in one process are shared with test_pipeline_executor.py."""
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from harness import device, rank_generator, run, subgroup
from mini_dist import nccl_order, pipeline
from mini_dist.kit import debug, wire
from mini_dist.kit.references import torch_step
from mini_dist.pipeline import STEPS, what_flows_between_stages
from mini_dist.pipeline_executor import pipeline_step
from mini_dist.pipeline_schedules import SCHEDULES, gpipe_stage, one_f_one_b_stage
from mini_dist.pipeline_stages import pipeline_chunks, split_model

ORDERS = {"GPipe": ("gpipe", gpipe_stage), "1F1B": ("1f1b", one_f_one_b_stage)}  # the same step as data


# ----- a step, redone in one process -----

def build_model(seed, widths, frozen):
    """Linear+Tanh blocks; `frozen` freezes the first Linear (a first stage may need no backward)."""
    torch.manual_seed(seed)
    layers = []
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        layers.append(nn.Linear(a, b))  # cpu: drawn here, moved below
        if i < len(widths) - 2:
            layers.append(nn.Tanh())
    model = nn.Sequential(*layers).double().to(device())
    model[0].requires_grad_(not frozen)
    return model


def make_loss(kind):
    return nn.MSELoss() if kind == "mse" else nn.CrossEntropyLoss()


def draw_batch(seed, widths, batch, kind):
    g = rank_generator(seed)  # each rank its own data: only stage 0's inputs and stage P-1's targets count
    x = torch.randn(batch, widths[0], generator=g, dtype=torch.float64).to(device())
    if kind == "mse":
        y = torch.randn(batch, widths[-1], generator=g, dtype=torch.float64).to(device())
    else:
        y = torch.randint(widths[-1], (batch,), generator=g).to(device())
    return x, y


def grads_by_index(model, chunks):
    index = {id(p): i for i, p in enumerate(model.parameters())}
    return {index[id(p)]: p.grad.cpu() for c in chunks for p in c.parameters() if p.grad is not None}


def full_batch(seed, widths, frozen, kind, x, y):
    """Single-process training on the whole batch. Also the size of what its sums add up, sample by
    sample: a float sum's rounding error is bounded by eps times the sum of |terms|, which cancellation
    can make much larger than |sum|."""
    model = build_model(seed, widths, frozen).cpu()
    loss_fn = make_loss(kind)
    loss = loss_fn(model(x), y)
    loss.backward()
    grads = {i: p.grad.clone() for i, p in enumerate(model.parameters()) if p.grad is not None}
    loss_terms = 0.0
    grad_terms = {i: torch.zeros_like(g) for i, g in grads.items()}
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
    bound = 2 * roundings * torch.finfo(torch.float64).eps * torch.as_tensor(terms)  # cpu: beside the reference
    difference = (torch.as_tensor(actual).cpu() - expected).abs()  # cpu: the reference's side
    assert (difference <= bound).all(), f"difference {difference.max():.3g} > bound {bound.max():.3g}"


# ----- the textbook step on ranks, beside the executor and torch -----

def recording(layers, order):
    """Hooks that append ("forward", m, 0) to `order` as layers runs microbatch m forward, and ("backward", m, 0)
    as the gradient of that output arrives (microbatches go forward in order 0, 1, ...)."""
    def forward_hook(module, inputs, output):
        m = sum(1 for op, _, _ in order if op == "forward")
        order.append(("forward", m, 0))
        output.register_hook(lambda grad: order.append(("backward", m, 0)))
    return layers.register_forward_hook(forward_hook)


def textbook(seed, widths, batch, M, name, sizes, kind, ranks):
    """The textbook step `name` on the ranks `ranks` (the default group if that is all of them), then the
    executor's step of the same schedule, then torch's where it runs (M >= P for Schedule1F1B)."""
    group = subgroup(ranks) if len(ranks) < dist.get_world_size() else None
    if dist.get_rank() not in ranks:
        return None
    P = len(ranks)
    s = dist.get_rank(group)
    model = build_model(seed, widths, False)
    x, y = draw_batch(seed, widths, batch, kind)
    chunks = pipeline_chunks(model, group, 1, sizes)
    with torch.no_grad():  # the shape of a microbatch's activation as it arrives at this stage
        arriving = x[:batch // M]
        for stage in split_model(model, P, sizes)[:s]:
            arriving = stage(arriving)
    step, schedule = STEPS[name]
    order = []
    hooks = recording(chunks[0], order)
    loss = step(chunks[0], x, y, make_loss(kind), M, arriving.shape, torch.float64, group)
    hooks.remove()
    result = dict(stage=s, loss=loss, grads=grads_by_index(model, chunks), order=order, x=x.cpu(), y=y.cpu())
    model.zero_grad()
    result["executor_loss"], _ = pipeline_step(chunks, SCHEDULES[ORDERS[name][0]](P, M), x, y, make_loss(kind), group)
    result["executor_grads"] = grads_by_index(model, chunks)
    if name == "GPipe" or M >= P:  # torch's Schedule1F1B refuses M < P
        model.zero_grad()
        result["torch_loss"] = torch_step(chunks, schedule, M, make_loss(kind), group)(x, y)
        result["torch_grads"] = grads_by_index(model, chunks)
    return result


def check_textbook(name, ranks, M, widths, mb_size, sizes, kind, seed):
    """The textbook step = one process (up to rounding) = the executor (bit for bit) = torch's schedule (bit for
    bit where 1/M is exact, else up to rounding), and each stage computes in the order of its schedule as data."""
    P = len(ranks)
    results = run(4, textbook, seed, widths, M * mb_size, M, name, sizes, kind, ranks)
    results = sorted((r for r in results if r is not None), key=lambda r: r["stage"])
    x = results[0]["x"]  # stage 0's inputs and stage P-1's targets are the batch
    y = results[-1]["y"]
    (loss, loss_terms), grads = full_batch(seed, widths, False, kind, x, y)
    roundings = len(x) + 2 * sum(widths)  # the batch's sum, and an inner product per Linear each way
    last = results[-1]
    assert_equal_up_to_rounding(last["loss"], loss, loss_terms, roundings)
    assert torch.equal(last["loss"], last["executor_loss"])  # the same operations in the same order
    if "torch_loss" in last:
        assert_equal_up_to_rounding(last["loss"], last["torch_loss"], loss_terms, roundings)
    assert sorted(i for r in results for i in r["grads"]) == sorted(grads)  # each parameter on one stage
    for r in results:
        assert r["order"] == ORDERS[name][1](r["stage"], P, M), f"{name} stage {r['stage']} of P={P}, M={M}"
        for i, g in r["grads"].items():
            assert_equal_up_to_rounding(g, grads[i][0], grads[i][1], roundings)
            assert torch.equal(g, r["executor_grads"][i]), (name, i)
            if "torch_grads" in r:
                if M & (M - 1) == 0:  # 1/M exact and the same operations in the same order: bit for bit
                    assert torch.equal(g, r["torch_grads"][i]), (name, i)
                assert_equal_up_to_rounding(g, r["torch_grads"][i], grads[i][1], roundings)


@settings(max_examples=15)
@given(name=st.sampled_from(sorted(STEPS)), P=st.integers(1, 4), M=st.integers(1, 8),
       widths=st.lists(st.integers(1, 6), min_size=3, max_size=6), mb_size=st.integers(1, 3), cut=st.booleans(),
       kind=st.sampled_from(["mse", "cross_entropy"]), seed=st.integers(0, 2 ** 16), data=st.data())
def test_the_textbook_step_equals_one_process_the_executor_and_torchs_schedule(name, P, M, widths, mb_size, cut,
                                                                                kind, seed, data):
    n_layers = 2 * len(widths) - 3
    P = min(P, n_layers)
    ranks = sorted(data.draw(st.permutations(range(4)))[:P])  # a subgroup, its ranks not always 0..P-1
    sizes = None  # the balanced cut
    if cut:
        cuts = sorted(data.draw(st.sets(st.integers(1, n_layers - 1), min_size=P - 1, max_size=P - 1)))
        sizes = [b - a for a, b in zip([0, *cuts], [*cuts, n_layers])]
    check_textbook(name, ranks, M, widths, mb_size, sizes, kind, seed)


@pytest.mark.parametrize("name", sorted(STEPS))
@pytest.mark.parametrize("P, M", [(4, 8), (4, 3), (3, 5), (1, 2)])
def test_the_textbook_step_on_every_rank_with_fewer_or_more_microbatches_than_stages(P, M, name):
    check_textbook(name, list(range(P)), M, [3, 5, 4, 2, 3], 2, None, "mse", 10 * P + M)


def flows(P, M, width):
    group = subgroup(range(P)) if P < dist.get_world_size() else None
    return what_flows_between_stages(M, width, group) if dist.get_rank() < P else None


@settings(max_examples=8)
@given(P=st.integers(1, 4), M=st.integers(1, 6), width=st.integers(1, 5))
def test_only_neighbours_talk_and_each_stage_sends_m_activations_each_way(P, M, width):
    for figure, holds in run(4, flows, P, M, width)[:P]:
        assert holds, figure


# ----- NCCL runs a rank's messages in the order posted -----

def send_then_receive_gradient(self, y, m, y_k, k):
    """1F1B's steady state as two operations, as a first try writes it: post the send of activation m, then
    receive the gradient of microbatch k. (Were the send waited for before the receive is posted, gloo would
    hang as well: its send waits for the receive.)"""
    if self.after is None:
        return None
    sending = wire.isend(y.detach(), self.after, self.group, f"activation {m}", "pipeline")
    dy = torch.empty_like(y_k)
    wire.wait(wire.irecv(dy, self.after, self.group, f"gradient {k}", "pipeline"))
    wire.wait(sending)
    return dy


def send_then_receive_activation(self, dx, k, m):
    if self.before is None:
        return self.inputs[m]
    sending = wire.isend(dx, self.before, self.group, f"gradient {k}", "pipeline")
    x = torch.empty(self.shape, dtype=self.dtype, device=device())
    wire.wait(wire.irecv(x, self.before, self.group, f"activation {m}", "pipeline"))
    wire.wait(sending)
    return x.requires_grad_()


def replayed(name, M, two_calls, headers):
    """One textbook step on every rank, recorded on gloo and replayed under NCCL's rule: the cycles found.
    `two_calls`: the steady state's send and receive as two calls; `headers`: MINI_DIST_DEBUG=1's size checks."""
    P = dist.get_world_size()
    widths = [3] * (P + 1)  # P Linear layers: one a stage
    model = build_model(0, widths, False)
    x, y = draw_batch(0, widths, 2 * M, "mse")
    saved = (pipeline.Stage.send_forward_recv_backward, pipeline.Stage.send_backward_recv_forward, debug.DEBUG)
    if two_calls:
        pipeline.Stage.send_forward_recv_backward = send_then_receive_gradient
        pipeline.Stage.send_backward_recv_forward = send_then_receive_activation
    debug.DEBUG = headers
    try:
        step = STEPS[name][0]
        return nccl_order.check(step, pipeline_chunks(model)[0], x, y, nn.MSELoss(), M, (2, 3), torch.float64)
    finally:
        pipeline.Stage.send_forward_recv_backward, pipeline.Stage.send_backward_recv_forward, debug.DEBUG = saved


@pytest.mark.parametrize("name", sorted(STEPS))
@pytest.mark.parametrize("world, M, headers", [(2, 1, True), (2, 5, False), (3, 2, False), (3, 7, True),
                                               (5, 3, True), (5, 9, False)])
def test_the_textbook_steps_complete_under_nccls_in_order_rule(world, M, headers, name):
    assert run(world, replayed, name, M, False, headers) == [[]] * world


@pytest.mark.parametrize("world, M", [(2, 2), (3, 6), (5, 7)])
def test_1f1b_whose_steady_state_sends_then_receives_in_two_calls_is_a_cycle_under_nccls_rule(world, M):
    """The lesson of the batch: stage s sends activation m to s+1 while s+1 sends the gradient of microbatch k
    back, each in a send whose receive the other posted behind it. (gloo runs it: there a posted send does
    not hold up the receive posted after it.)"""
    cycles = run(world, replayed, "1F1B", M, True, False)
    first = cycles[0]
    assert first and all(cycle == first for cycle in cycles), cycles
    stuck = [int(rank) for line in first for rank in line.split()[1:2]]
    assert len(stuck) == 2 and abs(stuck[0] - stuck[1]) == 1, first  # two neighbours
    assert all(" is in isend to rank " in line for line in first), first  # both in a send

