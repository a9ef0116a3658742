"""The MoE dispatch and combine: the exercise's bank (kit/exercise.py); MISTAKES: tests/ep_exercise.py."""
from mini_dist.kit import exercise
from mini_dist.kit.exercise import planted

HINTS = {
    "dispatch": [
        "Three things travel. First each rank must learn how many rows every other rank will send it, for each of "
        "its local experts: only the sender knows, so the counts go by an all-to-all of their own. Then the rows "
        "themselves, by an all-to-all with uneven splits. The plan records what you sent, in the order you sent "
        "it, so that combine can find each row's token when it comes back. comm.all_to_all_rows moves rows with "
        "uneven counts and carries their gradient back; `transport` itself moves any tensor's rows.",
        "routing.keep.nonzero(as_tuple=True) gives the kept (token, choice) pairs. Ordered by expert (argsort of "
        "routing.expert at those pairs), they are ordered by destination rank and, within a rank, by local expert, "
        "because rank q's experts are a block in a row. Counting rows per expert, for all E of them, and viewing "
        "the counts as [W, E/W] gives row q: what goes to rank q, expert by expert.",
        "sent = torch.bincount(expert of the ordered pairs, minlength=E).view(W, -1); got = transport("
        "torch.empty_like(sent), sent, [1] * W, [1] * W, group); plan = Plan(t, j, sent.sum(1).tolist(), "
        "got.sum(1).tolist()); rows = comm.all_to_all_rows(tokens[t], plan.sent, plan.received, group, transport).",
    ],
    "combine": [
        "Two steps: the outputs go back to the ranks the rows came from, the same all-to-all the other way round; "
        "then each row that came back is added into its own token's output, scaled by the router's weight for "
        "that choice.",
        "On the way back each rank sends what it received and receives what it sent: the counts trade places. "
        "What comes back is in the order this rank sent it, so plan.token[m] and plan.choice[m] say whose row m "
        "is. A token may get two rows (k = 2): add, never assign (y[t] = ... keeps one of them).",
        "back = comm.all_to_all_rows(out, plan.received, plan.sent, group, transport); y = out.new_zeros((n, "
        "out.shape[1])).index_add(0, plan.token, weight[plan.token, plan.choice, None] * back).",
    ],
}

OWN = exercise.answers("expert_parallel")  # mini_dist's code, kept by a wrong solution where it is not wrong

RIGHT = {
    "sorted by expert, bincount, index_add (mini_dist's)": {
        "dispatch": OWN["dispatch"],
        "combine": OWN["combine"],
    },
    "expert by expert, newest token first; counts flat; index_put with accumulate": {
        "dispatch": """
            W = dist.get_world_size(group)
            pairs = [(routing.keep & (routing.expert == e)).nonzero().flip(0) for e in range(num_experts)]
            both = torch.cat(pairs)
            per_expert = torch.tensor([len(p) for p in pairs], device=tokens.device)
            arrived = torch.empty_like(per_expert)
            transport(arrived, per_expert, [num_experts // W] * W, [num_experts // W] * W, group)
            got = arrived.view(W, -1)
            plan = Plan(both[:, 0], both[:, 1], [int(c) for c in per_expert.view(W, -1).sum(1)],
                        [int(c) for c in got.sum(1)])
            rows = comm.all_to_all_rows(tokens[plan.token], plan.sent, plan.received, group, transport)
            return rows, got, plan
        """,
        "combine": """
            back = comm.all_to_all_rows(out, plan.received, plan.sent, group, transport)
            weighted = back * weight[plan.token, plan.choice].unsqueeze(-1)
            y = torch.zeros(n, out.shape[-1], dtype=out.dtype, device=out.device)
            return y.index_put((plan.token,), weighted, accumulate=True)
        """,
    },
}

