"""The expert-parallel exercise's judge: what dispatch and combine must leave on every rank (their docstrings'
contract), and the classic mistakes, recognised from what the learner's functions returned or sent.

Every rank builds every rank's tokens and routing (k different experts per token, some choices dropped, or every
token on the first k experts, so that the last ranks receive nothing): the one-process view. dispatch only moves
rows and counts, so its plan, counts and rows are compared exactly. combine sums at most k products per token:
y_t = sum_j w_tj * out_tj in any order is within gamma_(k+1) * sum_j |w_tj * out_tj| of the exact sum (Higham
2002, sec. 3.1; gamma_m = m*u / (1 - m*u), u = 2^-53), and so is the reference, so the two differ by at most twice
that. Its gradients: dL/dweight_tj = <out_tj, dy_t>, h products (2 gamma_(h+1) * sum|terms|); dL/dout_tj =
w_tj * dy_t, one product (2 gamma_2 * |w_tj * dy_t|). A weight left out, a row added to another token, or one
choice in place of two is an O(1) error.

The transport handed to the learner's function is watched: before an all-to-all moves anything, every rank of
the group tells the others what it will send and receive, and a rank that leaves the function (returned or
raised) says so; ranks that do not agree all stop at once, named, instead of one of them waiting for rows that
never come.
"""
import functools
from typing import NamedTuple

import torch
import torch.distributed as dist

from grading import mistake
from harness import device
from mini_dist import comm
from mini_dist import expert_parallel as ep  # looked up at call time: in a check, the learner's copy
from mini_dist.moe import Routing
from ring_exercise import gamma

F64 = torch.float64
TRANSPORTS = {"p2p": "p2p_all_to_all", "native": "all_to_all_single"}

# each is made by a wrong solution of tests/bank_expert_parallel.py (tests/test_exercise.py holds that)
MISTAKES = {
    "experts numbered across ranks wrongly": ("dispatch", "rank q holds the E/W experts q*E/W .. (q+1)*E/W - 1, "
                                              "a block in a row, not every W-th one: expert e lives on rank "
                                              "e // (E/W), as its local expert e % (E/W)"),
    "dropped choices counted": ("dispatch", "a choice whose routing.keep is False found no slot at its expert "
                                "(capacity): it sends no row, and no count counts it"),
    "a rank that receives no rows left out of the counts": ("dispatch", "count the rows for every one of the E "
                                                            "experts, 0 where none of mine chose it (torch.bincount "
                                                            "has minlength): else the counts of the last experts, "
                                                            "or of a rank with no tokens, are missing"),
    "counts not exchanged": ("dispatch", "what rank q sends me only rank q knows: exchange the counts per expert "
                             "by an all-to-all of their own before the rows"),
    "MoE rows combined without their weights": ("combine", "row (t, j)'s output counts weight[t, j] times into "
                                                "y_t: multiply each row by its weight before adding it in"),
    "sent and received counts swapped on the way back": ("combine", "back, each rank sends the rows it received "
                                                         "(plan.received[q] of them to rank q) and gets back the "
                                                         "rows it sent (plan.sent[q] from rank q)"),
    "a rank with no rows skipped the all-to-all": ("dispatch", "every rank of the group takes part in every "
                                                   "all-to-all, also one with nothing to send or receive (its counts "
                                                   "are 0s): the others wait for it otherwise"),
    "a token's choices overwrite each other": ("combine", "y[t] += rows with the same t twice in the index adds "
                                               "only one of them (an indexed assignment keeps one): add every row "
                                               "into its token, e.g. with index_add"),
}


class Mismatch(AssertionError):
    """Ranks about to run an all-to-all that do not agree on its counts: raised on every rank of the group."""


class Left(Mismatch):
    """A rank left the judged function while others are in an all-to-all: every rank knows, none gathers again."""


# ----- the cases: every rank's tokens and routing, the same on every rank

