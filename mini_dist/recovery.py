"""Training that survives a dead rank: checkpoint every E steps, let torchrun restart the group, resume.

Distributed jobs fail as a group: when one rank dies (a lost GPU, an out-of-memory, a preempted node) every
other rank blocks in its next collective. Rather than make ranks immortal, make a restart cheap and exact:

    every E steps   save parameters, optimizer, data order and RNG states (checkpoint.py: 1/K per rank)
    a rank dies     torchrun --max-restarts=1 stops the others and starts the whole group again
    on start        load the newest complete checkpoint (a save that died has no manifest: it is ignored)
    then            go on from its step: lost work <= E - 1 steps, plus the restart

The resumed run is the same run only if everything that decides the next step was saved: the parameters
and optimizer state, the data order (each epoch's permutation comes from seed + epoch, as
DistributedSampler.set_epoch does, plus the position in it), and each rank's RNG state (its dropout masks),
saved as row r of a [K, n] tensor. The demo also resumes the way a naive restart would, with fresh RNGs
and the epoch started over: its loss curve leaves the uninterrupted one at the first step after the restart.

    torchrun --standalone --nproc_per_node=4 --max-restarts=1 mini_dist/recovery.py [--steps 12 --kill-at 10]

Without torchrun's restarts (./run.sh demo recovery 4 starts none) the crash is simulated in the process:
every object of the run is dropped, the global RNG is scrambled, and the same resume path runs.
Mirrors torchrun's elastic restarts (torch.distributed.elastic) with DCP checkpoints, as TorchTitan does.
"""
import os
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

if not __package__:  # run as `torchrun mini_dist/recovery.py`: Python put mini_dist/ on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist import checkpoint
from mini_dist.checkpoint_plan import Sharded
from mini_dist.fsdp import FullyShardedDataParallel
from mini_dist.kit import launch
from mini_dist.reshard import fsdp_layout, load_module_state, module_state
from mini_dist.reshard_zero import load_zero_state, zero_state
from mini_dist.zero_optimizer import ZeroOptimizer


class ResumableSampler:
    """DistributedSampler's order -- a permutation per epoch drawn from seed + epoch, rank r taking every
    K-th index of it -- plus where the run stands in it, so a resumed run draws the batches the lost one would."""

    def __init__(self, size: int, batch: int, seed: int = 0, group=None):
        self.size = size
        self.batch = batch
        self.seed = seed
        self.epoch = 0
        self.position = 0  # batches of this epoch drawn
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.per_epoch = size // self.world // batch  # batches per rank per epoch (the remainder is dropped)
        if self.per_epoch < 1:
            raise ValueError(f"{size} samples cannot give {self.world} ranks a batch of {batch} each")

    def next(self) -> torch.Tensor:
        """This rank's next batch of sample indices."""
        if self.position == self.per_epoch:
            self.epoch += 1
            self.position = 0
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.size, generator=g)  # cpu: sample indices, the same on every device
        mine = order[:self.per_epoch * self.batch * self.world][self.rank::self.world]
        self.position += 1
        return mine[(self.position - 1) * self.batch:self.position * self.batch]

    def state(self) -> dict:
        """Where the run stands in the data, for a checkpoint."""
        return {"epoch": self.epoch, "position": self.position}


def rng_state(group=None) -> Sharded:
    """Every rank's RNG state as row r of a [K, n] uint8 tensor: the CPU generator's, and its GPU's."""
    mine = [torch.get_rng_state()]
    if launch.device().type == "cuda":
        mine.append(torch.cuda.get_rng_state())
    row = torch.cat(mine)
    return Sharded((dist.get_world_size(group), len(row)), row.dtype, (((dist.get_rank(group), 0), row[None]),))


def set_rng_state(row: torch.Tensor) -> None:
    """This rank's row of rng_state() back into its generators."""
    torch.set_rng_state(row[:len(torch.get_rng_state())].clone())
    if launch.device().type == "cuda":
        torch.cuda.set_rng_state(row[len(torch.get_rng_state()):].clone())


def checkpoints(directory: str) -> dict:
    """{step: path} of every checkpoint directory, complete or not."""
    names = os.listdir(directory) if os.path.isdir(directory) else []
    return {int(n[5:]): os.path.join(directory, n) for n in names if n.startswith("step_") and n[5:].isdigit()}


def complete(directory: str) -> list:
    """(step, path) of the checkpoints that have a manifest, oldest first: the others never finished saving."""
    return [(s, p) for s, p in sorted(checkpoints(directory).items())
            if os.path.exists(os.path.join(p, checkpoint.MANIFEST))]


