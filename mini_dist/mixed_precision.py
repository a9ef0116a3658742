"""Mixed precision: compute in fp16/bf16, keep fp32 master weights, scale the loss so gradients survive.

    format  sign|exponent|mantissa   max        smallest normal   spacing at 1.0
    fp32    1|8|23                   3.4e38     1.2e-38           2^-23
    bf16    1|8|7                    3.4e38     1.2e-38           2^-7
    fp16    1|5|10                   65504      6.1e-5            2^-10

Half precision halves the bytes of every weight, activation and message, and runs on tensor cores; it
loses in three ways (Micikevicius et al., "Mixed Precision Training", 2018), each with its fix:
- overflow: past 65504 fp16 rounds to inf, and inf - inf = NaN.       fix: a smaller loss scale, or bf16
- underflow: below fp16's smallest subnormal (6e-8) a gradient is 0.  fix: loss scaling, or bf16
- precision: w + lr*g rounds back to w when |lr*g| < spacing(w)/2.     fix: fp32 master weights
bf16 keeps fp32's 8 exponent bits (its range), so what underflows fp16 is still a bf16 number and bf16
needs no loss scaling; it pays with 3 fewer mantissa bits than fp16, so it needs master weights even more.

Master weights: fp16's spacing at 1.0 is ~1e-3 (bf16: ~8e-3), so an update of 1e-4 never lands. Naive:
the optimizer steps the half weights, and training stalls once updates drop below half the spacing.
Master weights: the optimizer steps an fp32 copy; the model's half copy is refreshed from it after each
step, and tiny updates accumulate in fp32 until they cross a rounding boundary. With a loss scale S:

    loss -> scale(loss).backward() [half grads, times S] -> grads_to_master() [fp32] -> step
         [divides by S in fp32, skips on inf/NaN] -> update() [S] -> master_to_model() [round to half]

The loss scaler is mini_dist/loss_scaling.py (agreed across ranks: sharded_loss_scaling.py). The demo prints
the formats' bits, each failure beside its fix, and a regression trained in fp32, fp16 and bf16 with and
without master weights, the master-weight path checked bit for bit with torch.amp.GradScaler in place of our
scaler:

    torchrun --standalone --nproc_per_node=1 mini_dist/mixed_precision.py [--lr 2e-3]

Mirrors the fp32 master copy that torch.distributed.fsdp.MixedPrecisionPolicy and apex's O2 keep.
"""
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

if not __package__:  # run as `torchrun mini_dist/x.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist.kit import launch
from mini_dist.loss_scaling import DynamicLossScaler


# ----- the three ways half precision loses, each as one computation -----

def overflow(dtype) -> torch.Tensor:
    """300*300 - 300*300: in fp16, 90000 > 65504 rounds to inf, and inf - inf = NaN."""
    x = torch.tensor(300.0, dtype=dtype, device=launch.device())
    return x * x - x * x


def underflow(dtype) -> torch.Tensor:
    """1e-4 * 1e-4 = 1e-8: in fp16, below its smallest subnormal (6e-8), it is 0."""
    x = torch.tensor(1e-4, dtype=dtype, device=launch.device())
    return x * x


def lost_update(dtype) -> torch.Tensor:
    """1 + 1e-4: in fp16 and bf16, under half the spacing at 1.0, the sum rounds back to 1."""
    one = torch.tensor(1.0, dtype=dtype, device=launch.device())
    return one + torch.tensor(1e-4, dtype=dtype, device=launch.device())


# ----- the fix for the third: fp32 master weights -----

class MasterWeights:
    """fp32 copies of a half model's parameters: give `.params` to the optimizer.

    loss -> scaler.scale(loss).backward() -> grads_to_master() -> scaler.step(opt) -> scaler.update()
    -> master_to_model()
    """

    def __init__(self, model_params):
        self.model_params = list(model_params)
        self.params = [p.detach().to(torch.float32, copy=True).requires_grad_(p.requires_grad)
                       for p in self.model_params]

    def grads_to_master(self) -> None:
        """Widen the (still scaled) half gradients to fp32, where dividing by S cannot underflow."""
        for p, m in zip(self.model_params, self.params):
            m.grad = None if p.grad is None else p.grad.to(torch.float32)
            p.grad = None

    @torch.no_grad()
    def master_to_model(self) -> None:
        for p, m in zip(self.model_params, self.params):
            p.copy_(m)  # rounds to the nearest half: the model computes with this, fp32 keeps the rest