def case(seed: int, q: int, n: int, h: int, E: int, k: int, keep: float, skew: bool):
    """Rank q's tokens [n, h] and Routing on the CPU (each rank builds every rank's): k different experts per
    token (the first k for every token if skew), weights in [0.25, 1.25), each choice kept with probability keep."""
    g = torch.Generator().manual_seed(seed * 1009 + q)
    x = torch.randn(n, h, dtype=F64, generator=g)  # cpu: moved to device() where used
    expert = torch.arange(k).repeat(n, 1)  # cpu: moved to device() where used
    for t in range(0 if skew else n):
        expert[t] = torch.randperm(E, generator=g)[:k]  # cpu: moved to device() where used
    weight = torch.rand(n, k, dtype=F64, generator=g) + 0.25  # cpu: moved to device() where used
    kept = torch.rand(n, k, generator=g, dtype=F64) < keep  # cpu: moved to device() where used
    return x, Routing(expert, weight, kept, torch.zeros((), dtype=F64))  # cpu: moved to device() where used


class Spec(NamedTuple):
    """A group of W ranks, E experts, k choices per token, tokens [ns[q], h] on rank q, each choice kept with
    probability keep, every token on the first k experts if skew."""
    W: int
    E: int
    k: int
    h: int
    ns: tuple
    keep: float
    skew: bool
    seed: int

    @property
    def L(self) -> int:
        """Experts per rank: rank q holds experts q*L .. q*L + L - 1."""
        return self.E // self.W


def cases(spec: Spec):
    """Every rank's (tokens, routing), the one-process view."""
    return [case(spec.seed, q, n, spec.h, spec.E, spec.k, spec.keep, spec.skew) for q, n in enumerate(spec.ns)]


def counts(routing, E: int, W: int, every: bool = False) -> torch.Tensor:
    """[W, E/W]: the rows this rank sends each rank for each of its local experts (every: dropped ones too)."""
    chosen = routing.expert.flatten() if every else routing.expert[routing.keep]
    return torch.bincount(chosen, minlength=E).view(W, -1)


def contract_plan(routing, E: int, W: int):
    """A plan as the contract has it: kept pairs by expert (within one, in token order: any order would do)."""
    t, j = routing.keep.nonzero(as_tuple=True)
    order = routing.expert[t, j].argsort(stable=True)
    sent = counts(routing, E, W)
    return t[order], j[order], sent.sum(1).tolist()


def on_device(routing):
    return Routing(*(t.to(device()) for t in routing))


# ----- the watched transport

END = "no more all-to-alls"  # what a rank tells the others when the judged function returned or raised


class Watched:
    """The transport handed to the learner's `function`: before each all-to-all, every rank of the group tells the
    others its send and receive counts and row counts (one all_gather_object), and when the function returned or
    raised, it says so (finish): a problem any rank has, every rank raises, and none waits for a rank that left.
    `name(everyone)`: None, or (what is wrong, the mistake) where it recognises a classic one; `idle`: the ranks
    with no rows to move."""

    def __init__(self, transport, name, function, idle):
        self.transport = transport
        self.name = name
        self.function = function
        self.idle = idle
        self.calls = 0

    def __call__(self, out, x, output_splits, input_splits, group=None):
        mine = ([int(c) for c in input_splits], [int(c) for c in output_splits], x.shape[0], out.shape[0],
                (str(x.dtype), tuple(x.shape[1:])))
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
        ended = [r for r, said in enumerate(everyone) if said[0] == END]
        if ended:
            raise Left(self.left(everyone, ended[0]))
        self.calls += 1
        named = self.name(everyone) if self.name else None
        said = disagreement(everyone) or (named and named[0])
        if said:
            raise Mismatch(said + (f"\n{named[1]}" if named else ""))
        return self.transport(out, x, output_splits, input_splits, group)

    def finish(self, raised: str | None) -> None:
        """The function returned (raised: None) or raised (what): tell the ranks still in an all-to-all; if this
        rank returned while others are in one, it raises what they do."""
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (END, raised, self.calls))
        busy = [r for r, said in enumerate(everyone) if said[0] != END]
        if busy and raised is None:
            raise Left(self.left(everyone, dist.get_rank()))

    def left(self, everyone, r: int) -> str:
        """Rank r's function returned or raised while other ranks run one more all-to-all (or agree before one)."""
        _, raised, calls = everyone[r]
        busy = next(q for q, said in enumerate(everyone) if said[0] != END)
        if raised:
            return f"waited for rank {r}, which raised {raised} in {self.function} (its own error says where)"
        said = (f"rank {r} returned from {self.function} after {calls} all-to-all{'s' if calls != 1 else ''} while "
                f"rank {busy} calls one more")
        if r in self.idle:
            said += "\n" + mistake(MISTAKES, "a rank with no rows skipped the all-to-all", f"rank {r} has no rows to "
                                  f"move, and left {self.function} before the others' all-to-all", self.function)
        return said