def prune(directory: str, keep: int) -> None:
    """Keep the newest `keep` complete checkpoints and whatever is newer (a save in progress); delete the
    older ones, each manifest first, so that a half-deleted checkpoint does not exist either."""
    kept = complete(directory)[-keep:]
    for step, path in checkpoints(directory).items():
        if kept and step < kept[0][0]:
            Path(path, checkpoint.MANIFEST).unlink(missing_ok=True)
            shutil.rmtree(path)


class Crash(Exception):
    """The simulated death of the run, when torchrun will not restart it."""


def training_state(model, optimizer) -> dict:
    """Parameters and optimizer state as boxes: ZeRO's shards (reshard_zero.py), or FSDP's slices (reshard.py)."""
    if isinstance(optimizer, ZeroOptimizer):
        return zero_state(optimizer)
    return module_state(fsdp_layout(model), optimizer)


def load_training_state(path: str, model, optimizer, group=None) -> None:
    """The same state, loaded in place from checkpoint `path`."""
    if isinstance(optimizer, ZeroOptimizer):
        load_zero_state(path, optimizer, group)
    else:
        load_module_state(path, fsdp_layout(model), optimizer, group)


def train(args, save_to: str | None = None, resume_from: str | None = None, crash=None, remember=True):
    """The run: from checkpoint `resume_from` if given (remember=False: without its RNG states and data
    position, as a naive restart), saving every args.every steps into `save_to` if given; crash="exit":
    rank args.kill_rank dies before step args.kill_at, "raise": every rank raises Crash there.
    Returns (this rank's parameters and optimizer state, the mean loss of every step, the step resumed at)."""
    rank = dist.get_rank()
    group = None  # the whole world: torchrun restarts all of it
    torch.manual_seed(0)  # the same initial model everywhere, then each rank its own dropout masks
    model = nn.Sequential(nn.Linear(args.width, 4 * args.width), nn.Dropout(0.25), nn.Tanh(),
                          nn.Linear(4 * args.width, 1)).to(launch.device(), torch.float64)
    torch.manual_seed(1000 + rank)
    X = torch.randn(args.samples, args.width, generator=torch.Generator().manual_seed(0), dtype=torch.float64).to(
        launch.device())
    Y = torch.sin(3 * X).sum(1, keepdim=True)
    if args.sharding == "fsdp":
        model = FullyShardedDataParallel(model, group=group)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    else:
        optimizer = ZeroOptimizer(model.named_parameters(), torch.optim.Adam, stage=2, group=group, lr=0.01)
    sampler = ResumableSampler(args.samples, args.batch, group=group)
    step = 0
    losses = []  # the mean loss over the ranks, every step since the start
    if resume_from:
        load_training_state(resume_from, model, optimizer, group)
        extra = {"step": None, "losses": None, "sampler": None, "rng": rng_state(group)}
        checkpoint.load(extra, resume_from, group)
        step = extra["step"]
        losses = extra["losses"]
        if remember:
            sampler.epoch = extra["sampler"]["epoch"]
            sampler.position = extra["sampler"]["position"]
            _, rows = extra["rng"].boxes[0]
            set_rng_state(rows[0])
    start = step
    while step < args.steps:
        if crash == "raise" and step + 1 == args.kill_at:
            raise Crash()
        if crash == "exit" and step + 1 == args.kill_at and rank == args.kill_rank:
            os._exit(1)  # a rank dies; the others block in their next collective until torchrun stops them
        index = sampler.next()
        loss = ((model(X[index]) - Y[index]) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        mean = loss.detach() / dist.get_world_size()
        dist.all_reduce(mean)
        losses.append(mean.item())
        step += 1
        if save_to and step % args.every == 0:
            state = training_state(model, optimizer)
            state.update({"step": step, "losses": losses, "sampler": sampler.state(), "rng": rng_state()})
            checkpoint.save(state, os.path.join(save_to, f"step_{step:08d}"), group)
            if rank == 0:
                prune(save_to, args.keep)
    mine = [d.detach().clone() for v in training_state(model, optimizer).values() if isinstance(v, Sharded)
            for _, d in v.boxes]
    return mine, losses, start


# ----------------------------------------------------------------------------- demo

def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("--steps", type=int, default=12, help="training steps")
    p.add_argument("--every", type=int, default=4, help="save a checkpoint every E steps")
    p.add_argument("--keep", type=int, default=2, help="complete checkpoints kept on disk")
    p.add_argument("--kill-at", type=int, default=10, help="a rank dies before this step (once)")
    p.add_argument("--kill-rank", type=int, default=None, help="the rank that dies (default: the last)")
    p.add_argument("--sharding", choices=("fsdp", "zero"), default="fsdp", help="FSDP, or ZeRO-2")
    p.add_argument("--samples", type=int, default=96, help="dataset size (the epochs wrap around it)")
    p.add_argument("--batch", type=int, default=4, help="samples per rank per step")
    p.add_argument("--width", type=int, default=8, help="MLP width")
    p.add_argument("--dir", help="checkpoint directory (default: one per torchrun run, removed at the end)")
    return p


def join_attempt() -> None:
    """Join the group of this torchrun attempt. Every attempt gets the agent's TCPStore, where the dead
    attempt's ranks left their addresses; a new rank may read one and connect to a dead process
    (pytorch/pytorch#135712). So a restarted attempt keys its own under a prefix; launch.setup() then finds
    the group made. (The first attempt's store is fresh: it goes through launch.setup() alone.)"""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if attempt != "0" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and not dist.is_initialized():
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=launch.timeout())
        dist.init_process_group(launch.choose_backend(int(os.environ["LOCAL_WORLD_SIZE"])), timeout=launch.timeout(),
                                store=dist.PrefixStore(f"attempt_{attempt}", store), rank=launch.env_rank(),
                                world_size=launch.env_world_size())


