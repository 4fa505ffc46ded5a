"""What the toolkit's plots share: axes a person reads without decoding, legends out of the data's
way, and a PNG written to exactly the path given.

Used by ``bench --plot``, ``train --plot`` and ``compare --plot``; imports matplotlib only when
called (it is an optional dependency).
"""
import re
from typing import Any, Sequence

#: What ``--plot`` without matplotlib says, in bench, train and compare alike: how to add it the
#: way the package itself was installed, from its checkout (``pip install .`` leaves it out).
NO_MATPLOTLIB = 'matplotlib is not installed: pip install ".[plot]" in the allreduce_kit checkout (or pip install matplotlib)'

#: Axes whose values span less than this factor are drawn linear (a log axis over 21-23 ms only
#: shows tick labels such as 2.1x10^1); wider ranges are drawn on a log scale.
LOG_ABOVE = 10.0
MAX_TICKS = 9


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def human_bytes(nbytes: float) -> str:
    """``16 B``, ``1 KiB``, ``64 KiB``, ``1.5 MiB``: a size as people read it (powers of 1024)."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.3g} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def bytes_axis(ax: Any, sizes: Sequence[float], axis: str = "x") -> None:
    """A log-2 axis of message sizes, its ticks at (some of) ``sizes`` labelled ``16 B`` ... ``64 KiB``."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    ticks = sorted(set(sizes))
    step = -(-len(ticks) // MAX_TICKS) if ticks else 1
    target = ax.xaxis if axis == "x" else ax.yaxis
    (ax.set_xscale if axis == "x" else ax.set_yscale)("log", base=2)
    target.set_major_locator(FixedLocator(ticks[::step]))
    target.set_major_formatter(FuncFormatter(lambda value, _: human_bytes(value)))
    target.set_minor_locator(NullLocator())


def plain_number(value: float) -> str:
    """``0.00005``, ``20000``, ``2.5``: a tick label without exponents."""
    import numpy as np

    return np.format_float_positional(float(f"{value:.6g}"), trim="-")


def value_axis(ax: Any, values: Sequence[float], axis: str = "y") -> None:
    """Linear with plain ticks (``21.5``, no offset, no powers of ten) when ``values`` span less than
    ``LOG_ABOVE`` times; else a log axis, still with plain tick labels."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter, ScalarFormatter

    target = ax.xaxis if axis == "x" else ax.yaxis
    positive = [v for v in values if v > 0]
    if positive and max(positive) > LOG_ABOVE * min(positive):
        (ax.set_xscale if axis == "x" else ax.set_yscale)("log")
        decades = max(positive) / min(positive)
        target.set_major_locator(LogLocator(base=10, subs=(1.0,) if decades > 1e4 else (1.0, 2.0, 5.0)))
        target.set_major_formatter(FuncFormatter(lambda value, _: plain_number(value)))
        target.set_minor_formatter(NullFormatter())
    else:
        plain = ScalarFormatter(useOffset=False)
        plain.set_scientific(False)
        target.set_major_formatter(plain)


def integer_axis(ax: Any, axis: str = "x") -> None:
    """Ticks at whole numbers only (steps, ranks, epochs)."""
    from matplotlib.ticker import MaxNLocator

    (ax.xaxis if axis == "x" else ax.yaxis).set_major_locator(MaxNLocator(integer=True))


def legend_below(ax: Any, columns: int = 3, **kwargs: Any) -> Any:
    """The axes' legend under its x-axis label, where it cannot cover a bar or a line."""
    return ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=columns, frameon=False, **kwargs)


def save(fig: Any, path: str) -> None:
    """Write ``fig`` as a PNG to exactly ``path`` and free it."""
    fig.savefig(path, dpi=110, format="png", bbox_inches="tight")
    pyplot().close(fig)


def mpi_name(version: str) -> str:
    """The MPI library as a title shows it: ``MPICH 5.0.2`` from ``MPI.Get_library_version()``'s
    ``MPICH Version:      5.0.2\\nMPICH Release date: ...``; ``Open MPI v4.1.5`` from
    ``Open MPI v4.1.5, package: ...``."""
    first = (version.strip().splitlines() or [""])[0]
    first = first.split(",")[0]
    first = re.sub(r"\bVersion:\s*", "", first, flags=re.IGNORECASE)
    return " ".join(first.split())
