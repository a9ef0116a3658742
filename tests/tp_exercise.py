"""The tensor-parallel exercise's judge: what column_parallel_linear and row_parallel_linear must give (the dense
nn.Linear's output and gradients, this rank's slices of them, within the bound of their arithmetic), and the
classic mistakes, recognised from what the learner's function produced.

The bound: every value compared is a sum of products (an output element of x W^T + b sums in+1 terms, an
element of dL/dx sums out, of dL/dW and dL/db one per token). Summed in any order, in any pieces (a matmul
split in T partial products added by an all-reduce), each is within gamma_k * sum|terms| of the exact sum
(Higham 2002, sec. 3.1; gamma_k = k*u / (1 - k*u), u = 2^-53, k terms and products); the dense layer's sum is too,
so the two differ by at most 2 gamma_(k+2) * sum|terms| (two more for the bias and the rounding of the bound).
A missing or doubled reduction, a bias added T times or another slice of the weight is an O(1) error.
"""
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F

from grading import mistake
from harness import device
from mini_dist import tensor_parallel as tp  # looked up at call time: in a check, the learner's copy
from ring_exercise import gamma

F64 = torch.float64
WAITED = "ran no backward: ranks"  # what a rank says whose peer's forward raised

# each is made by a wrong solution of tests/bank_tensor_parallel.py (tests/test_exercise.py holds that)
MISTAKES = {
    "f missing": ("column_parallel_linear", "each rank's x.grad is only its columns' share of dL/dx: pass x "
                  "through f (identity forward, all-reduce of the gradient backward) before the matmul"),
    "g missing": ("row_parallel_linear", "each rank's product with its rows is one partial sum of the output: "
                  "sum them over the ranks with g before returning"),
    "bias added on every rank": ("row_parallel_linear", "the bias is whole on every rank: added before the sum, "
                                 "it is summed T times; add it once, to the sum"),
    "bias divided among the ranks": ("row_parallel_linear", "b/T added on each rank before the sum gives the "
                                     "right output, but each rank's bias then gets 1/T of its gradient: add "
                                     "the whole bias after the sum"),
    "f and g swapped": ("column_parallel_linear", "f (identity forward, all-reduce backward) goes before a "
                        "column layer, g (all-reduce forward, identity backward) after a row layer"),
    "weight read as [in, out]": ("column_parallel_linear", "weight is nn.Linear's [out, in] (its rows are output "
                                 "features): x @ weight.T, or F.linear(x, weight, bias)"),
    "the slice cut again": ("column_parallel_linear", "weight and bias are this rank's slices already "
                            "(tp_layout cut them): use them whole"),
}


def case(column, dense, x, dy, group):
    """This rank's arguments of the function under test, what it must return, and the bounds: (args, [(what,
    want, bound)]) for the output, grad x, grad weight, grad bias, this rank's slices of the dense layer's."""
    T = dist.get_world_size(group)
    r = dist.get_rank(group)

    def cut(t, dim):
        """This rank's slice of a dense tensor along dim, a tensor of its own."""
        return t.detach().chunk(T, dim)[r].clone()
    x = x.detach().requires_grad_()
    out = dense(x)
    out.backward(dy)
    W = dense.weight
    b = dense.bias
    n_in = W.shape[1]
    tokens = x.shape[:-1].numel()
    bounds = [2 * gamma(n_in + 3, F64) * F.linear(x.abs(), W.abs(), b.abs()).detach(),  # x W^T + b: in+1 terms
              2 * gamma(W.shape[0] + 2, F64) * (dy.abs() @ W.abs()).detach(),          # dL/dx: out terms
              2 * gamma(tokens + 2, F64) * (dy.abs().flatten(0, -2).T @ x.abs().flatten(0, -2)).detach(),
              2 * gamma(tokens + 2, F64) * dy.abs().flatten(0, -2).sum(0)]
    dim = 0 if column else 1  # nn.Linear's weight is [out, in]: a column layer cuts its rows, a row layer its columns
    args = [x.detach().clone() if column else cut(x, -1), cut(W, dim), cut(b, 0) if column else b.detach().clone()]
    pairs = [(out, bounds[0]), (x.grad, bounds[1]), (W.grad, bounds[2]), (b.grad, bounds[3])]
    cuts = [-1, None, dim, 0] if column else [None, -1, 1, None]
    want = [(t.detach() if c is None else cut(t, c), bound if c is None else cut(bound, c))
            for (t, bound), c in zip(pairs, cuts)]
    return args, [(what, *w) for what, w in zip(("output", "grad x", "grad weight", "grad bias"), want)]