def demo(args) -> int:
    import tempfile
    K = launch.env_world_size()
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")  # the same in every attempt of one torchrun run
    if args.kill_rank is None:
        args.kill_rank = K - 1
    launch.require(1 <= args.kill_at <= args.steps and min(args.every, args.keep, args.width, args.batch) >= 1,
                   "--kill-at must be within 1..--steps, and --every, --keep, --width, --batch >= 1")
    launch.require(0 <= args.kill_rank < K, f"--kill-rank must be a rank, 0..{K - 1}")
    launch.require(args.samples >= K * args.batch, f"--samples must give every one of the {K} ranks a batch")
    join_attempt()
    env = launch.setup()
    where = [args.dir or (os.path.join(tempfile.gettempdir(), f"mini_dist_recovery_{run_id}") if run_id else None)]
    if where[0] is None and env.rank == 0:  # no torchrun run to name it after: a fresh one, told to every rank
        where = [tempfile.mkdtemp(prefix="mini_dist_recovery_")]
    dist.broadcast_object_list(where)
    if attempt == "0":
        launch.print0(f"{args.sharding}, K = {K}: a checkpoint every {args.every} steps; rank {args.kill_rank} "
                      f"dies before step {args.kill_at}" + ("" if restarts else " (simulated: torchrun was not "
                                                             "given --max-restarts=1, so nothing would restart)"))
        try:
            train(args, where[0], crash="exit" if restarts else "raise")
        except Crash:
            torch.manual_seed(int.from_bytes(os.urandom(4), "little"))  # what a fresh process would have
    newest = (complete(where[0]) or [(0, None)])[-1][1]
    _, naive_losses, _ = train(args, None, newest, remember=False)  # first: the resumed run prunes `newest`
    resumed, resumed_losses, start = train(args, where[0], newest)
    reference, losses, _ = train(args)
    launch.print0(f"restarted{f' by torchrun (restart {attempt} of {restarts})' if restarts else ''}: resumed from "
                  f"{'step ' + str(start) if newest else 'the start (no complete checkpoint yet)'}, "
                  f"steps lost: {args.kill_at - 1 - start}\n step  uninterrupted  resumed  naive restart (fresh RNG, "
                  f"epoch started over)")
    marks = {start: " <- resumed here", args.kill_at: " <- the rank died before this step"}
    for i, (a, b, c) in enumerate(zip(losses, resumed_losses, naive_losses)):
        launch.print0(f"{i + 1:>5}  {a:.10f}  {'=' if a == b else f'{b:.10f}':^7}  "
                      f"{'=' if a == c else f'{c:.10f}'}{marks.get(i + 1, '')}")
    same = losses == resumed_losses and all(torch.equal(a, b) for a, b in zip(reference, resumed))
    diverged = newest is None or start == args.steps or naive_losses[start] != losses[start]
    if env.rank == 0 and not args.dir:
        shutil.rmtree(where[0])
    return launch.conclude("recovery", same, "killed and resumed = uninterrupted, bit for bit (parameters, Adam state, "
                           "losses)", diverged, f"lost {args.kill_at - 1 - start} <= E - 1 = {args.every - 1} steps; "
                           f"a naive restart leaves the curve at step {start + 1}")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
