"""The wire: every message mini_dist sends goes through here, and every collective it issues is counted here.

    send_recv(send, dst, recv, src, group, label)   one step: a send and a receive in ONE batch, waited for
    isend_irecv(send, dst, recv, src, group, label) the same batch, posted: -> what to wait() on
    batch(ops, group, label)                        any sends and receives as one batch (an all-to-all)
    isend(tensor, peer, group, label)               one message, posted: -> what to wait() on (None if empty)
    irecv(tensor, peer, group, label)
    wait(posted)                                    wait for it; a peer that died is named (PeerLost)
    with collective(kind, nbytes, group): ...       around one of torch's collectives: counted, watched
    call(dist.fn, *args, group=group, book=...)     one of torch's collectives: watched; counted if booked
    LEDGER                                          what this rank moved, by kind

Peers are ranks of `group`, as torch's group_peer; errors name global ranks: a message or a collective that
fails names the rank of the world that failed first (kit/fates.py), not the peer it was talking to. Empty
tensors stay home: both ends skip the same empty piece. A batch is what NCCL needs: it runs a rank's unbatched
sends and receives in order on one stream, where a ring whose ranks all send first waits forever
(mini_dist/nccl_order.py).

The ledger counts, per kind (what the bytes are for): calls and payload bytes (the D of the formulas: a collective's
tensor, a message's bytes at its send), and the bytes point-to-point sends and receives moved. Kinds: torch's
collectives by name ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"), "ring" (mini_dist's collectives
built from sends: the rings, topology's algorithms; the default), "ring attention" (K/V blocks), "pipeline"
(activations and their gradients), "fsdp" (its all-gathers and reduce-scatters). A message of kind None is counted
in bytes sent and received only: the call that posts it counted its payload already (the expert all-to-all). Debug
traffic (kind DEBUG: the size and shape checks of MINI_DIST_DEBUG=1) is posted, waited for and named like any other,
but never counted, watched or printed, so every figure and VERBOSE line reads the same with debug on or off.

`LEDGER.watchers` are called with every counted message as it is about to be posted, and every collective:
watcher(event, peer, group, nbytes, kind, label), event "send", "recv" or the collective's kind (its torch
name, with kind None, for a `call`), peer a global rank (None for a collective). topology.Links sorts the bytes
by link there; tests/test_dead_rank.py ends a rank at the k-th; a trace (kit/trace.py, --trace on any demo)
records each as a slice, with an arrow from each send to its receive. Cost when nothing is asked: a few Counter
updates a message; a label is formatted only under VERBOSE=1 (a line per message) or when a peer is lost.

Mirrors torch.distributed's isend / irecv / batch_isend_irecv (P2POp) and its Work.wait().
"""
from collections import Counter

import torch
import torch.distributed as dist

from mini_dist.kit import debug, fates, launch, trace

RING = "ring"
DEBUG = "debug"
SEND = "sending to"
RECV = "receiving from"


class Ledger:
    """What this rank moved through the wire and asked torch's collectives to move, since the last reset():
        calls[kind], bytes[kind]          collectives called and messages sent; their payload bytes
        sent_by[kind], received_by[kind]  bytes of point-to-point sends and receives (kind None too)
        sent, received                    the same, every kind"""

    def __init__(self):
        self.watchers = []
        self.reset()

    def reset(self) -> None:
        self.calls = Counter()
        self.bytes = Counter()
        self.sent_by = Counter()
        self.received_by = Counter()

    @property
    def sent(self) -> int:
        return sum(self.sent_by.values())

    @property
    def received(self) -> int:
        return sum(self.received_by.values())

    def record(self, kind: str | None, nbytes: int, group=None, label=None, event=None) -> None:
        """One collective of `kind`, its payload nbytes (its tensor: D of the formulas), told to the watchers as
        `event` (by default its kind); kind None: watched only."""
        if kind is not None:
            self.calls[kind] += 1
            self.bytes[kind] += nbytes
        for watcher in self.watchers:
            watcher(event or kind, None, group, nbytes, kind, label)

    def message(self, doing: str, nbytes: int, peer: int, group, kind, label) -> None:
        """One send (doing SEND) or receive to / from group rank `peer`, about to be posted."""
        if kind == DEBUG:
            return
        if doing is SEND:
            self.sent_by[kind] += nbytes
            if kind is not None:
                self.calls[kind] += 1
                self.bytes[kind] += nbytes
        else:
            self.received_by[kind] += nbytes
        for watcher in self.watchers:
            watcher("send" if doing is SEND else "recv", global_rank(group, peer), group, nbytes, kind, label)


