"""The launch helper every module shares: from torchrun's environment to a ready process group.

`torchrun --nproc_per_node=P --nnodes=N ...` starts P*N copies of a script and tells each one who it is
through environment variables: RANK (0..world-1), WORLD_SIZE, LOCAL_RANK (0..P-1 on its node),
LOCAL_WORLD_SIZE, and MASTER_ADDR/MASTER_PORT (where rank 0 hosts the rendezvous store). `setup()` reads
them, picks a backend and a device, and joins the process group:

    NCCL + cuda:LOCAL_RANK   when CUDA is present and every local rank can have a GPU of its own
    gloo + cpu               otherwise (a laptop, CI), or when MINI_DIST_BACKEND=gloo says so

Every group is created with a timeout (MINI_DIST_TIMEOUT seconds, default 120): if a rank dies or hangs,
the others raise instead of waiting forever, naming the rank that failed first, however it ended (kit/fates.py:
each rank says in the group's store how it ended, and keeps a socket its kernel answers while it lives).
`conclude()` ends a demo: every rank agrees on pass/fail (one all-reduce of MIN), rank 0 prints the
summary line that `./run.sh` collects, and the exit code is non-zero if any check failed. `--trace PATH`
on any demo records every rank from setup() to shutdown(), where rank 0 writes one trace (kit/trace.py).

Every demo is a command: `demo_parser(__doc__)` gives it --help with the defaults, and `main()` runs it.
A configuration it cannot run (a world size, degrees that do not multiply to it) raises `UsageError`
before any collective: rank 0 prints one line, every rank exits with status 2, no traceback.

Demo (each rank says who it is, then one all-reduce of the ranks proves the group works):

    torchrun --standalone --nproc_per_node=4 mini_dist/kit/launch.py
"""
import argparse
import atexit
import datetime
import gc
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
# before any group exists: torch.distributed.nn.functional's defaults (group=group.WORLD) are evaluated when it is
# first imported (torch.optim imports it through torch._dynamo); after init they would hold the default group past
# destroy_process_group, its gloo worker threads alive while Python exits, and a worker that then releases a
# collective's tensor aborts the process (SIGABRT; pytorch/pytorch#179291 describes the race)
import torch.distributed.nn  # noqa: F401

if not __package__:  # run as `torchrun mini_dist/kit/launch.py`: Python put mini_dist/kit/ on the path, not the repo
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from mini_dist.kit import fates
from mini_dist.kit import trace as tracing

VERBOSE = os.environ.get("VERBOSE") == "1"


@dataclass(frozen=True)
class Env:
    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device


class UsageError(ValueError):
    """A configuration this program cannot run (world size, degrees, sizes): said once, exit status 2."""


def require(ok: bool, message: str) -> None:
    """Refuse a configuration before any collective; `message` says what to change."""
    if not ok:
        raise UsageError(message)


def require_nodes(world: int, ranks_per_node: int) -> None:
    """Refuse a --ranks-per-node that does not split the world into equal nodes (G consecutive ranks each)."""
    divisors = [g for g in range(1, world + 1) if world % g == 0]
    require(ranks_per_node in divisors, f"--ranks-per-node {ranks_per_node} does not divide {world} ranks into "
                                        f"equal nodes; use one of {divisors}")


def env_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def env_world_size() -> int:
    """The world size torchrun announced (1 without torchrun): known before any process group exists."""
    return int(os.environ.get("WORLD_SIZE", "1"))


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    pass


def demo_parser(doc: str) -> argparse.ArgumentParser:
    """A demo's command line: its module docstring's first paragraph as the description, defaults shown.
    Every rank parses the same arguments; only rank 0 prints help or errors, so they appear once."""
    parser = argparse.ArgumentParser(description=doc.strip().split("\n\n")[0], formatter_class=_HelpFormatter)
    parser.add_argument("--trace", metavar="PATH", default=os.environ.get("MINI_DIST_TRACE"),
                        help="write every rank's run to PATH, one trace for Perfetto (ui.perfetto.dev)")
    parser.add_argument("--trace-torch", action="store_true", default=os.environ.get("MINI_DIST_TRACE_TORCH") == "1",
                        help="with --trace: torch.profiler's events too (on by default under NCCL)")
    if env_rank() != 0:
        parser._print_message = _say_nothing
    return parser


def _say_nothing(message, file=None) -> None:
    """argparse's printer on every rank but 0: help and errors appear once."""


def main(parser: argparse.ArgumentParser, demo, argv=None) -> int:
    """Parse, run demo(args), return its exit code. A UsageError becomes one line from rank 0 and exit
    status 2 on every rank (argparse's own convention), with no traceback."""
    try:
        args = parser.parse_args(argv)
        tracing.ask(getattr(args, "trace", None), getattr(args, "trace_torch", False))
        code = demo(args)
        # groups the demo left in reference cycles (a DeviceMesh's) are freed now, their gloo threads joined,
        # and not while Python exits (see `import torch.distributed.nn` above)
        gc.collect()
        return code
    except UsageError as e:
        if env_rank() == 0:
            print(f"{parser.prog}: error: {e}", file=sys.stderr, flush=True)
        code = 2
    except SystemExit as e:  # argparse: --help (0) or a bad flag (2), printed by rank 0
        code = e.code
    leave()
    if code and env_rank() != 0 and env_world_size() > 1:
        time.sleep(1.0)  # torchrun stops every rank once one exits: let rank 0 speak first
    return code


