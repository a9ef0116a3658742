"""The trace (mini_dist/kit/trace.py, kit/trace_events.py): one file of every rank's run, as Perfetto reads it.

- the file follows the Trace Event Format: one process per rank named "rank r", every slice closed and nested
  in its track, timestamps in order per track, every flight begun and ended, every flow with both ends, the
  send on the sender's slice that names the receiver, the receive on the receiver's slice that names the sender;
- the ring: each rank sends 2(N-1) steps, each to its left neighbour, each met by that neighbour's receive;
- 1F1B: each rank's forward and backward slices come in the schedule's order (the textbook loops and the
  executor of the schedule as data);
- DDP: the first bucket's all-reduce starts before backward ends with buckets, while the last bucket still
  fills, and after backward without;
- bytes in the trace = the wire's ledger's, by kind, sent, received and collective payloads;
- torch.profiler's events land under the same ranks, on the same clock (its collective inside ours);
- `./run.sh demo ... --trace PATH` writes such a file; once a recording ends, nothing records or watches.
"""
import json

import pytest
import torch
import torch.distributed as dist
from torch import nn

from harness import device, rank_generator, run
from mini_dist import collectives, ddp, expert_parallel, pipeline, ring_allreduce, ring_pipelined
from mini_dist.kit import models, trace, wire
from mini_dist.pipeline_actions import COMPUTE
from mini_dist.pipeline_executor import pipeline_step
from mini_dist.pipeline_schedules import SCHEDULES
from mini_dist.pipeline_stages import pipeline_chunks
from test_cli import run_sh


# ----- the format, as the Trace Event Format's readers (Perfetto, chrome://tracing) take it -----

def enclosing(slices: list, point: float):
    """The innermost slice of a track around `point` (None if none)."""
    around = [e for e in slices if e["ts"] <= point <= e["ts"] + e["dur"]]
    return min(around, key=lambda e: e["dur"]) if around else None


def check_format(made: dict, world: int) -> list:
    """Assert the file is a well-formed trace of `world` ranks; returns its events."""
    events = json.loads(json.dumps(made))["traceEvents"]  # what the file holds, after JSON
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {r: f"rank {r}" for r in range(world)}, names
    assert all(e["ph"] in "MXibesf" and e["pid"] in names for e in events), {e["ph"] for e in events}
    tracks = {}
    for e in events:
        if e["ph"] != "M" and e["ph"] not in "be":
            tracks.setdefault((e["pid"], e["tid"]), []).append(e)
    for track, held in tracks.items():
        assert [e["ts"] for e in held] == sorted(e["ts"] for e in held), f"track {track}: timestamps out of order"
        ends = []  # the ends of the slices open at this point: each slice inside the one before it
        for e in (e for e in held if e["ph"] == "X"):
            assert e["dur"] >= 0, e
            while ends and ends[-1] <= e["ts"] + 1e-6:  # a slice that ends as the next begins: a sibling
                ends.pop()
            assert not ends or e["ts"] + e["dur"] <= ends[-1] + 1e-6, f"track {track}: {e['name']} overlaps its parent"
            ends.append(e["ts"] + e["dur"])
    for phases in ("be", "sf"):
        ids = {}
        for e in events:
            if e["ph"] in phases:
                ids.setdefault(e["id"], []).append(e)
        for i, ends in ids.items():
            assert sorted(e["ph"] for e in ends) == sorted(phases), f"{phases} id {i}: {ends}"
    for i, ends in ((i, [e for e in events if e["ph"] in "sf" and e["id"] == i]) for i in
                    {e["id"] for e in events if e["ph"] == "s"}):
        start, finish = sorted(ends, key=lambda e: e["ph"] != "s")
        sent = enclosing([e for e in tracks[start["pid"], start["tid"]] if e["ph"] == "X"], start["ts"])
        got = enclosing([e for e in tracks[finish["pid"], finish["tid"]] if e["ph"] == "X"], finish["ts"])
        assert sent["name"].startswith("send") and sent["args"]["peer"] == finish["pid"], (sent, finish)
        assert start["pid"] in got["args"].get("peers", [got["args"].get("peer")]), (got, start)
    return events


def slices(events: list, pid: int, prefix: str = "") -> list:
    return [e for e in events if e["ph"] == "X" and e["pid"] == pid and e["name"].startswith(prefix)]


