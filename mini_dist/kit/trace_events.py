"""Every rank's trace records (kit/trace.py) -> one file in Chrome's Trace Event Format: the JSON that
torch.profiler's export_chrome_trace writes, and that Perfetto (ui.perfetto.dev) and chrome://tracing open.

    {"traceEvents": [...], "displayTimeUnit": "ms"}     times in microseconds since the run's first record

    ph "M"        names: a process per rank ("rank r", pid r), and its tracks (tid): compute and communication,
                  one pair per thread that recorded (DDP's communication thread has its own)
    ph "X"        a slice: a span, a message being posted, a wait, a collective; slices of one track nest
    ph "i"        an instant: a mark ("bucket 0 ready")
    ph "b", "e"   something in flight (a bucket's all-reduce, launched and not yet done): these may overlap
    ph "s", "f"   an arrow from the slice that posted a send to the wait that received it: a flow, bound to
                  the slice around its point ("bp": "e")

Every record's time is moved onto rank 0's clock by the offset measured for its rank (trace.clock_offsets).
"""
import itertools
from collections import namedtuple

Record = namedtuple("Record", "what name track thread start end args")  # what a rank records; times in ns
SPAN = "span"          # what: a slice
MARK = "mark"          # an instant
FLIGHT = "flight"      # something in flight from start to end
SEND = "send"          # what the wire records: a message posted,
RECV = "recv"
WAIT = "wait"          # a wait for messages,
COLLECTIVE = "collective"  # a collective called
COMPUTE = "compute"    # the tracks
COMM = "communication"
STORAGE = "storage"


def chrome(everything: list, offsets: dict) -> dict:
    """[(rank, records, {thread id: name}, torch.profiler events on the rank's clock)] -> the file's dict."""
    zero = min([r.start - offsets[rank][0] for rank, records, _, _ in everything for r in records] or [0])
    events = []
    ids = itertools.count(1)
    posts = {}  # (rank, message id) -> (tid, ts, dur) of the slice that posted it: where an arrow starts
    waits = {}  # ... of the wait that completed it: where an arrow ends (a receive never waited for: its post)

    def us(rank, t):
        return round((t - offsets[rank][0] - zero) / 1000, 3)
    for rank, records, threads, torch_events in everything:
        offset, round_trip = offsets[rank]
        events += [meta(rank, None, "process_name", name=f"rank {rank}"),
                   meta(rank, None, "process_sort_index", sort_index=rank),
                   meta(rank, None, "process_labels", labels=f"clock offset {offset / 1000:+.1f} us, measured in a "
                                                             f"{round_trip / 1000:.1f} us round trip")]
        tids = {}

        def tid(track, thread):
            if (track, thread) not in tids:
                tids[track, thread] = len(tids) + 1
                name = threads.get(thread, f"thread {thread}")
                title = track if name == "MainThread" else f"{track} ({name})"
                events.extend([meta(rank, tids[track, thread], "thread_name", name=title),
                               meta(rank, tids[track, thread], "thread_sort_index", sort_index=tids[track, thread])])
            return tids[track, thread]
        messages = {r.args["id"]: r for r in records if r.what in (SEND, RECV)}
        for r in records:
            ts = us(rank, r.start)
            args = plain(r.args)
            if r.what == WAIT:
                args["peers"] = [messages[m].args["peer"] for m in r.args["messages"] if m in messages]
            base = dict(name=title_of(r, messages), cat=r.track, pid=rank, ts=ts, args=args)
            if r.what == FLIGHT:
                flight = next(ids)
                events += [dict(base, ph="b", cat="in flight", id=flight, tid=0),
                           dict(base, ph="e", cat="in flight", id=flight, tid=0, ts=us(rank, r.end), args={})]
            elif r.what == MARK:
                events.append(dict(base, ph="i", s="t", tid=tid(r.track, r.thread)))
            else:
                track = tid(r.track, r.thread)
                dur = round(us(rank, r.end) - ts, 3)
                events.append(dict(base, ph="X", tid=track, dur=dur))
                if r.what in (SEND, RECV):
                    posts[rank, r.args["id"]] = (track, ts, dur)
                for m in r.args["messages"] if r.what == WAIT else ():
                    waits[rank, m] = (track, ts, dur)
        events += remapped(torch_events, rank, offsets[rank][0] + zero, ids)
    for sender, send, receiver, receive in pairs({rank: records for rank, records, _, _ in everything}):
        flow = next(ids)
        track, ts, dur = posts[sender, send.args["id"]]
        events.append(dict(ph="s", id=flow, cat="message", name="message", pid=sender, tid=track,
                           ts=round(ts + dur / 2, 3)))
        track, ts, dur = waits.get((receiver, receive.args["id"]), posts[receiver, receive.args["id"]])
        events.append(dict(ph="f", bp="e", id=flow, cat="message", name="message", pid=receiver, tid=track,
                           ts=round(ts + dur * 0.9, 3)))  # near the wait's end: when the message had arrived
    events.sort(key=lambda e: (e["ph"] != "M", e.get("ts", 0), -e.get("dur", 0)))
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"clock offsets (ns, round trip)": {str(r): list(o) for r, o in offsets.items()}}}


