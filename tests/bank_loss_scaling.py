"""Dynamic loss scaling: the exercise's bank (kit/exercise.py); MISTAKES: tests/loss_scaling_exercise.py."""
from mini_dist.kit import exercise
from mini_dist.kit.exercise import planted

HINTS = {
    "DynamicLossScaler.update": [
        "Two cases: this iteration's gradients overflowed, or they did not. An overflow says S is too large: "
        "shrink it, and the clean iterations seen so far no longer count. A clean iteration is one more in a row, "
        "and growth_interval of them in a row say S may be larger.",
        "_growth_tracker is that count: 0 after an overflow; one more after a clean iteration, and when it "
        "reaches growth_interval the scale grows and the count is 0 again. Every new scale goes through "
        "to_float32, and a grown one that is inf (math.isfinite) is not kept.",
        "overflow: scale = to_float32(scale * backoff_factor), tracker 0. Clean: tracker += 1; when it equals "
        "growth_interval, grown = to_float32(scale * growth_factor), kept only if math.isfinite(grown), and the "
        "tracker back to 0 either way.",
    ],
    "DynamicLossScaler.step": [
        "step() may be the first to look at this iteration's gradients, or the caller may have unscaled them "
        "already, to clip: self._found_inf, keyed by id(optimizer), says which.",
        "When id(optimizer) is not in self._found_inf, call self.unscale_(optimizer): it divides the gradients "
        "by S and records whether any held inf or NaN. That record then decides: skip, or step.",
        "If self._found_inf[id(optimizer)] is True, return None (the step is skipped, nothing changes); "
        "otherwise return optimizer.step(*args, **kwargs).",
    ],
}

OWN = exercise.answers("loss_scaling")  # mini_dist's code, kept by a wrong solution where it is not wrong

RIGHT = {
    "a counter compared with the interval, with early returns": {
        "DynamicLossScaler.update": """
            if overflow:
                self._scale = to_float32(self._scale * self.backoff_factor)
                self._growth_tracker = 0
                return
            self._growth_tracker += 1
            if self._growth_tracker < self.growth_interval:
                return
            self._growth_tracker = 0
            grown = to_float32(self._scale * self.growth_factor)
            if grown != math.inf:
                self._scale = grown
        """,
        "DynamicLossScaler.step": """
            if id(optimizer) not in self._found_inf:
                self.unscale_(optimizer)
            if self._found_inf[id(optimizer)]:
                return None
            return optimizer.step(*args, **kwargs)
        """,
    },
    "the count taken modulo the interval; the verdict read with dict.get": {
        "DynamicLossScaler.update": """
            if overflow:
                self._growth_tracker = 0
                self._scale = to_float32(self._scale * self.backoff_factor)
            else:
                self._growth_tracker = (self._growth_tracker + 1) % self.growth_interval
                if self._growth_tracker == 0:
                    grown = to_float32(self._scale * self.growth_factor)
                    self._scale = grown if math.isfinite(grown) else self._scale
        """,
        "DynamicLossScaler.step": """
            found = self._found_inf.get(id(optimizer))
            if found is None:
                self.unscale_(optimizer)
                found = self._found_inf[id(optimizer)]
            return None if found else optimizer.step(*args, **kwargs)
        """,
    },
}

WRONG = {
    "the count compared before it is incremented: growth one clean iteration late": ("grown on the wrong step", {
        "DynamicLossScaler.update": """
            if overflow:
                self._scale = to_float32(self._scale * self.backoff_factor)
                self._growth_tracker = 0
            elif self._growth_tracker == self.growth_interval:
                grown = to_float32(self._scale * self.growth_factor)
                if math.isfinite(grown):
                    self._scale = grown
                self._growth_tracker = 0
            else:
                self._growth_tracker += 1
        """,
        "DynamicLossScaler.step": OWN["DynamicLossScaler.step"],
    }),
    "growth at growth_interval - 1: one clean iteration early": ("grown on the wrong step", {
        "DynamicLossScaler.update": planted(OWN["DynamicLossScaler.update"], {
            "if self._growth_tracker == self.growth_interval:":
                "if self._growth_tracker >= self.growth_interval - 1:"}),
        "DynamicLossScaler.step": OWN["DynamicLossScaler.step"],
    }),
    "the count carried across an overflow": ("tracker not reset after an overflow", {
        "DynamicLossScaler.update": """
            if overflow:
                self._scale = to_float32(self._scale * self.backoff_factor)
            else:
                self._growth_tracker += 1
                if self._growth_tracker >= self.growth_interval:
                    grown = to_float32(self._scale * self.growth_factor)
                    if math.isfinite(grown):
                        self._scale = grown
                    self._growth_tracker = 0
        """,
        "DynamicLossScaler.step": OWN["DynamicLossScaler.step"],
    }),
    "every clean iteration grows the scale": ("growth on every clean step", {
        "DynamicLossScaler.update": """
            if overflow:
                self._scale = to_float32(self._scale * self.backoff_factor)
                self._growth_tracker = 0
            else:
                grown = to_float32(self._scale * self.growth_factor)
                if math.isfinite(grown):
                    self._scale = grown
                self._growth_tracker = (self._growth_tracker + 1) % self.growth_interval
        """,
        "DynamicLossScaler.step": OWN["DynamicLossScaler.step"],
    }),
    "the grown scale kept even when it is inf": ("grown past fp32's max", {
        "DynamicLossScaler.update": planted(OWN["DynamicLossScaler.update"], {
            "grown = to_float32(self._scale * self.growth_factor)":
                "self._scale = to_float32(self._scale * self.growth_factor)",
            "if math.isfinite(grown):": "",
            "self._scale = grown": ""}),
        "DynamicLossScaler.step": OWN["DynamicLossScaler.step"],
    }),
    "the scale multiplied as a Python float, never rounded to fp32": ("scale not rounded to fp32", {
        "DynamicLossScaler.update": planted(OWN["DynamicLossScaler.update"], {
            "self._scale = to_float32(self._scale * self.backoff_factor)": "self._scale *= self.backoff_factor",
            "grown = to_float32(self._scale * self.growth_factor)": "",
            "if math.isfinite(grown):": "if math.isfinite(self._scale * self.growth_factor):",
            "self._scale = grown": "self._scale *= self.growth_factor"}),
        "DynamicLossScaler.step": OWN["DynamicLossScaler.step"],
    }),
    "the scale backed off, but the step taken all the same": ("step taken on an overflow", {
        "DynamicLossScaler.update": OWN["DynamicLossScaler.update"],
        "DynamicLossScaler.step": planted(OWN["DynamicLossScaler.step"], {
            "return None if self._found_inf[id(optimizer)] else optimizer.step(*args, **kwargs)":
                "return optimizer.step(*args, **kwargs)"}),
    }),
    "step() unscales every time, also after the caller did": ("unscaled twice", {
        "DynamicLossScaler.update": OWN["DynamicLossScaler.update"],
        "DynamicLossScaler.step": """
            self.unscale_(optimizer)
            return None if self._found_inf[id(optimizer)] else optimizer.step(*args, **kwargs)
        """,
    }),
    "the skip decided from a verdict nobody recorded": ("not unscaled", {
        "DynamicLossScaler.update": OWN["DynamicLossScaler.update"],
        "DynamicLossScaler.step": """
            if self._found_inf.get(id(optimizer)):
                return None
            return optimizer.step(*args, **kwargs)
        """,
    }),
}
