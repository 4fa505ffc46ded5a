"""What rank 0 shows: per-epoch lines, the straggler table and headline, the JSON and the plot."""
from typing import Any, Dict, List


def epoch_line(e: Dict[str, Any], epochs: int) -> str:
    return (f"epoch {e['epoch']:>{len(str(epochs))}}/{epochs}  loss {e['loss']:.4f}  "
            f"train {100 * e['train_accuracy']:5.1f}%  test {100 * e['test_accuracy']:5.1f}%  "
            f"{e['samples_per_second']:>9,.0f} samples/s  step {e['step_ms']:6.2f} ms")


def headline(s: Dict[str, Any]) -> str:
    """One line: the step time, what it is made of, and what waiting for the slowest rank costs."""
    return (f"step {s['step_ms_p50']:.2f} ms (median): slowest rank's compute {s['slowest_compute_ms_p50']:.2f} ms"
            f" + transfer {s['transfer_ms_p50']:.2f} ms + update {s['update_ms_p50']:.2f} ms"
            f" + skew {s['other_ms_p50']:.2f} ms; a rank waits {s['wait_ms_p50']:.2f} ms per step for the"
            f" slowest (median of the ranks' mean), {100 * s['wait_share']:.1f}%"
            f" of the run's rank-time lost to waiting; most often slowest: rank {s['slowest_rank']}")


def straggler_table(s: Dict[str, Any]) -> str:
    """A row per rank: host, compute p50/p95, allreduce p50, wait p50, share slowest, score."""
    head = ["rank", "host", "compute p50", "compute p95", "allreduce p50", "wait p50", "slowest", "score"]
    rows: List[List[str]] = [[str(r["rank"]), r["host"], f"{r['compute_p50_ms']:.2f} ms",
                              f"{r['compute_p95_ms']:.2f} ms", f"{r['allreduce_p50_ms']:.2f} ms",
                              f"{r['wait_p50_ms']:.2f} ms", f"{100 * r['slowest_share']:.0f}%",
                              f"{r['score']:.2f}"] for r in s["ranks"]]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    fmt = lambda cells: "  ".join(c.rjust(w) if i != 1 else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([fmt(head), fmt(["-" * w for w in widths]), *map(fmt, rows)])


def plot(path: str, result: Dict[str, Any]) -> None:
    """Per-rank compute, transfer and wait as stacked bars, and the step-time timeline, to ``path``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["straggler"]
    ranks = [r["rank"] for r in s["ranks"]]
    compute = [r["compute_p50_ms"] for r in s["ranks"]]
    wait = [r["wait_p50_ms"] for r in s["ranks"]]
    transfer = [max(r["allreduce_p50_ms"] - r["wait_p50_ms"], 0.0) for r in s["ranks"]]
    fig, (bars, line) = plt.subplots(1, 2, figsize=(12, 4.5))
    bars.bar(ranks, compute, label="compute")
    bars.bar(ranks, transfer, bottom=compute, label="transfer")
    bars.bar(ranks, wait, bottom=[c + t for c, t in zip(compute, transfer)], label="wait for slowest")
    bars.set_xlabel("rank")
    bars.set_ylabel("ms per step (median)")
    bars.set_xticks(ranks)
    bars.set_title("where each rank's step goes")
    bars.legend()
    line.plot(range(1, len(s["step_ms"]) + 1), s["step_ms"], lw=0.8)
    line.axhline(s["step_ms_p50"], color="k", ls="--", lw=0.8, label=f"median {s['step_ms_p50']:.2f} ms")
    line.set_xlabel("step")
    line.set_ylabel("step time (ms, mean over ranks)")
    line.set_yscale("log")
    line.set_title("step time")
    line.legend()
    fig.suptitle(f"allreduce_kit.train: {result['ranks']} ranks, {result['model']} MLP, "
                 f"{100 * (result['test_accuracy'] or 0):.1f}% test accuracy")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