def told(e: Exception) -> bool:
    """Whether the error already says that a rank left (in this gather or in agree's): no rank gathers again."""
    return isinstance(e, Left) or END in str(e)


def disagreement(everyone) -> str | None:
    """Where the ranks' counts for one all-to-all do not fit together, in words; None when they do."""
    W = len(everyone)
    for r, (send, recv, rows, room, _) in enumerate(everyone):
        if len(send) != W or len(recv) != W:
            return (f"rank {r}'s all-to-all has {len(send)} send counts and {len(recv)} receive counts: one per "
                    f"rank of the group ({W})")
        if sum(send) != rows:
            return f"rank {r}'s all-to-all sends {sum(send)} rows ({send} to ranks 0..{W - 1}) of a tensor of {rows}"
        if sum(recv) != room:
            return f"rank {r}'s all-to-all receives {sum(recv)} rows ({recv}) into a tensor of {room}"
    for a in range(W):
        for b in range(W):
            if everyone[a][0][b] != everyone[b][1][a]:
                return (f"rank {a} sends {everyone[a][0][b]} rows to rank {b}, which expects {everyone[b][1][a]}: "
                        f"an all-to-all's counts must be what the other end counts too")
    return None


def dispatch_names(spec, everyone) -> tuple | None:
    """The mistake behind dispatch's rows all-to-all (of float64 rows [.., h]) whose counts are not the contract's."""
    W = spec.W
    E = spec.E
    if everyone[0][4] != (str(F64), (spec.h,)) or any(len(send) != W for send, *_ in everyone):
        return None
    kept = [counts(r, E, W) for _, r in cases(spec)]
    every = [counts(r, E, W, every=True) for _, r in cases(spec)]
    sends = [send for send, *_ in everyone]
    want = [c.sum(1).tolist() for c in kept]
    if sends != want and sends == [c.sum(1).tolist() for c in every]:
        return (f"the rows' all-to-all sends {sends} rows (rank by rank, to ranks 0..{W - 1}), the kept choices "
                f"{want}", mistake(MISTAKES, "dropped choices counted", "each rank's counts include the choices "
                                   "routing.keep drops"))
    recvs = [recv for _, recv, *_ in everyone]
    if sends == want and recvs == sends and recvs != [[kept[q][p].sum().item() for q in range(W)] for p in range(W)]:
        return (f"the rows' all-to-all: each rank expects from ranks 0..{W - 1} what it sends them ({recvs}, "
                f"rank by rank)", mistake(MISTAKES, "counts not exchanged", "every rank's receive counts are its own "
                                          "send counts"))
    return None


