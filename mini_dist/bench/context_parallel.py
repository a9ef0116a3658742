"""Context parallelism: ring (context_parallel.py) and Ulysses (ulysses.py) against torch's ring and one process.

    ./run.sh bench 4 context_parallel

One causal attention, forward + backward, fp32, [b, H, S, d] = [1, 8, 2048, 32], cut over the C ranks of
the world in the zigzag layout. Rows:
- ring vs torch's ring (CPU only): the loop torch's context_parallel runs (_templated_ring_attention and its
  backward, head-tail load balance, K/V all-gathered once by default), fed the CPU flash-attention kernel, because
  context_parallel itself has no CPU dispatch for causal attention (tests/test_context_parallel.py says why).
  Same blocks, same merges, but torch's kernel is fused and never builds a score tile; ours runs matmul,
  exp, matmul on a (S/2C)^2 tile, so no target: the row says what fusing is worth.
- ring and Ulysses vs one process: F.scaled_dot_product_attention on the whole sequence on rank 0 alone
  (what one device would do), the others idle. With 4 ranks on 2 cores, C ranks can be at most 2x faster.
- ring vs contiguous: the same ring, the causal work spread evenly (zigzag) or piled on the last rank; zigzag
  must be the faster.
Each note carries the peak memory of one call (mini_dist/kit/measure.py: CPU heap sampled, a lower bound; CUDA's
allocator peak on GPUs), the largest over the ranks.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from mini_dist import bench
from mini_dist.kit import measure
from mini_dist.context_parallel import ring_attention
from mini_dist.sequence_layout import CONTIGUOUS, ZIGZAG, split_sequence
from mini_dist.ulysses import ulysses_attention
from mini_dist.kit.launch import device


def _step(attention, full, causal=True, layout=ZIGZAG):
    """Forward + backward of attention on this rank's part of the whole (q, k, v, dout)."""
    mine = [split_sequence(t, layout=layout).requires_grad_() for t in full[:3]]
    dout = split_sequence(full[3], layout=layout)
    return lambda: attention(*mine, causal=causal, layout=layout).backward(dout)


def _one_process(full):
    """The whole attention on rank 0, as on one device; the other ranks wait at the timer's barrier."""
    whole = [t.clone().requires_grad_() for t in full[:3]]

    def step():
        if dist.get_rank() == 0:
            F.scaled_dot_product_attention(*whole, is_causal=True).backward(full[3])
    return step


def _torch_ring(full):
    """torch's ring-attention loop (context_parallel's, for CUDA kernels) on the CPU flash-attention kernel."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as torch_cp
    aten = torch.ops.aten
    q, k, v, dout = (split_sequence(t) for t in full)

    def step():
        saved, torch_cp._cp_options.enable_load_balance = torch_cp._cp_options.enable_load_balance, True
        try:
            out, lse = torch_cp._templated_ring_attention(
                dist.group.WORLD, 2, aten._scaled_dot_product_flash_attention_for_cpu.default, q, k, v,
                is_causal=True)
            torch_cp._templated_ring_attention_backward(
                dist.group.WORLD, 2, aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
                grad_out=dout, grad_out_name="grad_out", query=q, key=k, value=v, out=out, logsumexp=lse,
                is_causal=True, dropout_p=0.0)
        finally:
            torch_cp._cp_options.enable_load_balance = saved
    return step


def _peak_mib(step) -> float:
    peak = torch.tensor([measure.peak_bytes(step, device()) / 2 ** 20], dtype=torch.float64, device=device())
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return peak.item()


def attention(args, b=1, H=8, S=2048, d=32, repeats=7) -> list[bench.Result]:
    C = dist.get_world_size()
    torch.manual_seed(0)  # every rank: the same whole sequence
    full = [torch.randn(b, H, S, d, device=device()) for _ in range(4)]
    steps = {"ring": _step(ring_attention, full), "one process": _one_process(full),
             "contiguous": _step(ring_attention, full, layout=CONTIGUOUS)}
    rows = [("ring", "one process", None), ("ring", "contiguous", 1.0)]
    if device().type == "cpu":  # the CPU flash kernel drives torch's ring; on CUDA it would need the CUDA kernels
        steps["torch ring"] = _torch_ring(full)
        rows.insert(0, ("ring", "torch ring", None))
    if H % C == 0:
        steps["Ulysses"] = _step(ulysses_attention, full)
        rows.insert(-1, ("Ulysses", "one process", None))
    peak = {name: _peak_mib(step) for name, step in steps.items()}
    return [bench.compare(f"context_parallel {ours} vs {native}, C={C}", steps[ours], steps[native], repeats, target,
                          note=f"b={b} H={H} S={S} d={d} fp32 causal; peak {peak[ours]:.1f} vs {peak[native]:.1f} MiB")
            for ours, native, target in rows]


BENCHES = {"context_parallel": attention}