def learners(column, args, dy_mine, group):
    """The learner's function on this rank's arguments: [output, grad x, grad weight, grad bias] (None where
    none), or the one line that says what it raised, and where in the learner's file. A rank that raised tells the
    others before backward (all_gather_object, as comm's checks under MINI_DIST_DEBUG=1), so none waits for it."""
    fn = tp.column_parallel_linear if column else tp.row_parallel_linear
    leaves = [a.clone().requires_grad_() for a in args]
    raised = None
    try:
        out = fn(*leaves, group)
    except Exception as e:  # noqa: BLE001  the learner's error, in one line
        raised = e
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, raised is None, group=group)
    if raised is not None:
        if isinstance(raised, NotImplementedError):  # a blank: its own words say what to write
            return f"{fn.__name__} raised NotImplementedError: {raised}"
        return (f"{fn.__name__} raised {type(raised).__name__}: {raised}{where_raised(raised)} (called with x "
                f"{shape(args[0])}, weight {shape(args[1])}, bias {shape(args[2])}: "
                f"{'x whole, my rows' if column else 'my x features, my columns'} of nn.Linear's [out, in] weight)")
    if not all(ok is True for ok in everyone):
        return f"{WAITED} {[q for q, ok in enumerate(everyone) if ok is not True]} of the group raised"
    try:
        if isinstance(out, torch.Tensor) and out.requires_grad:  # a wrong shape too: the ranks stay in step
            out.backward(dy_mine if out.shape == dy_mine.shape else torch.zeros_like(out))
    except Exception as e:  # noqa: BLE001
        return f"{fn.__name__}'s backward raised {type(e).__name__}: {e}{where_raised(e)}"
    return [out] + [leaf.grad for leaf in leaves]


def shape(t) -> str:
    return str(list(t.shape))


