"""How each rank ended, and which one failed first: the rank its survivors name, however it ended.

When one rank of a group fails, the others fail after it: a receive from it breaks ("Connection reset by
peer"), a collective it never joins times out. Each of them could only blame the peer it was talking to, and
in a cascade (rank 2 dies, rank 1 raises from losing it and exits, rank 0 then loses rank 1) rank 0 would
blame a bystander; torchrun, which sees a rank that exits with status 0 as done, would too. So every rank
says how it ended, once, in the group's store (the first word written stands):

    error|time|ValueError: ...   it raised (launch's hook of uncaught errors; the test pools)
    left|time|                   it exited or returned mid-run, maybe with status 0 (launch.leave, at exit)
    lost|time|2                  it stopped after losing rank 2 (the wire, the collectives, this module)
    gone|time|                   written FOR it: a survivor found its process ended without a word

A rank that ends without a word (os._exit, SIGKILL, a segfault, the OOM killer: no exit handler runs) is found
by its socket: each rank opens one that nothing accepts on (`listen`); while its process lives, its kernel
completes a connection to it, and once the process has ended the kernel refuses one. This works across
hosts (a pid would not) and costs no thread and nothing per message: only a failure probes it.

`first_failure` picks, among the ranks that raised, left or vanished (never one that only lost another), the
one with the earliest time, after a short grace for words still on their way; `blame` says it and records
this rank as its victim. Every lost peer and failed collective in mini_dist is named through it
(kit/wire.py, kit/debug.py), and an uncaught error through `hook_uncaught_errors`. Mirrors torchrun's
"first observed failure", decided by the ranks themselves, who see more than torchrun does.
"""
import json
import os
import re
import socket
import sys
import time
import traceback

import torch.distributed as dist

FATE = "mini_dist/fate/"  # + rank: how that rank ended, 'kind|time|text'
WHERE = "mini_dist/where/"  # + rank: host:port of the socket its kernel answers on while its process lives
GRACE_S = 1.0  # how long to wait for a word still on its way when no rank is known to have failed
SETTLE_S = 0.25  # once one is known: how long an earlier one may still arrive
# a lost connection or a wait past the timeout, in gloo's, NCCL's and the wire's words
BROKEN = re.compile(r"[Cc]onnection (reset|closed|refused)|[Bb]roken pipe|[Tt]imed out|[Tt]imeout|pair closure|"
                    r"NCCL (error|communicator)|ncclRemoteError|lost rank|waited for rank")
HOW = {"error": "it failed first: {}; its log has the traceback",
       "left": "it left the group while this rank waited for it: returned or exited, maybe with status 0, "
               "without a word; its log says why",
       "gone": "it vanished: its process ended without a word, as os._exit, a kill or a crash ends one; its "
               "log may say why",
       "host": "it ended, and the group's store, which it hosted, went with it; its log may say why",
       "silent": "it stopped answering: alive, but rank {} waited for it until the group's timeout"}
_listening = None  # this rank's socket (nothing ever accepts on it)


def _store():
    return dist.distributed_c10d._get_default_store()


def record(kind: str, text: str = "", rank: int | None = None) -> str:
    """Write a rank's fate unless one stands (this rank's, or for `rank`); return the one that stands."""
    key = f"{FATE}{dist.get_rank() if rank is None else rank}"
    return _store().compare_set(key, "", f"{kind}|{time.time():.3f}|{text}").decode()


def listen() -> None:
    """Open this rank's socket on the address the other ranks reach this host by, and say where it is."""
    global _listening
    master = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    family = socket.getaddrinfo(*master, type=socket.SOCK_DGRAM)[0][0]
    with socket.socket(family, socket.SOCK_DGRAM) as route:  # a UDP connect sends nothing: it picks the
        route.connect(master)                                 # local address on the route to the store
        host = route.getsockname()[0]
    # backlog: the kernel keeps each probe there, never accepted, until the process ends: room for many
    _listening = socket.create_server((host, 0), family=family, backlog=4096)
    _store().set(f"{WHERE}{dist.get_rank()}", f"{host}:{_listening.getsockname()[1]}")


def _close_in_child() -> None:
    """A process forked from a rank (a data loader's worker) must not answer for the rank once it is gone."""
    global _listening
    if _listening is not None:
        _listening.close()
        _listening = None


os.register_at_fork(after_in_child=_close_in_child)


def answers(host: str, port: int) -> bool | None:
    """Whether a process listens at host:port: a connection completes (True) or is refused (False); None if
    neither within a second (unreachable, or slow)."""
    try:
        socket.create_connection((host, port), timeout=1.0).close()
        return True
    except ConnectionRefusedError:
        return False
    except OSError:
        return None


def alive(rank: int) -> bool | None:
    """Whether `rank`'s process lives (its socket answers); None if unknown."""
    key = f"{WHERE}{rank}"
    if not _store().check([key]):
        return None
    host, port = _store().get(key).decode().rsplit(":", 1)
    return answers(host, int(port))


def read_fates() -> dict:
    """{rank: (kind, time, text)} for every rank of the world that has a fate in the store."""
    found = {}
    for rank in range(dist.get_world_size()):
        key = f"{FATE}{rank}"
        if _store().check([key]):
            kind, at, text = _store().get(key).decode().split("|", 2)
            found[rank] = (kind, float(at), text)
    return found


