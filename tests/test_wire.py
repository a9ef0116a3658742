"""The kit's wire (mini_dist/kit/wire.py): every message through one layer, counted in one ledger, a lost peer named.

- the ledger's bytes equal the formulas for each user: the rings (2(N-1)/N D), ring attention (2(C-1)/C |K|
  forward, 4(C-1)/C |K| backward), the pipeline (M activations each way and one shape header), the expert
  all-to-all (its payload once); the collectives count into the same ledger; MINI_DIST_DEBUG's traffic (the
  pools run with it on) is never counted;
- a peer that exits is named whether the send or receive fails as it is posted or while it is waited for (and
  when no rank of the world failed, the peer itself, as lost or as waited for until the timeout);
- a label is formatted only when a line is asked for (VERBOSE=1) or a peer is lost; watchers see every message
  and collective, peers as global ranks.
"""
import os
import re
import time

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings, strategies as st
from torch import nn

from harness import RankFailure, device, rank_generator, run, subgroup
from mini_dist import collectives, comm, expert_parallel
from mini_dist import context_parallel as cp
from mini_dist import ring_allreduce as ra
from mini_dist import ring_pipelined as rp
from mini_dist import sequence_layout as sl
from mini_dist.kit import debug, launch, wire
from mini_dist.pipeline_executor import pipeline_step
from mini_dist.pipeline_messages import HEADER_LEN
from mini_dist.pipeline_schedules import SCHEDULES


def ledger():
    return {"calls": dict(wire.LEDGER.calls), "bytes": dict(wire.LEDGER.bytes), "sent": dict(wire.LEDGER.sent_by),
            "received": dict(wire.LEDGER.received_by)}


# ----- bytes: the ledger against each user's formula -----

def ring_ledger(which, numel):
    wire.LEDGER.reset()
    {"textbook": ra.ring_all_reduce, "pipelined": rp.ring_all_reduce}[which](torch.ones(numel, device=device()))
    return ledger()