def where_raised(e: Exception) -> str:
    """' at tensor_parallel.py:LINE in FUNCTION: CODE', the learner's own line the error came from, if any."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == tp.__file__]
    return f" at tensor_parallel.py:{frames[-1].lineno} in {frames[-1].name}: {frames[-1].line}" if frames else ""


def first_difference(rank, got, expected) -> str | None:
    """The first of output, grad x, grad weight, grad bias beyond its bound: rank, element, got, want ± bound."""
    for ours, (what, want, bound) in zip(got, expected):
        if not isinstance(ours, torch.Tensor):
            return f"rank {rank}: {what} is {ours!r}, want a tensor of shape {tuple(want.shape)}"
        if ours.shape != want.shape:
            return f"rank {rank}: {what} has shape {tuple(ours.shape)}, want {tuple(want.shape)}"
        off = ((ours.detach() - want).abs() > bound) | ours.isnan()
        if off.any():
            at = tuple(int(i) for i in off.nonzero()[0])
            return (f"rank {rank}: {what}{list(at)} = {ours[at].item():.6g}, want {want[at].item():.6g} ± "
                    f"{bound[at].item():.2g} (a sum of products in any order: |err| <= 2 gamma_k * sum|terms|)")
    return None


def close(ours, want, bound) -> bool:
    """ours is want within the bound (of the same arithmetic, a few more terms: 4x)."""
    return isinstance(ours, torch.Tensor) and ours.shape == want.shape and bool(
        ((ours.detach() - want).abs() <= 4 * bound + 1e-300).all())


def linear_mistake(column, dense, x, dy, args, got, expected, group) -> str | None:
    """The classic mistake behind a column or row layer's wrong results, read from them: each is a known
    function of this rank's and the dense layer's tensors."""
    T = dist.get_world_size(group)
    r = dist.get_rank(group)
    out, dx, _, db = got
    (_, want_out, out_bound), (_, _, dx_bound), _, (_, want_db, db_bound) = expected
    xin, w, b = args
    W = dense.weight.detach()
    if w.shape[0] == w.shape[1]:  # x @ weight runs: the weight read as [in, out]
        as_in_out = xin @ w + b if column else sum(p @ q for p, q in zip(x.chunk(T, -1), W.chunk(T, 1))) + b
        if close(out, as_in_out, out_bound * T):
            return mistake(MISTAKES, "weight read as [in, out]", f"rank {r}'s output is x @ weight, not x @ "
                           f"weight.T", None if column else "row_parallel_linear")
    if T < 2:
        return None
    if column:
        if close(out, sum(dense(x).detach().chunk(T, -1)), out_bound * T):
            return mistake(MISTAKES, "f and g swapped", f"rank {r}'s output is the sum of every rank's out/T "
                           f"columns: g sums its input over the ranks in forward")
        if close(out, want_out, out_bound) and close(dx, dy.chunk(T, -1)[r] @ w, dx_bound):
            return mistake(MISTAKES, "f missing", f"rank {r}'s x.grad is dy_{r} W_{r}, its own columns' share "
                           f"of dL/dx, not the sum of the {T} ranks' shares")
        if isinstance(out, torch.Tensor) and out.dim() and out.shape[-1] < len(b):
            return mistake(MISTAKES, "the slice cut again", f"rank {r}'s output has {out.shape[-1]} features, "
                           f"not the {len(b)} of its slice")
        return None
    partial = xin @ w.T
    alone = close(out, partial + b, out_bound) or close(out, partial, out_bound)
    if alone and close(dx, T * (dy @ w), dx_bound * T):
        return mistake(MISTAKES, "f and g swapped", f"rank {r}'s output is its own partial product (f's forward "
                       f"is the identity) and its x.grad {T} (T) times dL/dx_{r} (f's backward sums the same dy "
                       f"over the ranks)", "row_parallel_linear")
    if alone:
        return mistake(MISTAKES, "g missing", f"rank {r}'s output is its own partial product x_{r} W_{r}^T, "
                       f"one of the {T} that sum to the output")
    if close(out, want_out + (T - 1) * b.detach(), out_bound * T):
        return mistake(MISTAKES, "bias added on every rank", f"the output is (T-1) b = {T - 1} b too large: "
                       f"each of the {T} ranks added b before the sum")
    if close(out, want_out, out_bound) and close(db, want_db / T, db_bound):
        return mistake(MISTAKES, "bias divided among the ranks", f"the output is right, but rank {r}'s bias "
                       f"gradient is 1/{T} of dL/db")
    return None


def probe(column, group) -> str | None:
    """After the learner's function raised: what does it compute where it runs? On a square weight of 2T
    features (x @ weight runs; a slice cut again into T has 2 rows), the same x, weight and bias on every rank."""
    T = dist.get_world_size(group)
    g = torch.Generator().manual_seed(7)
    n = 2 * T
    x, w, b = (torch.randn(shape, dtype=F64, generator=g).to(device()) for shape in ((2, n), (n, n), (n,)))
    fn = tp.column_parallel_linear if column else tp.row_parallel_linear
    try:
        out = fn(x, w, b, group)
    except Exception:  # noqa: BLE001  it raises here too: nothing more to name
        return None
    if not isinstance(out, torch.Tensor):
        return None
    if out.shape == (2, n) and any(torch.allclose(out, x @ w * times + b) for times in (1, T)):
        return mistake(MISTAKES, "weight read as [in, out]", "on a square weight it computes x @ weight; on this "
                       "case's shapes x @ weight cannot be multiplied", None if column else "row_parallel_linear")
    if column and T > 1 and out.shape == (2, 2):
        return mistake(MISTAKES, "the slice cut again", f"given a slice of {n} output features it returns 2: "
                       f"it cut the slice into {T} again (here: too few features to cut)")
    return None


def judged(column, dense, x, dy, group):
    """On a rank of the group: (the first way this rank's results leave the contract, with the mistake behind it
    where one is recognised, else None; the tensor every rank of the group must hold bit for bit: a row layer's
    output, a column layer's x.grad)."""
    T = dist.get_world_size(group)
    r = dist.get_rank(group)
    args, expected = case(column, dense, x, dy, group)
    dy_mine = dy.chunk(T, -1)[r] if column else dy
    got = learners(column, args, dy_mine, group)
    if isinstance(got, str):
        found = None if "NotImplementedError" in got else probe(column, group)  # on every rank: in step
        return f"rank {r}: {got}" + (f"\n{found}" if found else ""), None
    wrong = first_difference(r, got, expected)
    if wrong:
        found = linear_mistake(column, dense, x, dy, args, got, expected, group)
        return wrong + (f"\n{found}" if found else ""), None
    return None, (got[1] if column else got[0]).detach().cpu()


def disagreement(results, what) -> str | None:
    """Ranks of one group whose `what` (the result of an all-reduce) differs in any bit."""
    groups = {}
    for rank, result in enumerate(results):
        if result is not None:
            groups.setdefault(result[0], []).append((rank, result[1][1]))
    for members in groups.values():
        (first, ours), *others = members
        for rank, theirs in others:
            if ours is not None and theirs is not None and not torch.equal(ours, theirs):
                i = (ours != theirs).reshape(-1).nonzero()[0].item()
                return (f"rank {rank} and rank {first} of one group differ in {what} element {i}: "
                        f"{theirs.reshape(-1)[i].item():.17g} vs {ours.reshape(-1)[i].item():.17g}: an all-reduce "
                        f"gives every rank of the group the same bits")
    return None