def look() -> dict | None:
    """Every rank's fate, with those found gone (without one) dated now; None if the store is gone."""
    master = (os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "0")))
    try:
        if master[1] and answers(*master) is False:  # a refused store: no need to wait for its error
            return None
        ended = read_fates()
        for rank in range(dist.get_world_size()):
            if rank != dist.get_rank() and rank not in ended and alive(rank) is False:
                kind, at, text = record("gone", rank=rank).split("|", 2)  # the first to find it dates it
                ended[rank] = (kind, float(at), text)
        return ended
    except (RuntimeError, ValueError):
        return None


def first_failure(wait_s: float = GRACE_S) -> tuple[int, str] | None:
    """(rank, how it ended) for the rank of the world that failed first, as this rank sees it now: the earliest
    of those that raised, left or vanished (found gone, and dated, here); if none did, a rank that another
    waited for until the timeout. None if no rank failed within wait_s, or this process has no group."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    me = dist.get_rank()
    deadline = time.monotonic() + wait_s
    settled = None  # once a rank is known to have failed: when an earlier one may no longer come
    best = None
    while True:
        ended = look()
        if ended is None:  # the store went with its host: rank 0, unless torchrun's agent hosts it
            if best or me == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
                return best
            return 0, HOW["host"]
        causes = sorted((at, rank, kind, text) for rank, (kind, at, text) in ended.items()
                        if kind != "lost" and rank != me)
        now = time.monotonic()
        if causes:
            best = causes[0][1], HOW[causes[0][2]].format(causes[0][3])
            settled = settled or now + SETTLE_S
            if now >= settled:
                return best
        elif now >= deadline:
            waited = sorted((at, int(text), rank) for rank, (kind, at, text) in ended.items()
                            if kind == "lost" and int(text) not in ended and int(text) != me)
            return (waited[0][1], HOW["silent"].format(waited[0][2])) if waited else None
        time.sleep(0.1)


def blame(waited_for: int | None = None) -> tuple[int | None, str]:
    """(rank, 'lost rank r (how it ended). Rank me stopped after losing rank r; look for ... rank r's log') for
    the rank that failed first, recorded as this rank's cause; (None, '') if none did. waited_for: the one
    peer this rank waited for until the timeout, recorded (when no rank failed) for the ranks that lose this
    one next."""
    found = first_failure()
    lost = found[0] if found is not None else waited_for
    if lost is not None and dist.is_initialized():
        try:
            record("lost", str(lost))
        except (RuntimeError, ValueError):  # the store went with its host: nowhere to say it
            pass
    if found is None:
        return None, ""
    rank, how = found
    me = dist.get_rank()
    return rank, (f"lost rank {rank} ({how}). Rank {me} stopped after losing rank {rank}; look for the first "
                  f"error in rank {rank}'s log")


def broken(error: BaseException) -> bool:
    """Whether `error` says a connection was lost or a wait outlived the timeout (a rank failed somewhere)."""
    return isinstance(error, dist.DistError) or bool(BROKEN.search(str(error)))


def record_failure(error: BaseException) -> tuple[str, bool]:
    """This rank's fate after `error` ended its work, unless it has one: a raw communication error is the
    failure of another rank (-> the line naming it, True: this rank is a victim), anything else its own."""
    try:
        mine = read_fates().get(dist.get_rank())
        if mine is not None:
            return "", mine[0] == "lost"
        if broken(error):
            rank, said = blame()
            if rank is not None:
                return said, True
        lines = str(error).splitlines()
        record("error", f"{type(error).__name__}: {lines[0] if lines else ''}")
    except (RuntimeError, ValueError):  # the store is gone too: the error itself is all there is
        pass
    return "", False


_previous_excepthook = sys.excepthook


def hook_uncaught_errors() -> None:
    """An uncaught error in a script: its fate first (so that the others name the right rank), then the
    traceback, then, if it was the loss of a peer that nothing named, the rank that failed first."""
    global _previous_excepthook
    if sys.excepthook is not _excepthook:
        _previous_excepthook = sys.excepthook
        sys.excepthook = _excepthook


def _excepthook(kind, error, tb) -> None:
    said, victim = record_failure(error) if dist.is_initialized() else ("", False)
    _previous_excepthook(kind, error, tb)
    if said:
        print(f"[mini_dist] {said}", file=sys.stderr, flush=True)
    tell_torchrun(error, tb, said, victim)


def tell_torchrun(error, tb, said: str, victim: bool) -> None:
    """torchrun's summary names as root cause the failure with the earliest time, in whole seconds, from the
    rank's error file or, without one, from when it saw the rank exit (a poll, 0.1 s, later); a rank that ends
    with status 0 is no failure to it. So each rank writes its error file, and a victim's, which names the
    cause, is dated 2 s later: its cause comes first whenever torchrun saw the cause fail."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        text = "".join(traceback.format_exception(type(error), error, tb)) + said
        stamp = str(int(time.time()) + (2 if victim else 0))
        with open(path, "w") as f:
            json.dump({"message": {"message": text.splitlines()[-1],
                                   "extraInfo": {"py_callstack": text, "timestamp": stamp}}}, f)