LEDGER = Ledger()
trace.WATCHERS = LEDGER.watchers  # a trace (kit/trace.py) watches the wire while it records


class naming:
    """with naming("all_reduce"): ...  -> a lost connection or a wait past the timeout inside raises PeerLost,
    naming the rank that failed first (debug.failed); any other error passes as it is."""

    def __init__(self, what: str):
        self.what = what

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback):
        named = error is not None and debug.failed(error, self.what)
        if named:
            raise named from error
        return False


class collective(naming):
    """with collective("all_reduce", x.nbytes, group): dist.all_reduce(x, group=group)  -> counted, watched, a
    slice of a trace, and a failure named."""

    def __init__(self, kind: str, nbytes: int, group=None, label=None):
        LEDGER.record(kind, nbytes, group, label)
        super().__init__(kind)

    def __exit__(self, kind, error, traceback):
        if trace.ON:
            trace.done()
        return super().__exit__(kind, error, traceback)


def call(collective_fn, *args, group=None, book=(None, 0), **kwargs):
    """collective_fn(*args, group=group, **kwargs): one of torch's collectives, watched, its failure named (an
    async_op's too, when waited for); counted in LEDGER when book=(kind, payload bytes) says what it moves."""
    what = collective_fn.__name__
    LEDGER.record(*book, group, event=what)
    try:
        with naming(what):
            work = collective_fn(*args, group=group, **kwargs)
    finally:
        if trace.ON:
            trace.done()  # a slice until it returns: an async_op's until it is posted
    return Named(work, what) if kwargs.get("async_op") else work


class Named:
    """An async collective's work, its failure named when waited for (any other method: the work's own)."""

    def __init__(self, work, what: str):
        self.work = work
        self.what = what

    def wait(self):
        with naming(self.what):
            return self.work.wait()

    def __getattr__(self, name):
        return getattr(self.work, name)


def global_rank(group, peer: int) -> int:
    return peer if group is None else dist.get_global_rank(group, peer)


def isend(tensor, peer: int, group, label, kind=RING):
    """Post the send of `tensor` to group rank `peer`: (work, SEND, peer, group, label) for wait(); None if empty."""
    return _post(SEND, tensor, peer, group, label, kind)


def irecv(tensor, peer: int, group, label, kind=RING):
    """Post the receive of `tensor` from group rank `peer`: what wait() takes; None if empty."""
    return _post(RECV, tensor, peer, group, label, kind)


def _post(doing, tensor, peer, group, label, kind):
    if not tensor.numel():
        return None
    LEDGER.message(doing, tensor.nbytes, peer, group, kind, label)
    if launch.VERBOSE and kind != DEBUG:
        say(doing, tensor, peer, group, label)
    try:  # gloo may find the connection gone as the message is posted, before any wait
        if doing is SEND:
            work = dist.isend(tensor, group=group, group_dst=peer)
        else:
            work = dist.irecv(tensor, group=group, group_src=peer)
    except RuntimeError as e:
        raise lost(e, peer, group, doing, label) from e
    if trace.ON:
        trace.posted([work], [tensor])
    return work, doing, peer, group, label


def wait(posted) -> None:
    """Wait for a posted send or receive (None: nothing was posted); if it fails, name the peer."""
    if posted is not None:
        work, doing, peer, group, label = posted
        try:
            if trace.ON:
                trace.wait(work)
            else:
                work.wait()
        except RuntimeError as e:  # gloo: "Connection reset by peer" or a timeout; NCCL: its own report
            raise lost(e, peer, group, doing, label) from e


def batch(ops, group, label, kind=RING) -> list:
    """Post [(SEND or RECV, tensor, group peer), ...] as ONE batch_isend_irecv; empty tensors stay home.
    Returns what to wait() on: one per message (gloo), or one for the whole batch (NCCL may coalesce it)."""
    ops = [op for op in ops if op[1].numel()]
    if not ops:
        return []
    for doing, tensor, peer in ops:
        LEDGER.message(doing, tensor.nbytes, peer, group, kind, label)
        if launch.VERBOSE and kind != DEBUG:
            say(doing, tensor, peer, group, label)
    p2p = [dist.P2POp(dist.isend if doing is SEND else dist.irecv, tensor, group=group, group_peer=peer)
           for doing, tensor, peer in ops]
    try:
        works = dist.batch_isend_irecv(p2p)
    except RuntimeError as e:
        raise lost(e, tuple(peer for _, _, peer in ops), group, "posting a batch", label) from e
    if trace.ON:
        trace.posted(works, [tensor for _, tensor, _ in ops])
    if len(works) == len(ops):
        return [(work, doing, peer, group, label) for work, (doing, _, peer) in zip(works, ops)]
    return [(work, "in a batch", tuple(peer for _, _, peer in ops), group, label) for work in works]