def combine_names(plans, everyone) -> tuple | None:
    """The reverse trip with the counts of the way there: every rank sends plan.sent and expects plan.received."""
    sent = [p[2] for p in plans]
    W = len(plans)
    received = [[sent[q][p] for q in range(W)] for p in range(W)]
    way_there = list(zip(sent, received))
    if [(send, recv) for send, recv, *_ in everyone] == way_there and way_there != [(b, a) for a, b in way_there]:
        r = next(q for q, (a, b) in enumerate(way_there) if a != b)
        return (f"the reverse all-to-all: rank {r} sends back {sent[r]} rows to ranks 0..{W - 1} and expects "
                f"{received[r]}: the counts of the way there (it received {received[r]} rows, sent {sent[r]})",
                mistake(MISTAKES, "sent and received counts swapped on the way back", "the rows go back by the "
                        "counts of the way there"))
    return None


# ----- dispatch

def portable(v):
    """A value of the learner's, to send home: tensors on the CPU, lists and tuples of them, else as it is."""
    if isinstance(v, torch.Tensor):
        return v.detach().cpu()
    if isinstance(v, (list, tuple)):
        return [portable(u) for u in v]
    return v if isinstance(v, (int, float, str, type(None))) else repr(v)


def dispatch_worker(spec, transport):
    """This rank's dispatch of its tokens (spec's): what it returned, ready to judge."""
    x, routing = cases(spec)[dist.get_rank()]
    idle = [q for q, (_, r) in enumerate(cases(spec)) if not r.keep.any()]
    watched = Watched(getattr(ep if transport == "p2p" else comm, TRANSPORTS[transport]),
                      functools.partial(dispatch_names, spec), "dispatch", idle)
    try:
        got = ep.dispatch(x.to(device()), on_device(routing), spec.E, None, watched)
    except Exception as e:
        if not told(e):
            watched.finish(type(e).__name__)
        raise
    watched.finish(None)
    if not isinstance(got, tuple) or len(got) != 3:
        return f"dispatch returned {type(got).__name__}, not (rows, got, plan)"
    rows, counted, plan = got
    fields = [getattr(plan, f, None) for f in ("token", "choice", "sent", "received")]
    if any(f is None for f in fields):
        return f"dispatch's plan is {type(plan).__name__}, not a Plan(token, choice, sent, received)"
    return [portable(v) for v in (rows, counted, *fields)]


def ints(v) -> list | None:
    """A list of Python ints from a tensor or a list, else None."""
    if isinstance(v, torch.Tensor):
        v = v.tolist()
    if isinstance(v, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) for i in v):
        return list(v)
    return None


