"""The plots as a person reads them: tick labels, axis scales, legends clear of the data, titles.

Each figure is drawn in this process (matplotlib's Agg backend) from made-up results, and its
rendered tick labels and the positions of its legend and bars are checked.
"""
import matplotlib
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from allreduce_kit.bench.plot import figure as bench_figure  # noqa: E402
from allreduce_kit.bench.sweep import Row  # noqa: E402
from allreduce_kit.plots import human_bytes, mpi_name  # noqa: E402
from allreduce_kit.train.report import figure as train_figure  # noqa: E402


def _labels(axis):
    return [t.get_text() for t in axis.get_ticklabels() if t.get_text()]


def _row(size, algorithm, time_us):
    busbw = size / time_us / 1e3
    return Row(size=size, count=size // 4, dtype="float32", op="sum", algorithm=algorithm, chosen=algorithm, ranks=2,
               time_us=time_us, min_us=time_us, max_us=time_us, algbw=busbw, busbw=busbw, wrong=0, samples=2, batch=1)


def _result(step_ms, compute=(9.0, 9.5, 30.0), wait=(21.0, 20.5, 0.2)):
    ranks = [{"rank": r, "compute_ms_p50": c, "wait_ms_p50": w, "allreduce_ms_p50": w + 1.0}
             for r, (c, w) in enumerate(zip(compute, wait))]
    return {"ranks": len(ranks), "model": "64-32-10", "test_accuracy": 0.9,
            "straggler": {"ranks": ranks, "step_ms": step_ms, "step_ms_p50": sorted(step_ms)[len(step_ms) // 2]}}


@pytest.mark.parametrize("nbytes,text", [(16, "16 B"), (1024, "1 KiB"), (65536, "64 KiB"), (1536, "1.5 KiB"),
                                         (16 << 20, "16 MiB"), (3 << 30, "3 GiB")])
def test_sizes_read_as_bytes_with_binary_units(nbytes, text):
    assert human_bytes(nbytes) == text


def test_the_bench_plot_labels_sizes_16_B_to_64_KiB_and_titles_the_mpi_by_name():
    sizes = [16 << (2 * i) for i in range(7)]                     # 16 B, 64 B, ..., 64 KiB
    rows = [_row(s, name, t * (1 + s / 4096)) for s in sizes for name, t in (("ring", 30.0), ("mpi", 20.0))]
    title = f"allreduce, 2 ranks ({mpi_name('MPICH Version:      5.0.2' + chr(10) + 'MPICH Release date: x')})"
    fig = bench_figure(rows, title)
    try:
        fig.canvas.draw()
        for ax in fig.axes:
            assert _labels(ax.xaxis) == ["16 B", "64 B", "256 B", "1 KiB", "4 KiB", "16 KiB", "64 KiB"]
            assert not any("10^" in label or "e-" in label or "$" in label for label in _labels(ax.yaxis))
        assert fig._suptitle.get_text() == "allreduce, 2 ranks (MPICH 5.0.2)"
    finally:
        plt.close(fig)


@pytest.mark.parametrize("version,name", [
    ("MPICH Version:      5.0.2\nMPICH Release date: Fri Sep 25", "MPICH 5.0.2"),
    ("Open MPI v4.1.5, package: Open MPI builder, ident: 4.1.5, repo rev: v4.1.5", "Open MPI v4.1.5"),
    ("Intel(R) MPI Library 2021.10 for Linux* OS\n", "Intel(R) MPI Library 2021.10 for Linux* OS"),
])
def test_the_mpi_library_is_named_without_its_padding(version, name):
    assert mpi_name(version) == name


def test_step_times_in_a_narrow_range_get_a_linear_axis_with_plain_millisecond_ticks():
    fig = train_figure(_result([21.0, 22.6, 21.4, 21.9, 22.1, 21.2]))
    try:
        fig.canvas.draw()
        line = fig.axes[1]
        assert line.get_yscale() == "linear"
        labels = _labels(line.yaxis)
        assert len(labels) >= 3 and all(21.0 - 0.5 <= float(t) <= 22.6 + 0.5 for t in labels), labels
        assert line.yaxis.get_offset_text().get_text() == ""        # no "+2.1e1" above the axis
        assert _labels(line.xaxis) == [t for t in _labels(line.xaxis) if t.isdigit()]   # whole steps
    finally:
        plt.close(fig)


def test_step_times_over_decades_get_a_log_axis_still_with_plain_labels():
    fig = train_figure(_result([0.05, 0.06, 8.0, 0.05, 0.07, 0.05]))
    try:
        fig.canvas.draw()
        line = fig.axes[1]
        assert line.get_yscale() == "log"
        labels = _labels(line.yaxis)
        assert len(labels) >= 3 and all(t.replace(".", "", 1).isdigit() for t in labels), labels
    finally:
        plt.close(fig)


def test_the_legend_of_the_bars_covers_no_bar():
    fig = train_figure(_result([21.0, 22.0]))
    try:
        fig.canvas.draw()
        bars = fig.axes[0]
        legend = bars.get_legend().get_window_extent()
        assert bars.patches
        for patch in bars.patches:
            assert not legend.overlaps(patch.get_window_extent()), "the legend covers a bar"
    finally:
        plt.close(fig)