# the lines of mini_dist's own dispatch and combine the wrong solutions below plant their mistakes in
KEPT = "t, j = routing.keep.nonzero(as_tuple=True)"
COUNTED = "sent = torch.bincount(routing.expert[t, j], minlength=num_experts).view(W, -1)"
EXCHANGED = "got = transport(torch.empty_like(sent), sent, [1] * W, [1] * W, group)"
PLAN = "plan = Plan(t, j, sent.sum(1).tolist(), got.sum(1).tolist())"
SENT = "return comm.all_to_all_rows(tokens[t], plan.sent, plan.received, group, transport), got, plan"
BACK = "back = comm.all_to_all_rows(out, plan.received, plan.sent, group, transport)"
ADDED = "return out.new_zeros((n, out.shape[1])).index_add(0, plan.token, weight[plan.token, plan.choice, None] * back)"

WRONG = {
    "expert e on rank e % W": ("experts numbered across ranks wrongly", {
        "dispatch": planted(OWN["dispatch"], {
            "order = routing.expert[t, j].argsort(stable=True)": "e = routing.expert[t, j]\n"
                                                                  "slot = (e % W) * (num_experts // W) + e // W\n"
                                                                  "order = slot.argsort(stable=True)",
            COUNTED: "sent = torch.bincount(slot[order], minlength=num_experts).view(W, -1)"}),
        "combine": OWN["combine"],
    }),
    "every choice sent, the dropped ones too": ("dropped choices counted", {
        "dispatch": planted(OWN["dispatch"], {KEPT: "t, j = torch.ones_like(routing.keep).nonzero(as_tuple=True)"}),
        "combine": OWN["combine"],
    }),
    "the kept rows sent, every choice counted": ("dropped choices counted", {
        "dispatch": planted(OWN["dispatch"], {
            COUNTED: "sent = torch.bincount(routing.expert.flatten(), minlength=num_experts).view(W, -1)"}),
        "combine": OWN["combine"],
    }),
    "bincount without minlength": ("a rank that receives no rows left out of the counts", {
        "dispatch": planted(OWN["dispatch"], {COUNTED: "sent = torch.bincount(routing.expert[t, j]).view(W, -1)"}),
        "combine": OWN["combine"],
    }),
    "the counts taken as what arrives": ("counts not exchanged", {
        "dispatch": planted(OWN["dispatch"], {
            EXCHANGED: "",
            PLAN: "plan = Plan(t, j, sent.sum(1).tolist(), sent.sum(1).tolist())",
            SENT: "return comm.all_to_all_rows(tokens[t], plan.sent, plan.received, group, transport), sent, plan"}),
        "combine": OWN["combine"],
    }),
    "a rank with nothing kept returns at once": ("a rank with no rows skipped the all-to-all", {
        "dispatch": planted(OWN["dispatch"], {KEPT: KEPT + """
if len(t) == 0:
    nothing = torch.zeros(W, num_experts // W, dtype=torch.int64, device=tokens.device)
    return tokens[:0], nothing, Plan(t, j, [0] * W, [0] * W)"""}),
        "combine": OWN["combine"],
    }),
    "the outputs added without the router's weights": ("MoE rows combined without their weights", {
        "dispatch": OWN["dispatch"],
        "combine": planted(OWN["combine"], {
            ADDED: "return out.new_zeros((n, out.shape[1])).index_add(0, plan.token, back)"}),
    }),
    "the way back by the counts of the way there": ("sent and received counts swapped on the way back", {
        "dispatch": OWN["dispatch"],
        "combine": planted(OWN["combine"], {
            BACK: "back = comm.all_to_all_rows(out, plan.sent, plan.received, group, transport)"}),
    }),
    "y[plan.token] += weighted rows": ("a token's choices overwrite each other", {
        "dispatch": OWN["dispatch"],
        "combine": planted(OWN["combine"], {ADDED: """y = out.new_zeros((n, out.shape[1]))
y[plan.token] += weight[plan.token, plan.choice, None] * back
return y"""}),
    }),
}
