"""While `./run.sh check MODULE` grades a learner's exercises/MODULE.py, that one file stands in for mini_dist.MODULE.

mini_dist/__init__.py calls `stand_in(path)` in every process of a check (the grader, its ranks, the demo) when
MINI_DIST_EXERCISE names the file: an import of mini_dist.MODULE loads the learner's file, and nothing else
changes, so a learner's unfinished exercises/comm.py never stands in for comm while tensor_parallel is graded.
`name_peers` makes a learner's blocking send or receive that times out say which rank it waited for.
"""
import importlib.abc
import importlib.util
import os
import sys


class StandIn(importlib.abc.MetaPathFinder):
    """Finds mini_dist.<module> at the learner's path, ahead of mini_dist's own file."""

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        self.name = "mini_dist." + os.path.splitext(os.path.basename(path))[0]

    def find_spec(self, fullname, path=None, target=None):
        return importlib.util.spec_from_file_location(fullname, self.path) if fullname == self.name else None


def stand_in(path: str) -> None:
    if not any(isinstance(finder, StandIn) for finder in sys.meta_path):
        sys.meta_path.insert(0, StandIn(path))


def name_peers() -> None:
    """In a check, a learner's blocking dist.send / dist.recv that outlives the group's timeout says which rank
    it waited for, and so does one whose peer left while it waited (that peer timed out first, or failed):
    gloo's own words name no peer, and a hang is named by who waits for whom."""
    import torch.distributed as dist

    def named(fn, way, ends):  # ends: the peer's keywords, global and group rank (src, group_src or dst, ...)
        def call(tensor, *args, **kwargs):
            try:
                return fn(tensor, *args, **kwargs)
            except RuntimeError as e:
                from mini_dist.kit.debug import LEFT, TIMED_OUT, PeerLost  # not at install: fork servers run it
                timed_out = TIMED_OUT.search(str(e))
                if not timed_out and not LEFT.search(str(e)):
                    raise
                peer = args[0] if args else kwargs.get(ends[0])
                group = args[1] if len(args) > 1 else kwargs.get("group")
                if peer is None and kwargs.get(ends[1]) is not None:
                    peer = dist.get_global_rank(group or dist.group.WORLD, kwargs[ends[1]])
                who = "any rank" if peer is None else f"rank {peer}"
                first = str(e).splitlines()[0]
                if timed_out:
                    raise PeerLost(f"{way} {who} timed out ({first}): {who} never posted the matching "
                                   f"{'recv' if way.startswith('send') else 'send'}; is it waiting too?") from e
                raise PeerLost(f"{way} {who} failed ({first}): {who} left while this rank waited for it; "
                               f"its own error says why") from e
        return call
    dist.send = named(dist.send, "send to", ("dst", "group_dst"))
    dist.recv = named(dist.recv, "recv from", ("src", "group_src"))