def regression_problem(seed: int = 0, n: int = 32, d: int = 8):
    """Least squares whose weights sit in [1, 2), where fp16's spacing is 2^-10 (bf16's 2^-7)."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, d, generator=g)  # cpu: the same numbers for every device; the callers move them
    w0 = 1 + torch.rand(d, generator=g)  # cpu: as X
    y = X @ (w0 + 0.05 * torch.randn(d, generator=g))  # cpu: as X
    return X, y, w0


def train_regression(dtype, master: bool, steps: int = 400, lr: float = 2e-3, seed: int = 0, scaler=None):
    """SGD in `dtype`, naive or with fp32 master weights and a loss scaler (ours unless one is given);
    returns the fp32 loss after every step, and the final weights."""
    X, y, w0 = (t.to(launch.device()) for t in regression_problem(seed))  # NCCL all-reduces GPU flags only
    w = w0.to(dtype).requires_grad_()
    masters = MasterWeights([w]) if master else None
    opt = torch.optim.SGD(masters.params if master else [w], lr=lr)
    scaler = scaler or DynamicLossScaler(init_scale=2.0**10)  # gradients here are ~0.1: no underflow to fight
    losses = [F.mse_loss(X @ w.detach().float(), y).item()]
    for _ in range(steps):
        loss = F.mse_loss(X.to(dtype) @ w, y.to(dtype))
        if master:
            scaler.scale(loss).backward()
            masters.grads_to_master()
            scaler.step(opt)
            scaler.update()
            masters.master_to_model()
        else:
            loss.backward()
            opt.step()
            opt.zero_grad()
        losses.append(F.mse_loss(X @ w.detach().float(), y).item())
    return losses, w.detach()


def update_to_spacing(dtype, lr: float = 2e-3, seed: int = 0) -> float:
    """max |lr*g| / (spacing(w)/2) at the start: below 1, w - lr*g rounds back to w in `dtype`."""
    X, y, w0 = (t.to(launch.device()) for t in regression_problem(seed))  # where train_regression runs
    w = w0.to(dtype).requires_grad_()
    F.mse_loss(X.to(dtype) @ w, y.to(dtype)).backward()
    spacing = torch.nextafter(w.detach(), torch.full_like(w.detach(), math.inf)) - w.detach()
    return (lr * w.grad.float().abs() / (spacing.float() / 2)).max().item()


# ----- naive half weights beside master weights: which runs stall, and why -----

RUNS = [("fp32", torch.float32, False), ("fp16+master", torch.float16, True), ("fp16", torch.float16, False),
        ("bf16+master", torch.bfloat16, True), ("bf16", torch.bfloat16, False)]  # name, dtype, master weights


def master_weights_vs_half(steps: int = 200, lr: float = 2e-3) -> tuple[str, bool]:
    """Question 20, and the demo's regression: SGD in fp32, and in fp16 and bf16 with and without fp32 master
    weights. Holds when each half run without them stalls exactly where its update is under half the spacing
    (update_to_spacing < 1), and fp16 with master weights ends no farther from fp32 than it started."""
    runs = {}
    for name, dtype, master in RUNS:
        runs[name], _ = train_regression(dtype, master, steps, lr)
    ratio = {"fp16": update_to_spacing(torch.float16, lr), "bf16": update_to_spacing(torch.bfloat16, lr)}
    fp32 = runs["fp32"]
    fp16_master = runs["fp16+master"]
    follows = abs(fp16_master[-1] - fp32[-1]) <= abs(fp16_master[0] - fp32[0])
    stalls = all((runs[name][-1] == runs[name][0]) == (r < 1) for name, r in ratio.items())
    losses = ", ".join(f"{name} {loss[0]:.5f} -> {loss[-1]:.5f}" for name, loss in runs.items())
    figure = (f"least squares, weights in [1, 2), SGD lr {lr:g}: max |lr*g| / (spacing(w)/2) at the start is fp16 "
              f"{ratio['fp16']:.2f}, bf16 {ratio['bf16']:.2f} (< 1: the update rounds away); loss over {steps} steps: "
              f"{losses}")
    return figure, follows and stalls


# ----------------------------------------------------------------------------- demo

def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("--lr", type=float, default=2e-3, help="SGD step of the fp32 / fp16 / bf16 regression")
    p.add_argument("--steps", type=int, default=400, help="SGD steps of the regression")
    return p


FORMATS = [("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)]
FAILURES = [("overflow  300*300 - 300*300", overflow, "lower S, or bf16"),
            ("underflow 1e-4 * 1e-4      ", underflow, "loss scaling, or bf16"),
            ("spacing   1 + 1e-4         ", lost_update, "fp32 master weights")]


def bits(x: float, dtype: torch.dtype) -> str:
    """sign|exponent|mantissa of x stored in dtype."""
    info = torch.finfo(dtype)
    expo = info.bits - 1 - round(-math.log2(info.eps))  # the rest of the bits are the mantissa
    word = torch.tensor([x], dtype=dtype).view({16: torch.int16, 32: torch.int32}[info.bits]).item()  # cpu: read back
    s = format(word & ((1 << info.bits) - 1), f"0{info.bits}b")  # two's complement -> raw bits
    return f"{s[0]}|{s[1:1 + expo]}|{s[1 + expo:]}"


def demo(args) -> int:
    launch.require(args.lr > 0 and args.steps >= 1, "--lr must be positive and --steps at least 1")
    env = launch.setup()
    say = launch.print0
    say("format  max / smallest normal, as sign|exponent|mantissa bits")
    for name, dtype in FORMATS:
        info = torch.finfo(dtype)
        say(f"{name:5} max {info.max:<12.6g}= {bits(info.max, dtype)}\n"
            f"{'':5} min {info.smallest_normal:<12.6g}= {bits(info.smallest_normal, dtype)}")
    for what, failure, fix in FAILURES:
        values = "".join(f"{name} {failure(dtype).item():<12.6g}" for name, dtype in FORMATS)
        say(f"{what}: {values}fix: {fix}")
    figure, follows = master_weights_vs_half(args.steps, args.lr)
    same = True  # the master-weight runs with our scaler, then with torch.amp.GradScaler as the loss scaler
    for name, dtype in FORMATS[1:]:
        ours = train_regression(dtype, True, args.steps, args.lr)
        native = train_regression(dtype, True, args.steps, args.lr,
                                  scaler=torch.amp.GradScaler(env.device.type, init_scale=2.0**10))
        same = same and ours[0] == native[0] and torch.equal(ours[1], native[1])
    say(f"{figure}\nmaster weights with torch.amp.GradScaler instead of DynamicLossScaler: bit-identical: {same}")
    return launch.conclude("mixed_precision", same, "master weights + our scaler = + GradScaler, bit-exact",
                           follows, "fp16+master follows fp32; fp16 and bf16 alone stall where |lr*g| < spacing/2")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