def traced(fn, *args):
    """fn(*args) on every rank, recorded; -> (the trace on rank 0, else None; this rank's ledger)."""
    wire.LEDGER.reset()
    with trace.recording() as records:
        fn(*args)
    ledger = {"sent": dict(wire.LEDGER.sent_by), "received": dict(wire.LEDGER.received_by),
              "bytes": dict(wire.LEDGER.bytes), "calls": dict(wire.LEDGER.calls)}
    return trace.gather(records), ledger


# ----- what runs on the ranks -----

def many_paths(numel):
    """Every way the wire carries data: the textbook ring (batches), the pipelined ring (receives posted
    ahead), a collective, the expert all-to-all of point-to-point messages, DDP's ring on its own thread."""
    x = torch.randn(numel, generator=rank_generator(1)).to(device())
    ring_allreduce.ring_all_reduce(x.clone())
    ring_pipelined.ring_all_reduce(x.clone())
    collectives.all_reduce(x)
    n = dist.get_world_size()
    rows = torch.randn(2 * n, 3, generator=rank_generator(2)).to(device())
    expert_parallel.p2p_all_to_all(torch.empty_like(rows), rows, [2] * n, [2] * n)
    model = models.mlp([4, 6, 6, 2]).to(device())
    mini = ddp.DistributedDataParallel(model, bucket_cap_mb=0, all_reduce=ring_pipelined.ring_all_reduce)
    models.accumulation_step(mini, torch.optim.SGD(model.parameters(), lr=0.1),
                             [(torch.randn(3, 4, dtype=torch.float64, device=device()),
                               torch.randn(3, 2, dtype=torch.float64, device=device()))])


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_the_file_is_a_trace_of_every_rank_with_nested_slices_and_flows_between_the_right_ranks(world):
    made, _ = run(world, traced, many_paths, 37)[0]
    events = check_format(made, world)
    flows = sum(e["ph"] == "s" for e in events)
    sends = sum(e["ph"] == "X" and e["name"].startswith("send") for e in events)
    assert flows == sends and (world == 1 or flows > 0), (flows, sends)  # every send met its receive


@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_the_rings_ranks_each_send_2_n_minus_1_steps_to_the_left_met_by_the_left_neighbours_receive(world):
    x = torch.ones(6 * world)  # cpu: pickled to the ranks (gloo's device is the CPU); no chunk empty
    made, _ = run(world, traced, ring_allreduce.ring_all_reduce, x)[0]
    events = check_format(made, world)
    ends = {e["id"]: e for e in events if e["ph"] == "f"}
    for r in range(world):
        steps = slices(events, r, "send")
        left = (r - 1) % world
        assert len(steps) == 2 * (world - 1), f"rank {r}: {len(steps)} sends"
        assert {e["args"]["peer"] for e in steps} == {left}, f"rank {r} sent to {[e['args']['peer'] for e in steps]}"
        arrows = [e for e in events if e["ph"] == "s" and e["pid"] == r]
        assert len(arrows) == len(steps) and all(ends[a["id"]]["pid"] == left for a in arrows), f"rank {r}"


def one_f_one_b(executor, M):
    P = dist.get_world_size()
    width = 5
    chunks = pipeline_chunks(models.mlp([width] * (P + 1)))
    x = torch.randn(2 * M, width, dtype=torch.float64, device=device())
    if executor:
        pipeline_step(chunks, SCHEDULES["1f1b"](P, M, 1), x, x, nn.MSELoss())
    else:
        pipeline.one_f_one_b_step(chunks[0], x, x, nn.MSELoss(), M, (2, width), torch.float64)


@pytest.mark.parametrize("world,M,executor", [(2, 3, False), (3, 5, False), (4, 4, True), (3, 6, True)])
def test_1f1b_forward_and_backward_slices_come_in_the_schedules_order_on_every_rank(world, M, executor):
    made, _ = run(world, traced, one_f_one_b, executor, M)[0]
    events = check_format(made, world)
    for r, actions in enumerate(SCHEDULES["1f1b"](world, M, 1).actions):
        want = [f"{a.op} {a.mb}" for a in actions if a.op in COMPUTE]
        seen = [e["name"] for e in slices(events, r) if e["cat"] == trace.COMPUTE and e["name"] in want]
        assert seen == want, f"rank {r}: {seen} != the schedule's {want}"


def ddp_step(bucketed):
    model = models.mlp([8, 32, 32, 32, 4]).to(device())
    wrapped = ddp.DistributedDataParallel(model, bucket_cap_mb=0) if bucketed else ddp.NaiveDataParallel(model)
    x = torch.randn(16, 8, dtype=torch.float64, generator=rank_generator(3)).to(device())
    models.accumulation_step(wrapped, torch.optim.SGD(model.parameters(), lr=0.1), [(x, x[:, :4])])


