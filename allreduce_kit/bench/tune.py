"""``bench --tune``: turn one sweep into crossover points for ``auto``.

The sizes measured are cut into at most ``MAX_RULES`` runs of consecutive sizes, each given one
algorithm, so as to minimise the summed log-ratio of the chosen algorithm's time to the fastest
time at each size (a dynamic programme over the cut points). Few crossover points means noise in
one row cannot make ``auto`` flip back and forth; the summed loss keeps it near the best at
every size. Fewer runs are used whenever they lose nothing. A size where an algorithm looks
more than ``CAP`` times slower than the fastest counts as ``CAP``: one row spoilt by a burst of
load elsewhere cannot outvote its neighbours.

MPI's own ``Allreduce`` (``mpi``) is a candidate like the others: where nothing built from
point-to-point messages beats it, ``auto`` hands the call to it. Under ``--tune`` its row is
timed through ``allreduce(algorithm="mpi")``, validation included, as ``auto`` would call it.
"""
import math
from typing import Dict, List, Sequence, Tuple

from .sweep import Row

#: At most this many (min_bytes, algorithm) rules per rank count: small, medium, large messages.
MAX_RULES = 3
#: The most one size can count against an algorithm (as a ratio to the fastest there).
CAP = 1.5


def crossovers(rows: Sequence[Row], max_rules: int = MAX_RULES, min_run: int = 0) -> List[Tuple[int, str]]:
    """``[(min_bytes, algorithm), ...]`` from rows of one rank count (``auto``'s rows ignored).

    Each run covers at least ``min_run`` consecutive sizes (default: 1 + sizes // 10, i.e. 3
    for the 25 sizes from 4 B to 64 MiB), so one noisy row cannot create a rule of its own.
    """
    by_size: Dict[int, Dict[str, float]] = {}
    for row in rows:
        if row.algorithm != "auto" and row.time_us > 0:
            by_size.setdefault(row.size, {})[row.algorithm] = row.time_us
    if not by_size:
        raise ValueError("--tune needs at least one algorithm other than auto in -a")
    sizes = sorted(by_size)
    names = sorted({n for times in by_size.values() for n in times})
    # loss[a][i]: how much slower algorithm a is than the fastest at size i (log ratio; inf if not run)
    cap = math.log(CAP)
    loss = {a: [min(cap, math.log(by_size[s][a] / min(by_size[s].values()))) if a in by_size[s] else math.inf
                for s in sizes] for a in names}
    prefix = {a: [0.0] for a in names}
    for a in names:
        for value in loss[a]:
            prefix[a].append(prefix[a][-1] + value)

    def segment(i: int, j: int) -> Tuple[float, str]:  # the best single algorithm for sizes[i:j]
        return min((prefix[a][j] - prefix[a][i], a) for a in names)

    n = len(sizes)
    min_run = max(1, min(min_run or 1 + n // 10, n))
    # best[k][j]: the cheapest cover of sizes[:j] by k runs, and how (list of (start index, name))
    best = {1: {j: (segment(0, j)[0], [(0, segment(0, j)[1])]) for j in range(min_run, n + 1)}}
    for k in range(2, max_rules + 1):
        best[k] = {}
        for j in range(k * min_run, n + 1):
            options = []
            for i in range((k - 1) * min_run, j - min_run + 1):
                cost, plan = best[k - 1][i]
                extra, name = segment(i, j)
                options.append((cost + extra, plan + [(i, name)]))
            best[k][j] = min(options, key=lambda o: o[0])
    cost, plan = min((best[k][n] for k in best if n in best[k]), key=lambda o: (round(o[0], 9), len(o[1])))
    rules: List[Tuple[int, str]] = []
    for start, name in plan:
        if not rules or rules[-1][1] != name:
            rules.append((sizes[start], name))
    rules[0] = (0, rules[0][1])  # the smallest size measured speaks for everything below it
    return rules
