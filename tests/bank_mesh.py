"""A rank's place in the grid, and its groups: the exercise's bank (kit/exercise.py); MISTAKES: tests/test_mesh.py."""
from mini_dist.kit import exercise

HINTS = {
    "RankGrid.rank": [
        "Count the places as a car's odometer counts: the tp wheel turns every step, the cp wheel each time tp comes "
        "round, pp each time cp does, dp slowest. How many ranks lie between rank(cp=0, ...) and rank(cp=1, ...)?",
        "Each axis has a stride, the ranks one step along it skips: tp's is 1, cp's is tp (a whole round of tp), "
        "pp's is tp x cp, dp's tp x cp x pp. The rank is the sum of each coordinate times its stride.",
        "Horner's form says the same with one multiplication per axis: start from dp, and for each axis inside it "
        "(pp, cp, tp) multiply by that axis's degree and add its coordinate.",
    ],
    "RankGrid.coords": [
        "The inverse of the odometer: tp is what is left of the rank after whole rounds of tp; what is left after "
        "taking tp off counts the rounds, in which cp is innermost.",
        "divmod(rank, self.tp) gives (the rounds of tp, the tp coordinate); divmod those rounds by cp, then by pp; "
        "what remains is dp. Then f from the docstring, and divmod(f, self.ep) gives (ep_replica, ep_index).",
    ],
    "RankGrid.groups": [
        "Two ranks are in the same group of kind `name` exactly when their coords() agree on every key "
        "SHARED[name] lists: those values are the group's name tag.",
        "Go through the ranks in increasing order and put each in a dict keyed by the tuple of its coordinates "
        "SHARED[name]; the dict's values, lists filled in that order, are the groups, their ranks increasing.",
    ],
}

RIGHT = {
    "strides summed, coordinates by divmod, groups tagged by the shared coordinates": {
        "RankGrid.rank": """
            cp_stride = self.tp
            pp_stride = self.tp * self.cp
            dp_stride = self.tp * self.cp * self.pp
            return dp * dp_stride + pp * pp_stride + cp * cp_stride + tp
        """,
        "RankGrid.coords": """
            rest, tp = divmod(rank, self.tp)
            rest, cp = divmod(rest, self.cp)
            dp, pp = divmod(rest, self.pp)
            ep_replica, ep_index = divmod(dp * self.cp + cp, self.ep)
            return {"dp": dp, "pp": pp, "cp": cp, "tp": tp, "ep_index": ep_index, "ep_replica": ep_replica}
        """,
        "RankGrid.groups": """
            tagged = {}
            for r in range(self.size):
                mine = self.coords(r)
                tagged.setdefault(tuple(mine[k] for k in SHARED[name]), []).append(r)
            return sorted(tagged.values())
        """,
    },
    "a table of the places in rank order, groups found by comparing every pair": {
        "RankGrid.rank": """
            table = [(d, p, c, t) for d in range(self.dp) for p in range(self.pp) for c in range(self.cp)
                     for t in range(self.tp)]
            return table.index((dp, pp, cp, tp))
        """,
        "RankGrid.coords": """
            table = [(d, p, c, t) for d in range(self.dp) for p in range(self.pp) for c in range(self.cp)
                     for t in range(self.tp)]
            dp, pp, cp, tp = table[rank]
            f = dp * self.cp + cp
            return {"dp": dp, "pp": pp, "cp": cp, "tp": tp, "ep_index": f % self.ep, "ep_replica": f // self.ep}
        """,
        "RankGrid.groups": """
            every = [self.coords(r) for r in range(self.size)]
            found = []
            for r in range(self.size):
                same = [q for q in range(self.size) if all(every[q][k] == every[r][k] for k in SHARED[name])]
                if same[0] == r:
                    found.append(same)
            return found[::-1]
        """,
    },
}

OWN = exercise.answers("mesh")  # mini_dist's code, kept by a wrong solution where it is not wrong

WRONG = {
    "the ranks counted with dp fastest, tp slowest": ("axes in the wrong order", {
        "RankGrid.rank": """
            return ((tp * self.cp + cp) * self.pp + pp) * self.dp + dp
        """,
        "RankGrid.coords": OWN["RankGrid.coords"],
        "RankGrid.groups": OWN["RankGrid.groups"],
    }),
    "coordinates peeled tp, pp, cp, dp: pp taken for the axis next to tp": ("axes in the wrong order", {
        "RankGrid.rank": OWN["RankGrid.rank"],
        "RankGrid.coords": """
            tp = rank % self.tp
            pp = rank // self.tp % self.pp
            cp = rank // (self.tp * self.pp) % self.cp
            dp = rank // (self.tp * self.cp * self.pp)
            f = dp * self.cp + cp
            return {"dp": dp, "pp": pp, "cp": cp, "tp": tp, "ep_index": f % self.ep, "ep_replica": f // self.ep}
        """,
        "RankGrid.groups": OWN["RankGrid.groups"],
    }),
    "dp's stride made of the largest pp coordinate, pp - 1, where pp's degree belongs": ("a stride off by one", {
        "RankGrid.rank": """
            return dp * self.tp * self.cp * (self.pp - 1) + (pp * self.cp + cp) * self.tp + tp
        """,
        "RankGrid.coords": OWN["RankGrid.coords"],
        "RankGrid.groups": OWN["RankGrid.groups"],
    }),
    "each group tagged by the coordinates its ranks differ in, not those they share": ("groups mix coordinates", {
        "RankGrid.rank": OWN["RankGrid.rank"],
        "RankGrid.coords": OWN["RankGrid.coords"],
        "RankGrid.groups": """
            found = {}
            for r in range(self.size):
                mine = self.coords(r)
                found.setdefault(tuple(mine[a] for a in AXES if a not in SHARED[name]), []).append(r)
            return list(found.values())
        """,
    }),
    "ep_index the EP group's number and ep_replica the place inside it": ("ep_index and ep_replica swapped", {
        "RankGrid.rank": OWN["RankGrid.rank"],
        "RankGrid.coords": """
            tp = rank % self.tp
            cp = rank // self.tp % self.cp
            pp = rank // (self.tp * self.cp) % self.pp
            dp = rank // (self.tp * self.cp * self.pp)
            f = dp * self.cp + cp
            return {"dp": dp, "pp": pp, "cp": cp, "tp": tp, "ep_index": f // self.ep, "ep_replica": f % self.ep}
        """,
        "RankGrid.groups": OWN["RankGrid.groups"],
    }),
}