def plan_problem(p, spec, result) -> str | None:
    """Rank p's plan against the contract: every kept pair once, by expert; sent, received its counts."""
    W = spec.W
    E = spec.E
    L = spec.L
    every = cases(spec)
    routing = every[p][1]
    token = ints(result[2])
    choice = ints(result[3])
    sent = ints(result[4])
    received = ints(result[5])
    for name, given in (("sent", result[4]), ("received", result[5])):
        if not isinstance(given, list) or len(given) != W or ints(given) is None:
            return f"rank {p}: plan.{name} is {given!r}, want a list of W = {W} ints"
    if token is None or choice is None or len(token) != len(choice):
        return f"rank {p}: plan.token and plan.choice must be two int tensors of one length: {result[2:4]}"
    pairs = list(zip(token, choice))
    n, k = routing.keep.shape
    if any(not (0 <= t < n and 0 <= j < k) for t, j in pairs):
        return f"rank {p}: plan holds (token, choice) pairs outside [{n}, {k}]: {pairs}"
    want = sorted(map(tuple, routing.keep.nonzero().tolist()))
    if sorted(pairs) != want:
        extra = [pair for pair in pairs if pair not in want]
        said = (f"rank {p}: plan's (token, choice) pairs are not the kept ones, each once: {len(pairs)} pairs, "
                f"{len(want)} kept" + (f"; ({extra[0][0]}, {extra[0][1]}) is dropped" if extra else ""))
        if extra and sorted(set(pairs)) == sorted(map(tuple, routing.keep.new_ones(n, k).nonzero().tolist())):
            return said + "\n" + mistake(MISTAKES, "dropped choices counted", f"rank {p} sends a row for every "
                                         f"choice, {len(extra)} of them dropped (routing.keep False)")
        return said
    experts = [routing.expert[t, j].item() for t, j in pairs]
    for m in range(1, len(experts)):
        if experts[m] < experts[m - 1]:
            said = (f"rank {p}: plan's row {m} (token {token[m]}, choice {choice[m]}) is for expert {experts[m]}, "
                    f"after a row for expert {experts[m - 1]}: rows leave by destination rank, then local expert")
            round_robin = [(e % W, e // W) for e in experts]
            if round_robin == sorted(round_robin):
                return said + "\n" + mistake(MISTAKES, "experts numbered across ranks wrongly", f"rank {p} orders "
                                             f"its rows as if expert e lived on rank e % W = e % {W}")
            return said
    want_sent = counts(routing, E, W).sum(1).tolist()
    if sent != want_sent:
        return (f"rank {p}: plan.sent is {result[4]}, want {want_sent}: the rows it sends to ranks 0..{W - 1}, "
                f"experts {L} to a rank")
    want_received = [counts(r, E, W)[p].sum().item() for _, r in every]
    if received != want_received:
        said = f"rank {p}: plan.received is {result[5]}, want {want_received}: the rows ranks 0..{W - 1} send it"
        if received == sent:
            return said + "\n" + mistake(MISTAKES, "counts not exchanged", f"rank {p} expects to receive what it "
                                         f"sends, {sent}")
        return said
    return None


def got_problem(p, spec, result) -> str | None:
    """Rank p's got: [W, E/W] int64, got[q, i] the rows rank q sent for its local expert i."""
    got = result[1]
    sends = [counts(routing, spec.E, spec.W) for _, routing in cases(spec)]  # [W, E/W]: what rank q sends where
    want = torch.stack([sent[p] for sent in sends])
    if not isinstance(got, torch.Tensor) or got.dtype != torch.int64:
        return f"rank {p}: got is {got!r}, want an int64 tensor [W, E/W] = {list(want.shape)}"
    if got.shape != want.shape:
        said = f"rank {p}: got has shape {list(got.shape)}, want [W, E/W] = {list(want.shape)}"
        if got.numel() < want.numel():
            return said + "\n" + mistake(MISTAKES, "a rank that receives no rows left out of the counts",
                                         f"{want.numel()} counts (W x E/W) make {list(want.shape)}; rank {p}'s "
                                         f"{got.numel()} miss the experts none of the rows chose")
        return said
    if not torch.equal(got, want):
        q, i = (got != want).nonzero()[0].tolist()
        said = f"rank {p}: got[{q}, {i}] = {got[q, i].item()}, want {want[q, i].item()} (got: {got.tolist()})"
        if torch.equal(got, sends[p]):
            return said + "\n" + mistake(MISTAKES, "counts not exchanged", f"rank {p}'s got is what it sends, "
                                         f"not what it receives")
        return said
    return None


def rows_problem(p, spec, results) -> str | None:
    """Rank p's rows: from each rank q in turn, the tokens of q's plan bound for p's experts, in its plan's order."""
    L = spec.L
    h = spec.h
    every = cases(spec)
    rows = results[p][0]
    want = []
    for q, (_, routing) in enumerate(every):
        pairs = zip(ints(results[q][2]), ints(results[q][3]))
        want += [(q, t, j) for t, j in pairs if routing.expert[t, j].item() // L == p]
    if not isinstance(rows, torch.Tensor) or rows.shape != (len(want), h) or rows.dtype != F64:
        return (f"rank {p}: rows is {type(rows).__name__} {getattr(rows, 'shape', '')}, want a float64 tensor "
                f"[sum(plan.received), h] = [{len(want)}, {h}]")
    for m, (q, t, j) in enumerate(want):
        if not torch.equal(rows[m], every[q][0][t]):
            found = [(r, s) for r, (x, _) in enumerate(every) for s in range(len(x)) if torch.equal(x[s], rows[m])]
            what = f"rank {found[0][0]}'s token {found[0][1]}" if found else "no token's row"
            local = every[q][1].expert[t, j].item() % L
            return (f"rank {p}: rows[{m}] is {what}, want rank {q}'s token {t} (its choice {j}, for rank {p}'s "
                    f"local expert {local}): rows arrive from rank 0 first, each rank's in its plan's order")
    return None


def dispatch_problem(spec, results) -> str | None:
    """The first way the ranks' dispatch leaves the contract: plans first, then got, then the rows."""
    for p, result in enumerate(results):
        if isinstance(result, str):
            return f"rank {p}: {result}"
    for judge in (plan_problem, got_problem):
        for p, result in enumerate(results):
            said = judge(p, spec, result)
            if said:
                return said
    for p in range(len(results)):
        said = rows_problem(p, spec, results)
        if said:
            return said
    return None


# ----- combine

def outputs(spec):
    """Every rank's expert outputs [n, k, h] (one row per choice) and dy [n, h]: what combine is given."""
    made = []
    for q, n in enumerate(spec.ns):
        g = torch.Generator().manual_seed(spec.seed * 1013 + q + 7)
        rows = torch.randn(n, spec.k, spec.h, dtype=F64, generator=g)  # cpu: moved to device() where used
        made.append((rows, torch.randn(n, spec.h, dtype=F64, generator=g)))  # cpu: moved to device() where used
    return made


def arrivals(spec, plans, p):
    """(q, t, j) of every row that reaches rank p, in arrival order: rank 0's first, each in its plan's order."""
    every = cases(spec)
    return [(q, t, j) for q, (token, choice, _) in enumerate(plans) for t, j in zip(token.tolist(), choice.tolist())
            if every[q][1].expert[t, j].item() // spec.L == p]


def combine_worker(spec, transport):
    """This rank's combine of the outputs of the rows it received (under the contract's plan), then backward
    with dy: (y, out.grad, weight.grad), or a line saying what was not a tensor of the right shape."""
    W = spec.W
    E = spec.E
    me = dist.get_rank()
    plans = [contract_plan(r, E, W) for _, r in cases(spec)]
    made = outputs(spec)
    came = arrivals(spec, plans, me)
    none = torch.zeros(0, spec.h, dtype=F64)  # cpu: moved to device() below
    out = torch.stack([made[q][0][t, j] for q, t, j in came]) if came else none
    out = out.to(device()).requires_grad_()
    weight = cases(spec)[me][1].weight.to(device()).requires_grad_()
    token, choice, sent = plans[me]
    plan = ep.Plan(token.to(device()), choice.to(device()), sent, [plans[q][2][me] for q in range(W)])
    idle = [q for q in range(W) if not len(plans[q][0]) or not arrivals(spec, plans, q)]
    watched = Watched(getattr(ep if transport == "p2p" else comm, TRANSPORTS[transport]),
                      functools.partial(combine_names, plans), "combine", idle)
    dy = made[me][1].to(device())
    try:
        y = ep.combine(out, plan, weight, len(dy), None, watched)
        watched.name = None  # backward's trip is the reverse one: sent and received the other way round
        fine = isinstance(y, torch.Tensor) and y.shape == dy.shape
        if isinstance(y, torch.Tensor) and y.requires_grad:  # every rank backward, a wrong shape too: in step
            y.backward(dy if fine else torch.zeros_like(y))
    except Exception as e:
        if not told(e):
            watched.finish(type(e).__name__)
        raise
    watched.finish(None)
    if not fine:
        return f"combine returned {type(y).__name__} {list(getattr(y, 'shape', []))}, want y [n, h] = {list(dy.shape)}"
    return [portable(v) for v in (y, out.grad, weight.grad)]


def first_off(p, what, got, want, bound, say) -> str | None:
    """'rank p: what[i] = got, want w ± bound (say)' at the first element beyond its bound."""
    if got is None:
        got = torch.zeros_like(want)
        what += " (None: taken as 0)"
    off = ((got - want).abs() > bound) | got.isnan()
    if not off.any():
        return None
    at = tuple(off.nonzero()[0].tolist())
    return (f"rank {p}: {what}{list(at)} = {got[at].item():.6g}, want {want[at].item():.6g} ± "
            f"{bound[at].item():.2g} ({say})")


def combine_problem(spec, results) -> str | None:
    """The first rank whose y, out.grad or weight.grad leaves the contract, with the mistake where recognised."""
    W = spec.W
    E = spec.E
    k = spec.k
    h = spec.h
    every = cases(spec)
    made = outputs(spec)
    plans = [contract_plan(r, E, W) for _, r in every]
    for p, result in enumerate(results):
        if isinstance(result, str):
            return f"rank {p}: {result}"
    for q, (y, _, dweight) in enumerate(results):
        routing = every[q][1]
        rows, dy = made[q]
        w = routing.weight * routing.keep
        terms = w[..., None] * rows                                    # [n, k, h]
        bound = 2 * gamma(k + 1, F64) * terms.abs().sum(1)
        want = terms.sum(1)
        said = first_off(q, "y", y, want, bound, "the sum of its kept choices' weight * output, within "
                         "2 gamma_(k+1) * sum|terms|; 0 for a token with none kept")
        if said:
            return said + (combine_mistake(q, y, routing, rows, bound) or token_said(q, y, want, bound, routing))
        products = rows * dy[:, None, :] * routing.keep[..., None]
        said = first_off(q, "weight.grad", dweight, products.sum(-1), 2 * gamma(h + 1, F64) * products.abs().sum(-1),
                         "dL/dweight[t, j] = <row (t, j)'s output, dy_t> for a kept choice, 0 for a dropped one")
        if said:
            return said
    for p, (_, dout, _) in enumerate(results):
        came = arrivals(spec, plans, p)
        want = torch.stack([every[q][1].weight[t, j] * made[q][1][t] for q, t, j in came]) if came else \
            torch.zeros(0, h, dtype=F64)  # cpu: moved to device() where used
        said = first_off(p, "out.grad", dout, want, 2 * gamma(2, F64) * want.abs(), "row m's dL/dout is its "
                         "weight times dy of its token, sent back to the rank it came from")
        if said:
            return said
    return None


def token_said(q, y, want, bound, routing) -> str:
    """The first wrong token of rank q's y: its kept choices, their experts and weights."""
    t = (((y - want).abs() > bound) | y.isnan()).any(1).nonzero()[0].item()
    kept = routing.keep[t].nonzero().flatten().tolist()
    return (f"\nrank {q}'s token {t}: kept choices {kept}, experts {routing.expert[t, kept].tolist()}, weights "
            f"{[round(w, 4) for w in routing.weight[t, kept].tolist()]}" if kept else
            f"\nrank {q}'s token {t} has no kept choice (routing.keep all False): its y is 0")


def combine_mistake(q, y, routing, rows, bound) -> str:
    """'\\nmistake in combine: ...' when rank q's wrong y is a classic mistake's, else ''."""
    kept = routing.keep[..., None]
    loose = 4 * bound + 1e-12
    if ((y - (rows * kept).sum(1)).abs() <= loose).all():
        return "\n" + mistake(MISTAKES, "MoE rows combined without their weights", f"rank {q}'s y is the plain sum "
                              f"of its kept choices' outputs")
    terms = routing.weight[..., None] * rows * kept
    both = (routing.keep.sum(1) > 1).nonzero().flatten().tolist()
    one = [t for t in both if any(((y[t] - terms[t, j]).abs() <= loose[t]).all() for j in range(rows.shape[1]))]
    if both and one == both:
        return "\n" + mistake(MISTAKES, "a token's choices overwrite each other", f"rank {q}'s y for token {both[0]}, "
                              f"with {routing.keep[both[0]].sum().item()} kept choices, is one of them alone")
    return ""