def pairs(by_rank: dict) -> list:
    """[(sender, send record, receiver, receive record)] for each send whose receive was recorded: the k-th
    message rank a sends to rank b on a group is the k-th that b receives from a there."""
    receives = {(r.args["peer"], rank, r.args["group"], r.args["seq"]): (rank, r)
                for rank, records in by_rank.items() for r in records if r.what == RECV}
    return [(rank, r, *receives[rank, r.args["peer"], r.args["group"], r.args["seq"]])
            for rank, records in by_rank.items() for r in records
            if r.what == SEND and (rank, r.args["peer"], r.args["group"], r.args["seq"]) in receives]


def received(by_rank: dict) -> dict:
    """{rank: [(sender, its send record, which of the sender's sends it was) for each receive, in order]}: the
    terminal pictures follow the data this way (the ring's chunks, ring attention's K/V blocks)."""
    sends = {rank: [r for r in records if r.what == SEND] for rank, records in by_rank.items()}
    met = {(receiver, receive.args["id"]): (sender, send, sends[sender].index(send))
           for sender, send, receiver, receive in pairs(by_rank)}
    return {rank: [met[rank, r.args["id"]] for r in records if r.what == RECV and (rank, r.args["id"]) in met]
            for rank, records in by_rank.items()}


def meta(pid, tid, what, **args) -> dict:
    """A metadata event: the name or place of a process (tid None) or of one of its tracks."""
    event = dict(ph="M", name=what, pid=pid, args=args)
    if tid is not None:
        event["tid"] = tid
    return event


def title_of(r, messages: dict) -> str:
    """What a slice says in the viewer: the span's name; a message's label and peer."""
    if r.what == SEND:
        return f"send {r.name} -> rank {r.args['peer']}"
    if r.what == RECV:
        return f"post receive {r.name} <- rank {r.args['peer']}"
    if r.what == WAIT:
        m = messages.get(r.args["messages"][0])
        if m is None:
            return "wait"
        more = f" (+{len(r.args['messages']) - 1} more)" if len(r.args["messages"]) > 1 else ""
        arrow = "->" if m.what == SEND else "<-"
        return f"wait {m.name} {arrow} rank {m.args['peer']}{more}"
    return r.name


def plain(args: dict) -> dict:
    """Arguments as JSON holds them (a group's ranks: a list)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in args.items()}


def remapped(events: list, rank: int, shift_ns: float, ids) -> list:
    """torch.profiler's events of one rank (on its clock, ns) under the rank's process, on the trace's time;
    their threads and streams get tracks of their own, their flows ids no other rank uses."""
    tids = {}
    flows = {}
    out = []
    for e in events:
        if e.get("ph") == "M" and e.get("name", "").startswith("process"):
            continue  # the rank's process has its name
        if "tid" in e:
            e = dict(e, tid=tids.setdefault((e.get("pid"), e["tid"]), 1000 + len(tids)))
        e = dict(e, pid=rank)
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            e["args"] = {"name": f"torch.profiler: {e['args'].get('name', '')}"}
        if "id" in e:
            e["id"] = flows.setdefault((e.get("cat"), e["id"]), next(ids))
        if "ts" in e:
            e["ts"] = round((e["ts"] - shift_ns) / 1000, 3)
        out.append(e)
    return out


def summary(trace: dict) -> str:
    events = trace["traceEvents"]
    ranks = {e["pid"] for e in events if e.get("name") == "process_name"}
    arrows_drawn = sum(e["ph"] == "s" and e.get("cat") == "message" for e in events)
    slices = sum(e["ph"] == "X" for e in events)
    return f"{len(ranks)} ranks, {slices} slices, {arrows_drawn} messages drawn as arrows"
