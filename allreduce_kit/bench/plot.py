"""``bench --plot PATH``: bus bandwidth and time against message size, one line per algorithm."""
from typing import Sequence

from .sweep import Row


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot(path: str, rows: Sequence[Row], title: str) -> None:
    """Two panels, log axes: busbw (GB/s) and median time (us) against bytes per rank."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = {}
    for row in rows:
        lines.setdefault(row.algorithm, []).append(row)
    fig, (bw, tm) = plt.subplots(1, 2, figsize=(13, 5))
    for name, series in lines.items():
        series.sort(key=lambda r: r.size)
        sizes = [r.size for r in series]
        style = dict(marker=".", linewidth=2.2 if name in ("mpi", "auto") else 1.3,
                     linestyle="--" if name == "mpi" else "-", color="black" if name == "mpi" else None)
        bw.plot(sizes, [max(r.busbw, 1e-6) for r in series], label=name, **style)
        tm.plot(sizes, [r.time_us for r in series], label=name, **style)
    for ax, ylabel in ((bw, "busbw (GB/s)"), (tm, "time per call (us), median")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("message size (bytes per rank)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    bw.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