@settings(max_examples=10)
@given(world=st.integers(1, 5), numel=st.integers(0, 3000), which=st.sampled_from(["textbook", "pipelined"]))
def test_the_rings_bytes_in_the_ledger_are_2_n_minus_1_over_n_d_all_of_kind_ring(world, numel, which):
    D = 4 * numel
    seen = run(world, ring_ledger, which, numel)
    for mine in seen:  # debug mode is on in the pools: the textbook's size checks are not counted
        assert set(mine["sent"]) | set(mine["received"]) <= {"ring"} and mine["bytes"] == mine["sent"]
    assert sum(m["sent"].get("ring", 0) for m in seen) == sum(m["received"].get("ring", 0) for m in seen)
    assert sum(m["sent"].get("ring", 0) for m in seen) == 2 * (world - 1) * D
    if numel % (2 * world) == 0 and D <= ra.GLOO_SEGMENT_BYTES:  # equal chunks: every rank the same
        assert {m["sent"].get("ring", 0) for m in seen} == {2 * (world - 1) * D // world}


def collective_and_ring():
    wire.LEDGER.reset()
    x = torch.ones(10, device=device())
    comm.all_reduce(x)
    rp.ring_all_reduce(x.clone())
    return ledger(), collectives.COUNTER is wire.LEDGER is comm.COUNTER


def test_collectives_count_into_the_same_ledger_as_messages_by_payload_not_as_bytes_sent():
    for mine, one in run(3, collective_and_ring):
        assert one and mine["calls"]["all_reduce"] == 1 and mine["bytes"]["all_reduce"] == 40
        assert set(mine["sent"]) == {"ring"} and mine["bytes"]["ring"] == mine["sent"]["ring"]


def attention_ledger(C, causal):
    q, k, v, dout = (sl.split_sequence(t) for t in cp_sequence(C))
    wire.LEDGER.reset()
    out = cp.ring_attention(q.requires_grad_(), k, v, causal=causal)
    forward = ledger()
    wire.LEDGER.reset()
    out.backward(dout)
    return forward, ledger()


def cp_sequence(C, b=1, H=2, d=3):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(b, H, 4 * C, d, dtype=torch.float64, generator=g).to(device()) for _ in range(4)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("C", [1, 2, 3, 4])
def test_ring_attentions_bytes_in_the_ledger_are_2_and_4_c_minus_1_over_c_of_k(C, causal):
    K = 1 * 4 * C * 2 * 3 * 8  # |K| = b S H d e
    for forward, backward in run(C, attention_ledger, C, causal):
        for mine, times in ((forward, 2), (backward, 4)):
            want = times * (C - 1) * K // C
            assert mine["bytes"].get("ring attention", 0) == want
            assert mine["sent"].get("ring attention", 0) == mine["received"].get("ring attention", 0) == want
            assert set(mine["sent"]) <= {"ring attention"}  # nothing else travelled, nothing counted twice


def pipeline_ledger(M, width):
    P = dist.get_world_size()
    torch.manual_seed(0)
    stage = nn.Linear(width, width).to(device(), torch.float64)
    x = torch.randn(2 * M, width, dtype=torch.float64, device=device())
    wire.LEDGER.reset()
    _, stats = pipeline_step(stage, SCHEDULES["1f1b"](P, M), x, x, nn.MSELoss())
    return ledger(), stats.bytes_sent


@pytest.mark.parametrize("P, M", [(2, 1), (3, 4), (4, 3)])
def test_the_pipelines_bytes_in_the_ledger_are_m_activations_each_way_and_one_header(P, M):
    act = 2 * 5 * 8  # a microbatch: 2 rows of 5 fp64
    for s, (mine, stats_sent) in enumerate(run(P, pipeline_ledger, M, 5)):
        want = (s < P - 1) * (M * act + 8 * HEADER_LEN) + (s > 0) * M * act
        assert mine["bytes"].get("pipeline", 0) == mine["sent"].get("pipeline", 0) == stats_sent == want
        assert set(mine["sent"]) <= {"pipeline"}  # the debug mode's header on every message: not counted


def all_to_all_ledger(counts):
    me, W = dist.get_rank(), dist.get_world_size()
    x = torch.randn(sum(counts[me]), 3, generator=rank_generator(0)).to(device())
    wire.LEDGER.reset()
    comm.all_to_all_rows(x, counts[me], [counts[j][me] for j in range(W)], None, expert_parallel.p2p_all_to_all)
    return ledger()


def test_the_expert_all_to_all_counts_its_payload_once_and_its_messages_as_bytes_sent():
    counts = [[1, 2, 0], [3, 0, 2], [0, 4, 1]]  # counts[i][j]: rows rank i sends rank j
    for me, mine in enumerate(run(3, all_to_all_ledger, counts)):
        to_others = sum(counts[me]) - counts[me][me]
        assert mine["calls"] == {"all_to_all": 1} and mine["bytes"] == {"all_to_all": to_others * 12}
        assert mine["sent"] == {None: to_others * 12}
        assert mine["received"] == {None: sum(counts[j][me] for j in range(3) if j != me) * 12}


# ----- a lost peer, named -----

def lose_the_peer(at, how):
    """Ranks 0 and 1 exchange once; then rank 1 exits without a word, before rank 0 posts its next send or
    receive (at "post"), or after rank 0 posted it (at "wait")."""
    me = dist.get_rank()
    store = dist.distributed_c10d._get_default_store()
    buf = torch.zeros(4, device=device())
    wire.send_recv(buf, 1 - me, torch.zeros(4, device=device()), 1 - me, None, "first exchange")
    if me == 1:
        if at == "wait":
            store.wait([f"test_wire/{how}/posted"])
        os._exit(0)
    if at == "post":
        time.sleep(2.0)  # the exit closed rank 1's sockets; gloo finds the pair closed as it posts
    if how == "batch":  # (send_recv's batch, without debug mode's size check first)
        posted = wire.batch([(wire.SEND, buf, 1), (wire.RECV, torch.zeros(4, device=device()), 1)], None, "a test step")
    else:
        posted = [(wire.irecv if how == "irecv" else wire.isend)(buf, 1, None, f"a test {how}")]
    store.set(f"test_wire/{how}/posted", "1")
    for message in posted:
        wire.wait(message)


@pytest.mark.parametrize("how", ["irecv", "isend", "batch"])
@pytest.mark.parametrize("at", ["post", "wait"])
def test_a_peer_that_exits_is_named_whether_the_message_fails_as_posted_or_while_waited_for(at, how):
    with pytest.raises(RankFailure) as info:
        run(2, lose_the_peer, at, how, timeout=60)
    text = str(info.value)
    assert "rank 1 failed: died (exit code 0)" in text
    doing = {"irecv": "receiving from it", "isend": "sending to it", "batch": "(posting a batch|sending to it|"
             "receiving from it)"}[how]
    assert re.search(rf"rank 0 failed: PeerLost: a test \w+, {doing}: lost rank 1 \(it vanished: .*\)\. Rank 0 "
                     rf"stopped after losing rank 1; look for the first error in rank 1's log \(.*Connection "
                     rf"(closed|reset) by peer", text), text
    where = text[text.index("rank 0 failed"):]
    assert (", in _post" in where or ", in batch" in where) == (at == "post"), where  # the wire raised it there


class FailingWork:
    def __init__(self, error="Connection reset by peer\n(gloo details)"):
        self.error = error

    def wait(self):
        raise RuntimeError(self.error)


@pytest.mark.single_process
def test_a_failed_wait_names_the_peer_and_where_to_look():
    with pytest.raises(debug.PeerLost, match=r"ring step 3, sending to it: lost rank 7 \(Connection reset by peer\); "
                                             r"look for the first error in rank 7's log"):
        wire.wait((FailingWork(), wire.SEND, 7, None, "ring step 3"))


@pytest.mark.single_process
def test_a_peer_that_stays_silent_until_the_timeout_is_named_as_a_wait_not_a_loss():
    with pytest.raises(debug.PeerLost, match=r"ring step 3, receiving from it: waited for rank 7 until the group's "
                                             r"timeout \(\[x.cc:78\] Timed out waiting 10000ms for recv operation to "
                                             r"complete\): rank 7 never posted the matching operation"):
        wire.wait((FailingWork("[x.cc:78] Timed out waiting 10000ms for recv operation to complete"), wire.RECV, 7,
                   None, "ring step 3"))


# ----- what the wire formats, and whom it tells -----

class Unprintable:
    """A label that fails the moment anything formats it."""

    def __str__(self):
        raise AssertionError("the wire formatted a label that no one asked to see")

    __format__ = __repr__ = __str__


def step_with_label(label, verbose):
    me, n = dist.get_rank(), dist.get_world_size()
    lines, saved = [], (launch.VERBOSE, launch.trace)
    launch.VERBOSE, launch.trace = verbose, lines.append
    try:
        x = torch.ones(3, device=device())
        wire.send_recv(x, (me - 1) % n, torch.empty(3, device=device()), (me + 1) % n, None, label)  # a batch
        posted = [wire.irecv(torch.empty(3, device=device()), (me + 1) % n, None, label),
                  wire.isend(x, (me - 1) % n, None, label)]  # one at a time
        for message in posted:
            wire.wait(message)
    finally:
        launch.VERBOSE, launch.trace = saved
    return lines


def test_a_label_is_formatted_only_for_a_verbose_line_one_per_message():
    assert run(3, step_with_label, Unprintable(), False) == [[]] * 3
    for me, lines in enumerate(run(3, step_with_label, "ring step", True)):
        one_step = [f"ring step: send 12 B -> rank {(me - 1) % 3}", f"ring step: receive 12 B <- rank {(me + 1) % 3}"]
        assert lines == one_step + one_step[::-1]  # debug mode's size check before the batch: not shown


def watched(ranks):
    group = subgroup(ranks)
    if dist.get_rank() not in ranks:
        return None
    seen = []

    def watcher(event, peer, grp, nbytes, kind, label):
        seen.append((event, peer, nbytes, kind, label))
    wire.LEDGER.watchers.append(watcher)
    try:
        rp.ring_all_reduce(torch.ones(8, device=device()), group=group)  # N = 2: one exchange of 32 B each way
        comm.all_gather(torch.ones(2, device=device()), 0, group)
    finally:
        wire.LEDGER.watchers.remove(watcher)
    return seen


def test_watchers_see_every_counted_message_and_collective_with_global_peers_and_no_debug_traffic():
    results = run(3, watched, [0, 2])
    assert results[1] is None
    for me, peer in ((0, 2), (2, 0)):
        assert results[me] == [("recv", peer, 32, "ring", "ring_all_reduce"),
                               ("send", peer, 32, "ring", "ring_all_reduce"),
                               ("all_gather", None, 16, "all_gather", None)]


def one_step_with_sizes(sent_by, expected_by):
    """One ring step where rank r sends sent_by[r] elements to its left and expects expected_by[r] from its right."""
    r, n = dist.get_rank(), dist.get_world_size()
    send = torch.ones(sent_by[r], device=device())
    wire.send_recv(send, (r - 1) % n, torch.empty(expected_by[r], device=device()), (r + 1) % n, None, "ring step")
    return "ok"


@pytest.mark.parametrize("world, sent_by, expected_by, named", [
    (2, [3, 2], [2, 2], ["rank 0 sends 3 elements to rank 1, which expects 2",
                         "rank 1 expects 2 elements from rank 0, which sends 3"]),
    (3, [1, 0, 1], [1, 1, 1], ["rank 1 sends 0 elements to rank 0, which expects 1",  # an empty piece stays home
                               "rank 0 expects 1 elements from rank 1, which sends 0"])])
def test_in_debug_mode_pieces_of_different_sizes_fail_at_once_on_both_ends_named(world, sent_by, expected_by, named):
    # the pools run with MINI_DIST_DEBUG=1; without the size exchange the receive would wait out the timeout
    with pytest.raises(RankFailure) as info:
        run(world, one_step_with_sizes, sent_by, expected_by)
    for line in named:
        assert f"Disagreement: ring step: {line}: the two ranks mean different pieces" in str(info.value)
    assert run(world, one_step_with_sizes, sent_by, sent_by[1:] + sent_by[:1]) == ["ok"] * world  # matching sizes
