"""The shard pass's integer program and its solver: one-hot strategy variables per class of ops,
edge variables linearized as in Alpa (Zheng et al., OSDI 2022, section 4.2), extra continuous or
integer variables, solved by scipy's HiGHS (`milp`). `shard.plan` builds the program and reads
the solution back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

# HiGHS's relative MIP gap: plans within 0.1% of the best are not worth more search.
MIP_GAP = 1e-3
# Seconds HiGHS may search per solve before the best plan found so far is taken: a 5-axis mesh
# of a one-matmul MLP solved for 140 s with nothing shown; plans say when it was cut short.
SOLVE_TIME_LIMIT = 20.0


@dataclass
class Linear:
    """A linear expression over the program's variables: per class an array over its strategies, per
    edge (index into the edge list) a matrix over (producer, consumer) strategies, per extra variable
    a coefficient."""

    nodes: dict[int, np.ndarray] = field(default_factory=dict)
    edges: dict[int, np.ndarray] = field(default_factory=dict)
    extra: dict[int, float] = field(default_factory=dict)

    def add(self, lin: "Linear", scale: float = 1.0) -> None:
        """self += scale x lin."""
        for k, a in lin.nodes.items():
            self.nodes[k] = self.nodes.get(k, 0) + scale * a
        for e, M in lin.edges.items():
            self.edges[e] = self.edges.get(e, 0) + scale * M
        for v, c in lin.extra.items():
            self.extra[v] = self.extra.get(v, 0) + scale * c

    def restricted(self, ks, edges) -> "Linear":
        """This expression over the classes in `ks` and the edges into them."""
        return Linear({k: a for k, a in self.nodes.items() if k in ks},
                      {e: M for e, M in self.edges.items() if edges[e][1] in ks})

    def value(self, choice: Sequence[int], edges, extra_values: Sequence[float] = ()) -> float:
        total = sum(float(a[choice[k]]) for k, a in self.nodes.items())
        total += sum(float(M[choice[edges[e][0]], choice[edges[e][1]]]) for e, M in self.edges.items())
        return total + sum(c * extra_values[v] for v, c in self.extra.items())


CUT_SHORT: list[bool] = []  # set by solve during one plan()


def solve(objective: Linear, rows: list[tuple[Linear, float, float]], counts: list[int], edges, extras,
           allowed, exclude=None):
    """min objective over one-hot x per class (counts[k] strategies), edge variables linearized as in
    Alpa, `extras` [(low, high, integer)] further variables, subject to `rows` (Linear, low, high).
    `exclude`: a choice to cut off (the runner-up). Returns (strategy per class or None when
    infeasible, values of the extras, variable count)."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_array

    offsets, n = [], 0
    for c in counts:
        offsets.append(n)
        n += c
    nx = n
    e_off = []
    for P, C in edges:
        e_off.append(n)
        n += counts[P] * counts[C]
    v_off = n
    n += len(extras)
    rows_i, cols, vals, lo, hi = [], [], [], [], []
    r = 0

    def columns(lin: Linear) -> list[tuple[int, float]]:
        out = [(offsets[k] + s, float(v)) for k, a in lin.nodes.items() for s, v in enumerate(a) if v]
        out += [(e_off[e] + i, float(v)) for e, M in lin.edges.items() for i, v in enumerate(M.ravel()) if v]
        return out + [(v_off + v, float(c)) for v, c in lin.extra.items()]

    def add(entries, low, high):
        nonlocal r
        for col, v in entries:
            rows_i.append(r)
            cols.append(col)
            vals.append(v)
        lo.append(low)
        hi.append(high)
        r += 1

    for k, c in enumerate(counts):
        add([(offsets[k] + s, 1.0) for s in range(c)], 1, 1)
    for (P, C), off in zip(edges, e_off):
        kp, kc = counts[P], counts[C]
        for sp in range(kp):
            add([(off + sp * kc + sc, 1.0) for sc in range(kc)] + [(offsets[P] + sp, -1.0)], 0, 0)
        for sc in range(kc):
            add([(off + sp * kc + sc, 1.0) for sp in range(kp)] + [(offsets[C] + sc, -1.0)], 0, 0)
    for lin, low, high in rows:
        add(columns(lin), low, high)
    if exclude is not None:
        multi = [k for k, c in enumerate(counts) if c > 1]
        add([(offsets[k] + exclude[k], 1.0) for k in multi], -np.inf, len(multi) - 1)
    obj = np.zeros(n)
    for col, v in columns(objective):
        obj[col] += v
    A = coo_array((vals, (rows_i, cols)), shape=(r, n)).tocsr()
    lower, upper = np.zeros(n), np.ones(n)
    for k, ok in enumerate(allowed):
        upper[offsets[k]:offsets[k] + counts[k]] = ok
    integrality = np.zeros(n)
    integrality[:nx] = 1
    for v, (low, high, integer) in enumerate(extras):
        lower[v_off + v], upper[v_off + v], integrality[v_off + v] = low, high, integer
    res = milp(obj, constraints=[LinearConstraint(A, lo, hi)], integrality=integrality,
               bounds=Bounds(lower, upper), options={"mip_rel_gap": MIP_GAP, "time_limit": SOLVE_TIME_LIMIT})
    if res.x is None:
        return None, [], n
    if res.status == 1:  # the time limit: the incumbent is a valid plan, maybe not the best
        CUT_SHORT.append(True)
    choice = [int(np.argmax(res.x[offsets[k]:offsets[k] + c])) for k, c in enumerate(counts)]
    return choice, [float(x) for x in res.x[v_off:]], n
