"""What FSDP saves and what it costs, per rank: the bytes held and sent in one step, measured beside DDP's.

With fp32 Adam each parameter costs 4 bytes of weight, 4 of gradient and 8 of optimizer state. DDP holds
all of them on every rank; FSDP holds 1/K of each (the shards, N' = the units' padded sizes) plus the
units gathered at the moment, and pays for it with a second all-gather:

                 params    grads     Adam state   gathered (peak)              sent per step
    DDP          4N        4N        8N           -                            2 (K-1)/K 4N
    FSDP naive   4N'/K     4N'/K     8N/K         root + 1 unit                3 (K-1)/K 4N'
    prefetch     4N'/K     4N'/K     8N/K         root + 2 units               3 (K-1)/K 4N'
    kept         4N'/K     4N'/K     8N/K         every unit: 4N' at the turn  2 (K-1)/K 4N'

"kept" is reshard_after_forward=False: the whole model is alive from forward to backward, so its
parameters alone, 4N'/K + 4N', exceed DDP's 4N; what FSDP saves is the gradients and the optimizer
state, 12N of DDP's 16N, which only shrink when sharded. Every number is read from the tensors'
storages, FSDP's ledger and the wire's, never from the formula.

    torchrun --standalone --nproc_per_node=4 mini_dist/fsdp_ledger.py [--depth 6 --width 256]

The paper: Zhao et al., PyTorch FSDP (VLDB 2023), Sec. 3; ZeRO stage 3 (Rajbhandari et al., 2020).
"""
import sys
from pathlib import Path

import torch
import torch.distributed as dist

if not __package__:  # run as `torchrun mini_dist/fsdp_ledger.py`: Python put mini_dist/ on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist.ddp import DistributedDataParallel
from mini_dist.fsdp import BOOKED, FullyShardedDataParallel
from mini_dist.kit import launch, measure, models
from mini_dist.kit.wire import LEDGER
from mini_dist.ring_pipelined import ring_all_reduce
from mini_dist.zero_ledger import storage_bytes


def trained(width: int = 8, hidden: int = 32, depth: int = 3, steps: int = 2, **options):
    """FSDP (each Block a unit) over models.block_stack, fp32, after `steps` Adam steps on this rank's batch,
    zero_grad first: the ledger holds the last step, whose gradients are still there. -> (model, adam, the bytes
    a ring sends on this rank in that step)"""
    if steps < 1:
        raise ValueError(f"steps must be at least 1 (the ledger holds the last step), got {steps}")
    model = FullyShardedDataParallel(models.block_stack(width, hidden, depth, torch.float32, launch.device()),
                                     wrap=models.Block, **options)
    adam = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(4, width, generator=g).to(launch.device())
    y = torch.randn(4, width, generator=g).to(launch.device())

    def step():
        adam.zero_grad()
        (model(x) - y).square().mean().backward()
        adam.step()
    for _ in range(steps):
        sent = measure.step_sent(step, model.ledger, BOOKED, dist.get_world_size())
    return model, adam, sent


def memory_per_rank(model, optimizer) -> dict:
    """This rank's bytes by what they hold: params, grads, per-element optimizer state, and the peak of
    gathered parameters (FSDP's ledger; 0 for a model that keeps its parameters whole)."""
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    return {"params": storage_bytes(model.parameters()), "grads": storage_bytes(p.grad for p in model.parameters()),
            "state": storage_bytes(state), "gathered": model.ledger.peak if hasattr(model, "ledger") else 0}


def mean_over_ranks(x: float) -> float:
    """The mean of every rank's x: ring chunks (and so a rank's bytes) can differ by an element; their sum cannot."""
    t = torch.tensor([float(x)], dtype=torch.float64, device=launch.device())
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def ddp_sent(model) -> float:
    """Bytes mini DDP's ring all-reduce sends per rank in one backward of `model` (mean over the ranks)."""
    replica = DistributedDataParallel(model, all_reduce=ring_all_reduce)
    LEDGER.reset()
    replica(torch.randn(4, model[0].in_features, device=launch.device())).square().mean().backward()
    return mean_over_ranks(LEDGER.sent)


# ----------------------------------------------------------------------------- demo


