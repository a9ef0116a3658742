"""The all-to-alls with gradients (mini_dist/all_to_all.py) equal the one-process permutation they stand for.

all_to_all along any two dims of a 3-d tensor, on a subgroup, redone in one process with autograd on everyone's
inputs and weights: outputs and gradients equal (small integers in fp64: nothing to round), and the payload
counted is (T-1)/T of the rank's tensor each way. The row all-to-all (uneven counts, MoE's dispatch) against a
direct permutation of rows, and the demo's two round trips on every world size.
"""
import torch
import torch.distributed as dist
from hypothesis import given, strategies as st

from harness import device, rank_generator, run, subgroup
from mini_dist import all_to_all as a2a


def permuted(seed, shape, scatter_dim, gather_dim, group_size):
    """all_to_all(x, scatter_dim, gather_dim) on the first group_size ranks, against one process: (the output
    equal, the gradient equal, the payload counted, x's bytes); None on a rank outside the group."""
    group = subgroup(range(group_size))
    if dist.get_rank() >= group_size:
        return None
    T = group_size
    r = dist.get_rank(group)
    g = rank_generator(seed)
    x = torch.randint(-8, 8, shape, generator=g, dtype=torch.float64).to(device()).requires_grad_()
    a2a.COUNTER.reset()
    y = a2a.all_to_all(x, scatter_dim, gather_dim, group)
    w = torch.randint(-8, 8, y.shape, generator=g, dtype=torch.float64).to(device())
    (y * w).sum().backward()
    X = [t.requires_grad_() for t in a2a.everyones(x.detach(), group)]
    W = a2a.everyones(w, group)
    Y = [torch.cat([Xj.chunk(T, scatter_dim)[q] for Xj in X], gather_dim) for q in range(T)]  # rank q's output
    sum((Yq * Wq).sum() for Yq, Wq in zip(Y, W)).backward()
    return torch.equal(y, Y[r]), torch.equal(x.grad, X[r].grad), a2a.COUNTER.bytes["all_to_all"], x.nbytes


@given(world=st.integers(1, 5), data=st.data(), seed=st.integers(0, 100))
def test_all_to_all_is_the_one_process_permutation_and_its_gradient_the_inverse_for_any_two_dims(world, data, seed):
    T = data.draw(st.integers(1, world))
    scatter_dim, gather_dim = data.draw(st.permutations([0, 1, 2]))[:2]
    shape = [data.draw(st.integers(1, 3)) for _ in range(3)]
    shape[scatter_dim] *= T  # every rank's block along the scattered dim is the same size
    for result in run(world, permuted, seed, tuple(shape), scatter_dim, gather_dim, T)[:T]:
        forward, backward, nbytes, D = result
        assert forward and backward, result
        assert nbytes == 2 * (T - 1) * D // T  # (T-1)/T of the rank's tensor leaves it, forward and backward


def rows_round_trip(counts_seed, width):
    """Rank r sends send[j] rows to rank j (some zero); the rows land where a direct permutation puts them,
    and the gradient of each sent row is the weight its receiver gave it."""
    T = dist.get_world_size()
    r = dist.get_rank()
    g = torch.Generator().manual_seed(counts_seed * 31 + r)
    send = torch.randint(0, 3, (T,), generator=g).tolist()  # cpu: row counts, a list
    table = [torch.empty(T, dtype=torch.int64, device=device()) for _ in range(T)]
    dist.all_gather(table, torch.tensor(send, device=device()))
    recv = [int(table[j][r]) for j in range(T)]
    x = (torch.arange(sum(send) * width, dtype=torch.float64).view(-1, width) + 1000 * r).to(device())
    x.requires_grad_()
    y = a2a.all_to_all_rows(x, send, recv)
    w = torch.randn(y.shape, dtype=torch.float64, generator=g).to(device())
    (y * w).sum().backward()
    # the reference: everyone's rows and weights, permuted in one process
    everyone = [None] * T
    dist.all_gather_object(everyone, (x.detach().cpu(), send, w.cpu(), recv))
    mine = torch.cat([everyone[j][0][sum(everyone[j][1][:r]):sum(everyone[j][1][:r + 1])] for j in range(T)])
    # my rows that went to rank j sit at offset sum(recv_j[:r]) of rank j's output; their gradient is rank j's w there
    back = torch.cat([everyone[j][2][sum(everyone[j][3][:r]):sum(everyone[j][3][:r + 1])] for j in range(T)])
    return torch.equal(y.detach().cpu(), mine), torch.equal(x.grad.cpu(), back)


@given(world=st.integers(1, 5), seed=st.integers(0, 100), width=st.integers(1, 4))
def test_row_all_to_all_moves_rows_to_their_ranks_and_gradients_back(world, seed, width):
    assert all(ok == (True, True) for ok in run(world, rows_round_trip, seed, width))


def both_round_trips(seq, heads):
    trip = a2a.ulysses_round_trip(seq, heads)
    return trip.forward_ok, trip.backward_ok, trip.nbytes, trip.before.nbytes, a2a.rows_round_trip()


@given(world=st.integers(1, 5), seq=st.integers(1, 3), heads=st.integers(1, 3))
def test_the_demos_round_trips_hold_on_any_world_size(world, seq, heads):
    for forward, backward, nbytes, D, rows in run(world, both_round_trips, seq, heads):
        assert forward and backward and rows
        assert nbytes == 2 * (world - 1) * D // world
