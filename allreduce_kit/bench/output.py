"""The bench's outputs: the nccl-tests-style table (rank 0's stdout), CSV and JSON."""
import csv
from typing import Dict, Optional, Sequence

from .sweep import Row

COLUMNS = ("size(B)", "count", "type", "op", "algorithm", "time(us)", "min", "max", "algbw(GB/s)", "busbw(GB/s)",
           "#wrong")


def header(link: bool = False) -> str:
    """The table's header; ``link``: with the "link %" column of a run across nodes (``network.py``)."""
    return (f"#{'size(B)':>12} {'count':>10} {'type':>8} {'op':>5} {'algorithm':>24} | {'time(us)':>10} {'min':>10} "
            f"{'max':>10} | {'algbw(GB/s)':>11} {'busbw(GB/s)':>11} | {'#wrong':>6}" + (f" | {'link %':>7}" if link else ""))


def label(row: Row) -> str:
    """``auto`` shows what it chose: ``auto(ring)``."""
    return f"auto({row.chosen})" if row.algorithm == "auto" else row.algorithm


def line(row: Row, link_pct: Optional[float] = None) -> str:
    return (f" {row.size:>12} {row.count:>10} {row.dtype:>8} {row.op:>5} {label(row):>24} | {row.time_us:>10.2f} "
            f"{row.min_us:>10.2f} {row.max_us:>10.2f} | {row.algbw:>11.3f} {row.busbw:>11.3f} | {row.wrong:>6}"
            + (f" | {link_pct:>7.1f}" if link_pct is not None else ""))


_MPI_CALL = {"allreduce": "Allreduce", "reduce_scatter": "Reduce_scatter", "allgather": "Allgather",
             "broadcast": "Bcast"}


def summary(ratios: Dict[int, dict], collective: str = "allreduce") -> str:
    """Per size: the fastest of ours, and ratios of median times (lower is better for us)."""
    lines = ["#", f"# Ratios of median times, same run (below 1: faster than MPI's own {_MPI_CALL[collective]})",
             f"#{'size(B)':>12} {'best of ours':>20} {'best/mpi':>9} {'auto/best':>10} {'auto/mpi':>9}"]
    for size in sorted(ratios):
        r = ratios[size]

        def fmt(key: str) -> str:
            return f"{r[key]:.2f}x" if key in r else "-"

        lines.append(f"#{size:>12} {r.get('best', '-'):>20} {fmt('best_vs_mpi'):>9} {fmt('auto_vs_best'):>10} "
                     f"{fmt('auto_vs_mpi'):>9}")
    return "\n".join(lines)


def closing(wrong: int, avg_busbw: Dict[str, float]) -> str:
    """nccl-tests' closing lines: the wrong values over the whole run, and the average bus bandwidth
    over the sizes, one line per algorithm (the figure after the colon, as scripts parse it)."""
    lines = ["#", f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}"]
    for name, value in avg_busbw.items():
        lines.append(f"# Avg bus bandwidth    : {value:.6g} ({name}, GB/s, mean over the sizes)")
    return "\n".join(lines)


def write_csv(path: str, rows: Sequence[Row]) -> None:
    """One row per table line, the table's columns plus the ones the table leaves out."""
    fields = [f for f in Row.__dataclass_fields__ if f != "trials"]  # a nested record: --json has it
    with open(path, "w", newline="", encoding="utf-8") as out:
        writer = csv.DictWriter(out, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow(row.as_dict())
