"""The trace: what every rank did and when, one file for the whole run, opened in Perfetto (ui.perfetto.dev).

    with span("forward", mb=3): ...           a slice on this rank's compute track (track=COMM: communication)
    mark("bucket 0 ready", bucket=0)          an instant
    record(FLIGHT, name, start, end, ...)     what was in flight from start to end (now() ns; they may overlap)
    with recording() as records: ...          this rank's records inside the block, trace file or not: what the
                                              terminal pictures (the bucket bars, the ring's chunk table) read
    everyone(records, group)                  {rank: its records} of every rank; pairs(that): each send and the
                                              receive it met; received(that): per rank, who sent what it received

Each also takes into=a list, which gets the record whether or not anything records: a picture that must
always be drawn (DDP's Timeline, FSDP's ledger) keeps its records there, and the trace gets the same ones.
The kit's wire (kit/wire.py) records every message it posts, every wait for one, and every collective it
counts; the concepts add their own hooks, a line each (DDP's buckets, FSDP's gathers, a pipeline's actions).

`--trace run.json` on any demo (or MINI_DIST_TRACE=run.json) records from setup() to shutdown(), where every
rank's records go to rank 0, which writes one file in Chrome's Trace Event Format (what torch.profiler's
export_chrome_trace writes): a process per rank, a compute and a communication track per thread, and an
arrow from each send to the wait that received it. The k-th message a rank sends to rank b on a group is
the k-th that b receives from it there (messages between two ranks of a group arrive in order), so the two
records meet by (sender, receiver, group, k). Clocks differ between machines: rank 0 measures each rank's
offset by ping-pong and keeps the round trip that took least time, offset = the rank's clock minus the
middle of the round trip (Cristian, 1989). `--trace-torch` (MINI_DIST_TRACE_TORCH=1; on by default under
NCCL) runs torch.profiler too and puts its events (aten ops, CUDA kernels, NCCL calls) under the same ranks
on the same clock. Nothing records unless asked: the wire's hot path then pays one `if` per call.
"""
import contextlib
import itertools
import json
import os
import tempfile
import threading
import time
from collections import Counter

import torch
import torch.distributed as dist

from mini_dist.kit import trace_events
from mini_dist.kit.trace_events import (COLLECTIVE, COMM, COMPUTE, FLIGHT, MARK, RECV, SEND, SPAN,  # noqa: F401
                                        STORAGE, WAIT, Record, pairs, received)

now = time.perf_counter_ns  # the clock of every record, in nanoseconds

ON = False         # something records: the wire's one `if`
WATCHERS = []      # the wire's LEDGER.watchers, told by the wire (kit/wire.py), which imports this module
_sinks = []        # the lists records go to: the run's (a trace file was asked for) and each recording()
_run = {"path": None, "torch": False, "records": None, "profiler": None}
_pending = {}      # thread -> messages counted by the wire, about to be posted
_open = {}         # thread -> collectives under way
_waiting = {}      # id(work) -> ids of the messages it completes
_seq = Counter()   # (send or recv, peer, group) -> messages so far: the k of the matching rule
_ids = itertools.count()
_lock = threading.Lock()


def record(what, name, start, end=None, track=COMPUTE, into=None, **args):
    """One record, to `into` and to whatever records; None when neither wants it."""
    if into is None and not ON:
        return None
    r = Record(what, name, track, threading.get_ident(), start, end, args)
    if into is not None:
        into.append(r)
    for sink in _sinks:
        sink.append(r)
    return r


def mark(name, track=COMPUTE, into=None, **args):
    return record(MARK, name, now(), None, track, into, **args) if ON or into is not None else None


class span:
    """with span("forward", mb=3): ... -> one slice from enter to exit (nothing, unless something records)."""

    def __init__(self, name, track=COMPUTE, into=None, **args):
        self.name = name
        self.track = track
        self.into = into
        self.args = args

    def __enter__(self):
        self.start = now() if ON or self.into is not None else None
        return self

    def __exit__(self, *exc):
        if self.start is not None:
            record(SPAN, self.name, self.start, now(), self.track, self.into, **self.args)
        return False


@contextlib.contextmanager
def recording():
    """with recording() as records: this rank's records of the block land in `records`."""
    records = []
    _listen(records)
    try:
        yield records
    finally:
        _sinks.remove(records)
        _quiet_if_alone()


def _listen(sink: list) -> None:
    global ON
    if not _sinks:  # a fresh start: what an earlier recording left half done stays out
        for state in (_seq, _pending, _open, _waiting):
            state.clear()
    _sinks.append(sink)
    ON = True
    if watch not in WATCHERS:
        WATCHERS.append(watch)


def _quiet_if_alone() -> None:
    global ON
    ON = bool(_sinks)
    if not ON and watch in WATCHERS:
        WATCHERS.remove(watch)


# ----- what the wire calls (kit/wire.py): a message counted, posted, waited for; a collective begun and done

def group_ranks(group) -> tuple:
    return tuple(dist.get_process_group_ranks(group or dist.group.WORLD))


def watch(event, peer, group, nbytes, kind, label) -> None:
    """The wire's watcher: a message about to be posted (peer: a global rank), or a collective about to run."""
    me = threading.get_ident()
    if event in (SEND, RECV):
        key = (event, peer, group_ranks(group))
        with _lock:
            seq = _seq[key]
            _seq[key] += 1
        args = dict(id=next(_ids), peer=peer, group=key[2], seq=seq, bytes=nbytes, kind=kind)
        _pending.setdefault(me, []).append(Record(event, label, COMM, me, now(), None, args))
    else:
        args = dict(kind=event, bytes=nbytes, group=group_ranks(group))
        _open.setdefault(me, []).append(Record(COLLECTIVE, label or event, COMM, me, now(), None, args))