def isend_irecv(send, dst: int, recv, src: int, group, label, kind=RING) -> list:
    """Post the send of `send` to group rank dst and the receive of `recv` from src as one batch (either
    may be None): what to wait() on. Under MINI_DIST_DEBUG=1 both ends first compare sizes (compare_sizes)."""
    if debug.DEBUG:
        compare_sizes(send, dst, recv, src, group, label)
    ops = []
    if send is not None:
        ops.append((SEND, send, dst))
    if recv is not None:
        ops.append((RECV, recv, src))
    return batch(ops, group, label, kind)


def send_recv(send, dst: int, recv, src: int, group, label, kind=RING) -> None:
    """One step: send `send` to group rank dst while receiving `recv` from src, in ONE batch, and wait for
    both. Were every rank of a ring to send first, unbatched, each send would wait under NCCL for a receive
    its neighbour has queued behind its own send; a batch runs as one unit."""
    for posted in isend_irecv(send, dst, recv, src, group, label, kind):
        wait(posted)


def compare_sizes(send, dst: int, recv, src: int, group, label) -> None:
    """Under MINI_DIST_DEBUG=1, each end of a send first tells the other its size, in one batch: a chunk index
    that is off by one (a piece of another size, or an empty one that stays home) fails at once on both ends,
    named, instead of a receive that waits for a message that never comes or comes cut."""
    mine = [(t, peer, sending) for t, peer, sending in ((send, dst, True), (recv, src, False)) if t is not None]
    told = [torch.tensor([t.numel()], device=launch.device()) for t, _, _ in mine]
    heard = [torch.empty(1, dtype=torch.int64, device=launch.device()) for _ in mine]
    ops = [(SEND, size, peer) for size, (_, peer, _) in zip(told, mine)]
    ops += [(RECV, size, peer) for size, (_, peer, _) in reversed(list(zip(heard, mine)))]
    for posted in batch(ops, group, label, DEBUG):
        wait(posted)
    me = global_rank(group, dist.get_rank(group))
    for (t, peer, sending), size in zip(mine, heard):
        if size.item() != t.numel():
            raise debug.Disagreement(
                f"{label}: rank {me} {'sends' if sending else 'expects'} {t.numel()} elements "
                f"{'to' if sending else 'from'} rank {global_rank(group, peer)}, which "
                f"{'expects' if sending else 'sends'} {size.item()}: the two ranks mean different pieces (a "
                f"chunk index off by one?)")


def lost(error: RuntimeError, peer, group, doing: str, label) -> debug.PeerLost:
    """The error to raise when a send to / receive from group rank `peer` failed (a tuple: one of a batch's):
    it names the rank of the world that failed first (kit/fates.py), which may not be this peer."""
    peers = peer if isinstance(peer, tuple) else (peer,)
    ranks = list(dict.fromkeys(global_rank(group, p) for p in peers))
    who = " or ".join(f"rank {r}" for r in ranks)
    first = str(error).splitlines()[0] if str(error) else type(error).__name__
    timed_out = bool(debug.TIMED_OUT.search(str(error)))
    cause, said = fates.blame(waited_for=ranks[0] if timed_out and len(ranks) == 1 else None)
    here = cause is None or cause in ranks  # the peer is the cause: no need to say who the peer was
    if doing in (SEND, RECV):
        what = f"{label}, {doing} {'it' if here else who}"
    else:
        what = f"{label}, {doing}{'' if here else f' with {who}'}"
    if cause is not None:
        return debug.PeerLost(f"{what}: {said} ({first})")
    if timed_out:  # alive but silent: most often it waits too, for this rank
        return debug.PeerLost(f"{what}: waited for {who} until the group's timeout ({first}): {who} never posted "
                              f"the matching operation; is it waiting for this rank?")
    return debug.PeerLost(f"{what}: lost {who} ({first}); look for the first error in {who}'s log: it died, was "
                          f"killed, or stopped answering")


def say(doing: str, tensor, peer: int, group, label) -> None:
    """VERBOSE=1: one line per message."""
    arrow = "->" if doing is SEND else "<-"
    launch.trace(f"{label}: {'send' if doing is SEND else 'receive'} {tensor.nbytes} B {arrow} rank "
                 f"{global_rank(group, peer)}")
