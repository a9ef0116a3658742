"""DDP's bucket-ready hook: the exercise's bank (kit/exercise.py); MISTAKES: tests/reducer_exercise.py."""
from mini_dist.kit.exercise import planted

HINTS = {
    "Reducer._fill": [
        "Two jobs: put p's gradient where its bucket's all-reduce will read it, then send every bucket that is ready. "
        "The all-reduce sums the buckets over the ranks; what must each rank put in so that the sum is the mean? "
        "And a bucket is ready when it is full, but also only when every bucket ahead of it has gone: why?",
        "self.slot[p] gives (bucket, i); bucket.views[i] is p's gradient-shaped view into the bucket. Write p.grad "
        "times 1/N into it (torch.mul(..., out=...)), zeros when p.grad is None, p.grad as it is when self.hook is "
        "set. Then count the bucket down (bucket.pending -= 1).",
        "After counting down: while self.next_bucket is a bucket whose pending is 0, hand it to self._launch and "
        "move self.next_bucket on. One arrival may send several buckets; a bucket that fills early waits for the "
        "ones ahead of it.",
    ],
}

DIVIDED_ONCE_REDUCED = """
            bucket, i = self.slot[p]
            if p.grad is None:
                bucket.views[i].zero_()
            else:
                bucket.views[i].copy_(p.grad)
            bucket.pending -= 1

            def averaged(flat, n, reduced):
                reduced.value()  # an all-reduce that failed raises here, for backward to report
                return flat.div_(n)
            while self.next_bucket < len(self.buckets) and self.buckets[self.next_bucket].pending == 0:
                going = self.buckets[self.next_bucket]
                self._launch(going)
                if not self.hook:
                    going.future = going.future.then(functools.partial(averaged, going.flat, self.world))
                self.next_bucket += 1
"""

RIGHT = {
    "native DDP's way: the gradient times 1/N on the way in, the full buckets sent from next_bucket on": {
        "Reducer._fill": """
            bucket, i = self.slot[p]
            view = bucket.views[i]
            if p.grad is None:
                view.zero_()
            elif self.hook is not None:
                view.copy_(p.grad)
            else:
                view.copy_(p.grad).div_(self.world)
            bucket.pending -= 1
            for ready in self.buckets[self.next_bucket:]:
                if ready.pending > 0:
                    break
                self._launch(ready)
                self.next_bucket += 1
        """,
    },
    "the plain gradient in, each reduced bucket divided by N once its all-reduce is done (rounded otherwise)": {
        "Reducer._fill": DIVIDED_ONCE_REDUCED,
    },
}

# pieces of the wrong solutions, indented as the bodies they join
DIVIDE_ON_THE_WAY_IN = """
            bucket, i = self.slot[p]
            if p.grad is None:
                bucket.views[i].zero_()
            elif self.hook:
                bucket.views[i].copy_(p.grad)
            else:
                torch.mul(p.grad, 1.0 / self.world, out=bucket.views[i])
            bucket.pending -= 1
"""
WHILE_READY = """while self.next_bucket < len(self.buckets) and self.buckets[self.next_bucket].pending == 0:
    self._launch(self.buckets[self.next_bucket])
    self.next_bucket += 1"""
IN_ORDER = """
            while self.next_bucket < len(self.buckets) and self.buckets[self.next_bucket].pending == 0:
                self._launch(self.buckets[self.next_bucket])
                self.next_bucket += 1
"""

WRONG = {
    "the gradient copied in as it is, nothing divided": ("a sum for an average", {
        "Reducer._fill": planted(DIVIDE_ON_THE_WAY_IN + IN_ORDER, {
            "elif self.hook:": "",
            "bucket.views[i].copy_(p.grad)": "",
            "torch.mul(p.grad, 1.0 / self.world, out=bucket.views[i])": "bucket.views[i].copy_(p.grad)"}),
    }),
    "divided by N under a communication hook too (torch's allreduce_hook divides again)": ("divided twice", {
        "Reducer._fill": planted(DIVIDE_ON_THE_WAY_IN + IN_ORDER, {
            "elif self.hook:": "",
            "bucket.views[i].copy_(p.grad)": ""}),
    }),
    "divided on the way in and again once reduced": ("divided twice", {
        "Reducer._fill": planted(DIVIDED_ONCE_REDUCED, {
            "else:": "elif self.hook:\n    bucket.views[i].copy_(p.grad)\nelse:",
            "bucket.views[i].copy_(p.grad)": "torch.mul(p.grad, 1.0 / self.world, out=bucket.views[i])"}),
    }),
    "each bucket sent the moment it is full, whatever the buckets ahead of it": ("launched out of order", {
        "Reducer._fill": DIVIDE_ON_THE_WAY_IN + """
            if bucket.pending == 0:
                self._launch(bucket)
        """,
    }),
    "the buckets sent before the gradient is copied in": ("launched before it is full", {
        "Reducer._fill": planted(DIVIDE_ON_THE_WAY_IN + IN_ORDER, {
            "bucket, i = self.slot[p]": "bucket, i = self.slot[p]\nbucket.pending -= 1\n" + WHILE_READY,
            "bucket.pending -= 1": "",
            WHILE_READY.splitlines()[0]: "",
            "self._launch(self.buckets[self.next_bucket])": "",
            "self.next_bucket += 1": ""}),
    }),
    "every full bucket from bucket 0 sent again at each arrival": ("launched twice", {
        "Reducer._fill": DIVIDE_ON_THE_WAY_IN + """
            k = 0
            while k < len(self.buckets) and self.buckets[k].pending == 0:
                self._launch(self.buckets[k])
                k += 1
        """,
    }),
    "nothing sent until every bucket is full": ("launched only when backward ends", {
        "Reducer._fill": DIVIDE_ON_THE_WAY_IN + """
            if all(b.pending == 0 for b in self.buckets):
                for b in self.buckets:
                    self._launch(b)
        """,
    }),
    "p.grad used whether or not there is one": ("no gradient, no zeros", {
        "Reducer._fill": planted(DIVIDE_ON_THE_WAY_IN + IN_ORDER, {
            "if p.grad is None:": "",
            "bucket.views[i].zero_()": "",
            "elif self.hook:": "if self.hook:"}),
    }),
}
