"""``bench --tune``: turn one sweep into crossover points for ``auto``.

Walking the sizes upward, keep the current algorithm while it is within ``SLACK`` of the
fastest at that size; otherwise switch to the fastest. That gives few crossover points and
keeps ``auto`` near the best at every size measured, without chasing noise.
"""
from typing import Dict, List, Sequence, Tuple

from .sweep import Row

#: An algorithm stays chosen while it is at most this much slower than the fastest.
SLACK = 1.05


def crossovers(rows: Sequence[Row], slack: float = SLACK) -> List[Tuple[int, str]]:
    """``[(min_bytes, algorithm), ...]`` from rows of one rank count (``mpi`` and ``auto`` ignored)."""
    by_size: Dict[int, Dict[str, float]] = {}
    for row in rows:
        if row.algorithm not in ("mpi", "auto"):
            by_size.setdefault(row.size, {})[row.algorithm] = row.time_us
    if not by_size:
        raise ValueError("--tune needs at least one of our algorithms in -a")
    rules: List[Tuple[int, str]] = []
    current = None
    for size in sorted(by_size):
        times = by_size[size]
        fastest = min(times, key=times.get)
        if current not in times or times[current] > slack * times[fastest]:
            current = fastest
            rules.append((size, fastest))
    rules[0] = (0, rules[0][1])  # the smallest size measured speaks for everything below it
    return rules