def leave() -> None:
    """Leave the group without shutdown() (a demo that returned early, sys.exit, an uncaught error): say so
    in the group's store first (unless this rank said already that it raised or lost a peer), so that the
    ranks left waiting in a collective name this rank rather than fail as if they were the cause, which is
    what torchrun would report."""
    if dist.is_initialized():
        try:
            fates.record("left")
        except (RuntimeError, ValueError):  # the store's host left already: the raw error is all there is
            pass
        dist.destroy_process_group()


def trace(message: str) -> None:
    """VERBOSE=1: one line, prefixed with the rank, in one write, so ranks' lines never collide mid-line."""
    if VERBOSE:
        rank = dist.get_rank() if dist.is_initialized() else env_rank()
        os.write(sys.stdout.fileno(), f"[rank {rank}] {message}\n".encode())


def choose_backend(local_world_size: int) -> str:
    """NCCL needs one GPU per rank (it refuses two ranks on one GPU); everything else runs on gloo."""
    forced = os.environ.get("MINI_DIST_BACKEND")
    if forced:
        return forced
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world_size:
        return "nccl"
    return "gloo"


def timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=float(os.environ.get("MINI_DIST_TIMEOUT", "120")))


def setup(backend: str | None = None, seed: int = 0) -> Env:
    """Join the default process group described by torchrun's variables (a single process without them)."""
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(free_port())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    backend = backend or choose_backend(int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    require(backend in ("gloo", "nccl"), f"backend {backend!r} is not supported: use gloo or nccl")
    require(backend != "nccl" or torch.cuda.device_count() > local_rank,
            f"NCCL needs a CUDA GPU per rank and this machine has {torch.cuda.device_count()} for local "
            f"rank {local_rank}: unset MINI_DIST_BACKEND (or set it to gloo) to run on the CPU")
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        # device_id: NCCL connects this group, and every group made later, at once, so a group's first call
        # may be a batch_isend_irecv of some of its ranks (connected lazily, torch requires all of them in it)
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout(),
                                device_id=device if backend == "nccl" else None)
        atexit.register(leave)  # an exit outside main(): a script's sys.exit, an uncaught error
        if world > 1:
            fates.listen()  # the survivors of a rank that ends without a word still learn that it ended
            fates.hook_uncaught_errors()  # an uncaught error is recorded as this rank's own, or its cause's
    tracing.start()  # if --trace asked for one: record from here to shutdown()
    torch.manual_seed(seed)
    return Env(rank, world, local_rank, backend, device)


def free_port() -> int:
    """A port the OS says is free right now (never a fixed one: fixed ports collide on shared machines)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def device() -> torch.device:
    """The device this rank computes on: its own GPU under NCCL, the CPU under gloo."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


PRETEND_NCCL = False  # mini_dist.nccl_order sets it while it records a run on gloo: take NCCL's paths


def nccl(group=None) -> bool:
    """Whether point-to-point patterns on this group must obey NCCL's in-order rule (see nccl_order.py)."""
    return PRETEND_NCCL or dist.get_backend(group) == dist.Backend.NCCL


def new_group(ranks) -> dist.ProcessGroup:
    """A subgroup with the same timeout as the world (every rank of the world must call this)."""
    return dist.new_group(sorted(ranks), timeout=timeout())


def print0(*args, **kwargs) -> None:
    """Print on rank 0 only; before the process group exists, rank 0 is the one torchrun called 0."""
    if (dist.get_rank() if dist.is_initialized() else env_rank()) == 0:
        print(*args, **kwargs, flush=True)


def conclude(module: str, check_ok: bool, check: str, figure_ok: bool, figure: str) -> int:
    """Agree on pass/fail across ranks, print the tour's summary line, tear down, return the exit code."""
    ok = torch.tensor([int(check_ok), int(figure_ok)], device=device())
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    check_ok, figure_ok = bool(ok[0]), bool(ok[1])
    print0(f"SUMMARY|{module}|{'PASS' if check_ok else 'FAIL'} {check}|"
           f"{'PASS' if figure_ok else 'FAIL'} {figure}")
    shutdown()
    return 0 if check_ok and figure_ok else 1


def shutdown() -> None:
    """Wait for everyone, then leave. gloo's monitored barrier names any rank that never arrives."""
    if dist.is_initialized():
        tracing.finish()  # if --trace asked for one: every rank's records to rank 0, which writes the file
        if dist.get_backend() == "gloo" and dist.get_world_size() > 1:
            dist.monitored_barrier(timeout=timeout())
        else:
            dist.barrier()
        dist.destroy_process_group()


def parser() -> argparse.ArgumentParser:
    return demo_parser(__doc__)


def demo(args) -> int:
    env = setup()
    print(f"rank {env.rank}/{env.world_size} local_rank {env.local_rank} backend {env.backend} "
          f"device {env.device}", flush=True)
    total = torch.tensor([float(env.rank)], device=env.device)
    dist.all_reduce(total)
    expected = env.world_size * (env.world_size - 1) / 2
    return conclude("launch", total.item() == expected, f"all_reduce(rank) = {total.item():g}",
                    True, f"world {env.world_size} on {env.backend}/{env.device.type}")


if __name__ == "__main__":
    raise SystemExit(main(parser(), demo))
