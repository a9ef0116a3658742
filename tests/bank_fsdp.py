"""FSDP's hooks around a unit: the exercise's bank (kit/exercise.py); MISTAKES: tests/fsdp_exercise.py."""
from mini_dist.kit.exercise import planted

HINTS = {
    "FullyShardedDataParallel._pre_forward": [
        "Between computations the module holds 1-D slices of this rank's shard; the module's forward needs every "
        "parameter whole and in its shape. Two things must happen: which collective brings the whole unit, and "
        "what makes the module see it?",
        "self._before_compute(unit, phase, order) all-gathers the unit, waits, and (with prefetch) starts the "
        "gather of the unit after it in `order`; unit.attach_views() makes each module attribute a view of the "
        "gathered vector.",
        "self._before_compute(unit, \"forward\", self.units), then unit.attach_views().",
    ],
    "FullyShardedDataParallel._post_forward": [
        "After its forward a unit is not needed until its backward, and maybe never again (no grad: evaluation). "
        "What may be freed, when, and who will call _pre_backward when the backward comes?",
        "unit.attach_shards() gives the module its slices back; self._finished.append(unit) records the order "
        "(backward runs it reversed); self._free(unit, \"forward\") when self.reshard_after_forward or when "
        "torch.is_grad_enabled() is False.",
        "For the backward: the unit's outputs that require grad (tree_leaves(output)), and "
        "torch.autograd.graph.register_multi_grad_hook(outputs, lambda grads: self._pre_backward(unit), "
        "mode=\"any\"): it fires when the first gradient reaches any of them.",
    ],
    "FullyShardedDataParallel._pre_backward": [
        "Backward computes dL/dx = dL/dy W: the weights forward freed must be whole again, and a checkpointed part "
        "of the unit recomputes its forward now, through the module's attributes.",
        "The same two steps as _pre_forward, in backward's order: the units run backward in the reverse of the "
        "order they finished forward (self._finished).",
    ],
}

PRE = "FullyShardedDataParallel._pre_forward"
POST = "FullyShardedDataParallel._post_forward"
BACK = "FullyShardedDataParallel._pre_backward"

REFERENCE = {
    PRE: """
        self._before_compute(unit, "forward", self.units)
        unit.attach_views()
    """,
    POST: """
        unit.attach_shards()
        self._finished.append(unit)
        if self.reshard_after_forward or not torch.is_grad_enabled():
            self._free(unit, "forward")
        needs_grad = [t for t in tree_leaves(output) if torch.is_tensor(t) and t.requires_grad]
        if needs_grad:
            torch.autograd.graph.register_multi_grad_hook(needs_grad, lambda _: self._pre_backward(unit), mode="any")
    """,
    BACK: """
        self._before_compute(unit, "backward", self._finished[::-1])
        unit.attach_views()
    """,
}

# the lines of _post_forward the wrong solutions below plant their mistakes in
FREED_WHEN = "if self.reshard_after_forward or not torch.is_grad_enabled():"
FREED = 'self._free(unit, "forward")'
HOOKED_ON = "needs_grad = [t for t in tree_leaves(output) if torch.is_tensor(t) and t.requires_grad]"
HOOKED = 'torch.autograd.graph.register_multi_grad_hook(needs_grad, lambda _: self._pre_backward(unit), mode="any")'

RIGHT = {
    "the reference's hooks": REFERENCE,
    "a hook on each output, once per backward; backward's order built with reversed()": {
        PRE: """
            order = list(self.units)
            self._before_compute(unit, "forward", order)
            unit.attach_views()
        """,
        POST: """
            unit.attach_shards()
            self._finished.append(unit)
            backward_can_come = torch.is_grad_enabled()
            if self.reshard_after_forward or not backward_can_come:
                self._free(unit, "forward")
            outputs = [t for t in tree_leaves(output) if torch.is_tensor(t) and t.requires_grad]
            announced = []

            def first_gradient(grad):
                if not announced:
                    announced.append(True)
                    self._pre_backward(unit)
                return grad
            for t in outputs:
                t.register_hook(first_gradient)
        """,
        BACK: """
            self._before_compute(unit, "backward", list(reversed(self._finished)))
            unit.attach_views()
        """,
    },
}

WRONG = {
    "forward computed before the gather": ("forward without the gather", {
        **REFERENCE,
        PRE: """
            unit.attach_views()
        """,
    }),
    "gathered, but the module left holding its slices": ("views not attached", {
        **REFERENCE,
        PRE: """
            self._before_compute(unit, "forward", self.units)
        """,
    }),
    "never freed after forward": ("not freed after forward", {
        **REFERENCE,
        POST: planted(REFERENCE[POST], {FREED_WHEN: "", FREED: ""}),
    }),
    "freed only when resharding, also under no_grad": ("kept after a forward without grad", {
        **REFERENCE,
        POST: planted(REFERENCE[POST], {FREED_WHEN: "if self.reshard_after_forward:"}),
    }),
    "no hook on the outputs": ("backward never announced", {
        **REFERENCE,
        POST: planted(REFERENCE[POST], {HOOKED_ON: "", "if needs_grad:": "", HOOKED: ""}),
    }),
    "backward without the second gather": ("backward without the second gather", {
        **REFERENCE,
        BACK: """
            unit.attach_views()
        """,
    }),
    "backward prefetching in forward order": ("backward in forward order", {
        **REFERENCE,
        BACK: """
            self._before_compute(unit, "backward", self._finished)
            unit.attach_views()
        """,
    }),
}