def posted(works: list, tensors: list) -> None:
    """The messages just counted were posted as `works`: one per message, or one for all (NCCL's batch)."""
    t = now()
    pending = _pending.pop(threading.get_ident(), [])[-len(tensors):]
    ends = [r.start for r in pending[1:]] + [t]  # a batch's messages side by side, each until the next is counted
    for r, end, tensor in zip(pending, ends, tensors):
        r.args["offset"] = tensor.storage_offset()  # where in its buffer: which chunk of a ring it is
        record(r.what, r.name, r.start, end, COMM, **r.args)
    ids = [r.args["id"] for r in pending]
    for i, work in enumerate(works):
        _waiting[id(work)] = ids[i:i + 1] if len(works) == len(ids) else ids


def wait(work) -> None:
    """work.wait(), recorded as a slice when it completes messages the trace knows."""
    ids = _waiting.pop(id(work), None)
    start = now()
    work.wait()
    if ids:
        record(WAIT, "wait", start, now(), COMM, messages=ids)


def done() -> None:
    """The collective begun last on this thread (watch) has returned."""
    began = _open.get(threading.get_ident())
    if began:
        r = began.pop()
        record(COLLECTIVE, r.name, r.start, now(), COMM, **r.args)


# ----- the run's trace file: asked for by main(), started by setup(), written at shutdown()

CLOCK_MARK = "mini_dist clock"  # a torch.profiler event bracketed by our clock: how its clock maps to ours


def ask(path, with_torch: bool = False) -> None:
    """The demo's --trace PATH (None: no file) and --trace-torch, from launch.main()."""
    _run["path"] = os.path.abspath(path) if path else None
    _run["torch"] = with_torch


def start() -> None:
    """From launch.setup(): record the run, if a trace file was asked for (and run torch.profiler beside)."""
    if _run["path"] and _run["records"] is None:
        _run["records"] = []
        _listen(_run["records"])
        if _run["torch"] or dist.get_backend() == "nccl":
            from torch.profiler import ProfilerActivity, profile
            cuda = [ProfilerActivity.CUDA] if dist.get_backend() == "nccl" else []
            _run["profiler"] = profile(activities=[ProfilerActivity.CPU, *cuda])
            _run["profiler"].start()


def finish() -> None:
    """From launch.shutdown(), on every rank: rank 0 writes the run's trace file."""
    records = _run["records"]
    if records is None:
        return
    _run["records"] = None
    _sinks.remove(records)
    _quiet_if_alone()
    trace = gather(records, _torch_events())
    if trace is not None:
        with open(_run["path"], "w") as f:
            json.dump(trace, f)
        print(f"trace: {_run['path']} ({trace_events.summary(trace)}); open it in ui.perfetto.dev "
              f"(or chrome://tracing)", flush=True)


def clock_offsets(rounds: int = 32) -> dict:
    """On rank 0: {rank: (its clock - rank 0's, the round trip that told, ns)}; {} on the others. Rank 0 sends
    each rank a message, the rank answers with its clock; its clock then read the middle of the round trip."""
    me = dist.get_rank()
    cuda = dist.get_backend() == "nccl"
    t = torch.zeros(1, dtype=torch.int64, device=torch.device("cuda", torch.cuda.current_device()) if cuda else None)
    offsets = {0: (0, 0)} if me == 0 else {}
    for q in range(1, dist.get_world_size()):
        for _ in range(rounds):
            if me == 0:
                sent = now()
                dist.send(t, q)
                dist.recv(t, q)
                theirs = int(t.item())  # .item() waits for the GPU too
                back = now()
                if q not in offsets or back - sent < offsets[q][1]:
                    offsets[q] = (theirs - (sent + back) // 2, back - sent)
            elif me == q:
                dist.recv(t, 0)
                t.item()
                t.fill_(now())
                dist.send(t, 0)
    return offsets


def gather(records: list, torch_events=()) -> dict | None:
    """Every rank's records (and torch.profiler events) to rank 0, as one trace (None on the other ranks)."""
    offsets = clock_offsets()
    threads = {t.ident: t.name for t in threading.enumerate()}
    mine = (dist.get_rank(), records, threads, list(torch_events))
    everything = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, everything, dst=0)
    return trace_events.chrome(everything, offsets) if dist.get_rank() == 0 else None


def everyone(records: list, group=None) -> dict:
    """{global rank: its records} for every rank of the group (a collective): what a picture of them all reads."""
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, records, group=group)
    return dict(zip(group_ranks(group), out))


def _torch_events() -> list:
    """torch.profiler's events of the run, their timestamps moved onto our clock (ns)."""
    profiler = _run["profiler"]
    _run["profiler"] = None
    if profiler is None:
        return []
    brackets = []
    for _ in range(3):  # the first call of record_function is slow: the tightest bracket wins
        before = now()
        with torch.profiler.record_function(CLOCK_MARK):
            pass
        brackets.append((before, now()))
    profiler.stop()
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "torch.json")
        profiler.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    marks = sorted((e for e in events if e.get("name") == CLOCK_MARK), key=lambda e: e["ts"])
    fits = [((a + b) / 2 - (e["ts"] + e.get("dur", 0) / 2) * 1000, b - a) for e, (a, b) in zip(marks, brackets)]
    shift = min(fits, key=lambda fit: fit[1])[0] if fits else 0.0
    kept = [e for e in events if e.get("name") != CLOCK_MARK]
    for e in kept:
        if "ts" in e:
            e["ts"] = float(e["ts"]) * 1000 + shift
    return kept
