"""``bench --plot PATH.png``: bus bandwidth and time against message size, one line per algorithm."""
from typing import Sequence

from .sweep import Row


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot(path: str, rows: Sequence[Row], title: str) -> None:
    """Write ``figure(rows, title)`` as a PNG to exactly ``path``."""
    from ..plots import save

    save(figure(rows, title), path)


def figure(rows: Sequence[Row], title: str):
    """Two panels: busbw (GB/s) and median time per call against bytes per rank.

    The size axis is labelled ``16 B`` ... ``64 KiB``; the value axes are linear with plain ticks
    when their values span less than 10x, log otherwise; the legend sits below the panels."""
    from ..plots import bytes_axis, pyplot, value_axis

    plt = pyplot()
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
    every = [r.size for r in rows]
    for ax, ylabel, values in ((bw, "busbw (GB/s)", [max(r.busbw, 1e-6) for r in rows]),
                               (tm, "time per call (us), median", [r.time_us for r in rows])):
        bytes_axis(ax, every)
        value_axis(ax, values)
        ax.set_xlabel("message size (bytes per rank)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="major", alpha=0.3)
    handles, labels = bw.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 6), fontsize=8, frameon=False)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.04 * (-(-len(labels) // 6) + 1), 1, 1))
    return fig