@pytest.mark.parametrize("world", [2, 3])
def test_ddps_first_bucket_leaves_before_backward_ends_with_buckets_and_after_it_without(world):
    for bucketed in (True, False):
        made, _ = run(world, traced, ddp_step, bucketed)[0]
        events = check_format(made, world)
        for r in range(world):
            # backward ends when autograd has computed the last gradient: the reducer's span ends there, inside
            # loss.backward()'s (which also runs the reducer's end-of-backward callback)
            end = min(e["ts"] + e["dur"] for e in slices(events, r, "backward"))
            first = min((e for e in events if e["ph"] == "b" and e["pid"] == r), key=lambda e: e["ts"])
            assert (first["ts"] < end) == bucketed, f"rank {r}, buckets {bucketed}: {first['name']} at " \
                                                   f"{first['ts']}, backward until {end}"
            ready = [e["ts"] for e in events if e["ph"] == "i" and e["pid"] == r and e["name"].endswith("ready")]
            assert not bucketed or first["ts"] < max(ready), f"rank {r}: the first all-reduce waited for the last " \
                                                             f"bucket ({first['ts']} >= {max(ready)})"


@pytest.mark.parametrize("world", [1, 2, 4])
def test_bytes_in_the_trace_are_the_ledgers_sent_received_and_collective_payloads(world):
    results = run(world, traced, many_paths, 53)
    events = check_format(results[0][0], world)
    for r, (_, ledger) in enumerate(results):
        for what, key in (("send", "sent"), ("post receive", "received")):
            counted = {}
            for e in slices(events, r, what):
                counted[e["args"]["kind"]] = counted.get(e["args"]["kind"], 0) + e["args"]["bytes"]
            assert counted == {k: v for k, v in ledger[key].items() if v}, (r, what, counted, ledger[key])
        called = {}
        for e in (e for e in slices(events, r) if "kind" in e["args"] and e["args"]["kind"] in ledger["calls"]):
            if not e["name"].startswith(("send", "post receive")):
                called[e["args"]["kind"]] = called.get(e["args"]["kind"], 0) + e["args"]["bytes"]
        wanted = {k: v for k, v in ledger["bytes"].items() if k not in ledger["sent"]}
        assert called == wanted, (r, called, ledger["bytes"])


def torch_and_ours(path):
    trace.ask(path, with_torch=True)
    trace.start()
    collectives.all_reduce(torch.ones(1000, device=device()))
    trace.finish()
    trace.ask(None)


def test_torch_profilers_events_land_under_the_same_ranks_on_the_same_clock(tmp_path):
    path = str(tmp_path / "both.json")
    run(2, torch_and_ours, path)
    with open(path) as f:
        events = check_format(json.load(f), 2)
    for r in range(2):
        ours, = slices(events, r, "all_reduce")
        theirs = [e for e in slices(events, r) if e["name"] == "c10d::allreduce_"]
        assert len(theirs) == 1 and theirs[0]["tid"] >= 1000, theirs  # on a track of torch's own
        # torch's call of the collective happens inside ours: on one clock, its slice lies within ours
        assert ours["ts"] <= theirs[0]["ts"] and theirs[0]["ts"] + theirs[0]["dur"] <= ours["ts"] + ours["dur"], \
            (r, ours, theirs)


def ping():
    peer = 1 - dist.get_rank()
    wire.send_recv(torch.ones(3, device=device()), peer, torch.empty(3, device=device()), peer, None, "ping")


def nothing_after_the_recording():
    with trace.recording() as records:
        ping()
    during = len(records)
    ping()
    return during > 0, len(records) == during, trace.ON, list(wire.LEDGER.watchers)


def test_nothing_records_and_nothing_watches_the_wire_once_the_recording_ends():
    assert run(2, nothing_after_the_recording) == [(True, True, False, [])] * 2


def test_a_demo_with_trace_writes_one_file_of_every_rank(tmp_path):
    path = tmp_path / "ring.json"
    result = run_sh("demo", "ring_allreduce", "3", "--numel", "64", "--trace", str(path))
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"trace: {path} (3 ranks" in result.stdout
    with open(path) as f:
        events = check_format(json.load(f), 3)
    assert any(e["name"] == "process_labels" and "clock offset" in e["args"]["labels"] for e in events)