def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("--depth", type=int, default=6, help="Blocks, one unit each (the root keeps 2 Linears)")
    p.add_argument("--width", type=int, default=256, help="model width (Block hidden: 4x)")
    return p


def demo(args) -> int:
    launch.require(args.depth >= 2 and args.width >= 1, "--depth must be at least 2, --width at least 1")
    K = launch.setup().world_size
    w = args.width
    kinds = {"FSDP naive": dict(prefetch=False), "FSDP prefetch": {}, "FSDP kept": dict(reshard_after_forward=False)}
    rows = {k: trained(w, 4 * w, args.depth, **o) for k, o in kinds.items()}
    ddp = models.block_stack(w, 4 * w, args.depth, torch.float32, launch.device())
    adam = torch.optim.Adam(ddp.parameters(), lr=1e-3)
    sent = {"DDP": ddp_sent(ddp)}  # its backward left the gradients, and a step makes Adam's state
    adam.step()
    memory = {"DDP": memory_per_rank(ddp, adam)} | {k: memory_per_rank(m, opt) for k, (m, opt, _) in rows.items()}
    sent |= {k: mean_over_ranks(sent_in_step) for k, (_, _, sent_in_step) in rows.items()}
    units = rows["FSDP naive"][0].units
    N = sum(u.numel for u in units)
    S = sum(u.shard_numel for u in units)  # N'/K: my padded shards
    full = [u.full.nbytes for u in units]
    mine = sum(p.numel() for p in rows["FSDP naive"][0].parameters())  # my shard's real elements
    peaks = {"FSDP naive": full[0] + max(full[1:]), "FSDP kept": sum(full),
             "FSDP prefetch": full[0] + max(a + b for a, b in zip(full[1:], full[2:]))}
    want = {"DDP": [4 * N, 4 * N, 8 * N, 0]} | {k: [4 * S, 4 * S, 8 * mine, peaks[k]] for k in kinds}
    gathers = {"FSDP naive": 2, "FSDP prefetch": 2, "FSDP kept": 1}  # all-gathers of each unit per step
    sent_want = {"DDP": 2 * (K - 1) * 4 * N / K} | {k: (gathers[k] + 1) * (K - 1) * 4 * S for k in kinds}
    launch.print0(f"fp32 Adam, K = {K}, N = {N:,} parameters (N' = {K * S:,} padded); bytes per rank (rank 0; "
                  f"every rank checked), bytes sent per rank per step (mean over ranks)\n"
                  f"{'':14}" + "".join(f"{c:>14}" for c in ("params", "grads", "Adam state", "gathered", "total",
                                                             "sent")))
    held_ok = True
    sent_ok = True
    for k, m in memory.items():
        got = [m["params"], m["grads"], m["state"], m["gathered"]]
        held_ok &= got == want[k]
        sent_ok &= sent[k] == sent_want[k]
        launch.print0(f"{k:14}" + "".join(f"{v:>12,} B" for v in [*got, sum(got)]) + f"{sent[k]:>12,.0f} B")
    saved = 1 - (sum(want["FSDP prefetch"][:3])) / sum(want["DDP"][:3])
    launch.print0(f"the saving FSDP exists for: gradients and Adam state, {want['DDP'][1] + want['DDP'][2]:,} B "
                  f"per rank under DDP, {4 * S + 8 * mine:,} B sharded ({100 * saved:.0f}% of DDP's params, grads "
                  f"and state gone). kept: every unit stays whole from forward to backward, so its params "
                  f"({4 * S + sum(full):,} B) exceed DDP's {4 * N:,} B.")
    ratio = sent["FSDP prefetch"] / max(sent["DDP"], 1)
    kept = sent["FSDP kept"] / max(sent["DDP"], 1)
    launch.print0(f"sent: FSDP gathers each unit for forward and again for backward, then reduce-scatters its "
                  f"gradients: 3(K-1)/K 4N' = {ratio:.2f}x DDP's 2(K-1)/K 4N; kept, one gather: {kept:.2f}x")
    figure = f"FSDP {ratio:.2f}x DDP's (3/2 at N' = N), kept {kept:.2f}x" if K > 1 else "1 rank: nothing sent"
    return launch.conclude("fsdp_ledger", held_ok, "params, grads, Adam state and gathered peak = the table",
                           sent_ok, f"bytes sent = the table: {figure}")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
