"""Long-lived pools of ranks that run one function on every rank: the test suite's and `./run.sh ask`'s.

Spawning 4 gloo ranks costs seconds; a collective in a live group costs milliseconds. So a pool of worker
processes joins one process group (through `launch.setup`, the path a torchrun demo takes, on a free port)
and stays: `pool.run(fn, *args)` sends fn (a module-level function, pickled by name) to every rank and
returns every rank's result, or raises a `RankFailure` naming each rank that raised, died or hung, with its
traceback. Once one rank has failed the others get a short grace period (they are usually blocked in a
collective waiting for it), then the pool restarts: gloo ranks that broke off mid-collective are out of step
and would hang the next call. The exception: every rank raised the same error (a bad input refused by all
before any of them blocked): the group is still in step and is kept.
"""
import os
import pickle
import re
import time
import traceback
from multiprocessing import connection, get_context

import torch
import torch.distributed as dist

from mini_dist.kit import debug, fates, launch

GRACE_S = float(os.environ.get("MINI_DIST_GRACE", "3"))  # how long the others may answer once one rank failed
# a whole call, and each collective of a rank within it (./run.sh check shortens both: a hang is named in seconds)
CALL_TIMEOUT_S = float(os.environ.get("MINI_DIST_CALL_TIMEOUT", "90"))
RANK_TIMEOUT_S = os.environ.get("MINI_DIST_RANK_TIMEOUT", "30")


# errors after which the group is out of step even when every rank raised the same one
BROKEN = re.compile(r"died|[Tt]imed out|[Tt]imeout|pair closure|Connection|PeerLost")


class RankFailure(RuntimeError):
    """One or more ranks raised, died or hung; the message names each of them. .replies: {rank: ("ok", its
    result) or ("err", (message, traceback))} of the ranks that answered."""

    def __init__(self, message: str, replies: dict | None = None):
        super().__init__(message)
        self.replies = replies or {}


def _worker(rank: int, world: int, port: int, conn, backend: str, env: dict) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      MINI_DIST_TIMEOUT=env.get("MINI_DIST_TIMEOUT", RANK_TIMEOUT_S))
    for key, value in env.items():
        os.environ.setdefault(key, value)
    debug.DEBUG = os.environ.get("MINI_DIST_DEBUG") == "1"  # it was read in the server, without this env
    torch.set_num_threads(1)  # 5 ranks on 2 cores: intra-op threads would only fight each other
    launch.setup(backend)
    conn.send_bytes(pickle.dumps(("ready", rank)))
    failed = False
    while True:
        message = conn.recv_bytes()
        if not message:
            break
        fn, args, kwargs = pickle.loads(message)
        if failed and world > 1:  # a group kept after every rank raised alike: its fates were of that call
            dist.distributed_c10d._get_default_store().delete_key(f"{fates.FATE}{rank}")
        try:
            reply = ("ok", fn(*args, **kwargs))
            payload = pickle.dumps(reply)
            failed = False
        except SystemExit:  # fn ended this rank as a script's sys.exit would: its word first (launch.leave)
            launch.leave()
            raise
        except BaseException as e:  # report everything, including a failed pickle of the result
            failed = True
            said = fates.record_failure(e)[0] if world > 1 else ""  # as launch's hook of uncaught errors does
            payload = pickle.dumps(("err", (f"{type(e).__name__}: {e}", traceback.format_exc() + said)))
        conn.send_bytes(payload)
    launch.shutdown()


class Pool:
    def __init__(self, world: int, backend: str, preload=(), env=None, grace_s: float = GRACE_S):
        """env: the ranks' environment (MINI_DIST_TIMEOUT in it replaces MINI_DIST_RANK_TIMEOUT); grace_s: how
        long the others may answer once one rank failed."""
        self.world = world
        self.backend = backend
        self.preload = list(preload)
        self.env = dict(env or {})
        self.grace_s = grace_s
        self.procs = []
        self.conns = []
        self.start()

    def start(self) -> None:
        # forkserver: a clean server process imports torch once, and every rank is forked from it (a
        # spawn would import torch again for each rank; a plain fork would copy pytest's threads)
        ctx = get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.distributed", "mini_dist.kit.launch", *self.preload])
        port = launch.free_port()
        for rank in range(self.world):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(rank, self.world, port, child, self.backend, self.env),
                            daemon=True, name=f"mini_dist-rank{rank}-of-{self.world}")
            p.start()
            self.procs.append(p)
            self.conns.append(parent)
        replies = self._collect(time.monotonic() + 120.0)
        if any(kind != "ok" for kind, _ in replies.values()) or len(replies) < self.world:
            message = self._describe(replies)
            self.close(graceful=False)
            raise RankFailure(f"pool of {self.world} ranks failed to start:\n{message}")

    def _collect(self, deadline: float) -> dict:
        """Wait for a reply from every rank; stop early (after grace_s) once one has failed."""
        replies, pending = {}, set(range(self.world))
        while pending:
            now = time.monotonic()
            if now >= deadline:
                break
            waiting = {self.conns[r]: r for r in pending}
            waiting.update({self.procs[r].sentinel: r for r in pending})
            for ready in connection.wait(list(waiting), timeout=deadline - now):
                rank = waiting[ready]
                if rank not in pending:
                    continue
                try:
                    kind, value = pickle.loads(self.conns[rank].recv_bytes())
                    replies[rank] = ("ok", value) if kind in ("ok", "ready") else ("err", value)
                except (EOFError, OSError):
                    self.procs[rank].join(timeout=1.0)  # the pipe closes a moment before the exit
                    code = self.procs[rank].exitcode
                    replies[rank] = ("err", (f"died (exit code {code})", f"rank {rank} died\n"))
                pending.discard(rank)
                if replies[rank][0] == "err":
                    deadline = min(deadline, time.monotonic() + self.grace_s)
        return replies

    def _describe(self, replies: dict) -> str:
        lines = []
        for rank in range(self.world):
            if rank not in replies:
                lines.append(f"rank {rank}: no answer (hung, or blocked waiting for a failed rank)")
            elif replies[rank][0] == "err":
                lines.append(f"rank {rank} failed: {replies[rank][1][0]}\n{replies[rank][1][1]}")
        return "\n".join(lines)

    def run(self, fn, *args, timeout: float = CALL_TIMEOUT_S, **kwargs) -> list:
        payload = pickle.dumps((fn, args, kwargs))
        for conn in self.conns:
            conn.send_bytes(payload)
        replies = self._collect(time.monotonic() + timeout)
        if len(replies) == self.world and all(kind == "ok" for kind, _ in replies.values()):
            return [replies[r][1] for r in range(self.world)]
        message = self._describe(replies)
        errors = {value[0] for kind, value in replies.values() if kind == "err"}
        everyone_agreed = len(replies) == self.world and len(errors) == 1 and all(
            kind == "err" for kind, _ in replies.values()) and not BROKEN.search(next(iter(errors)))
        if not everyone_agreed:
            self.close(graceful=False)
            self.start()
        raise RankFailure(f"{fn.__name__} failed on {self.world} ranks:\n{message}", replies)

    def close(self, graceful: bool = True) -> None:
        """Ask the ranks to leave the group together; a broken group is simply killed."""
        for conn in self.conns if graceful else ():
            try:
                conn.send_bytes(b"")
            except OSError:
                pass
        for p in self.procs:
            p.join(timeout=5.0 if graceful else 0.0)
            if p.is_alive():
                p.kill()
                p.join()
        self.procs, self.conns = [], []
