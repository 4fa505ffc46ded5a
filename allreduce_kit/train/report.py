"""What rank 0 shows: the model line, per-epoch lines, the straggler table and headline, the JSON and the plot."""
from typing import Any, Dict, List

from ..cli import plural


def model_line(trainer: Any, requested_batch: int, algorithm: str) -> str:
    """The header's model line: the model, its gradient buffer, the batch (per rank, accumulation,
    global), the learning rate (``:g``, so a rescaled rate reads 0.01875, not 0.018750000000000003)
    and ``algorithm`` as the caller words it; ``requested_batch`` is ``--batch-size`` as typed."""
    config, model, accum, ranks = trainer.config, trainer.model, trainer.plan.accum, trainer.ranks
    lowered = requested_batch > config.batch_size and not trainer.resize_note
    return (f"model: MLP {model.describe()}, {model.size:,} parameters, one {config.dtype} gradient buffer of "
            f"{model.size * model.dtype.itemsize / 1e6:.2f} MB in {plural(trainer.buckets, 'bucket')}; batch {config.batch_size}/rank"
            + (f" x {accum} accumulation steps" if accum > 1 else "")
            + f" ({config.batch_size * ranks * accum} global"
            + (f"; --batch-size {requested_batch} is more than a rank's shard" if lowered else "")
            + f"), lr {config.lr:g}"
            + (f" x {ranks} (linear scaling)" if config.lr_scaling == "linear" else "")
            + f", algorithm {algorithm}"
            + (f"; resumed at step {trainer.step} from {trainer.resumed_from}" if config.resume else ""))


def epoch_line(e: Dict[str, Any], epochs: int) -> str:
    return (f"epoch {e['epoch']:>{len(str(epochs))}}/{epochs}  loss {e['loss']:.4f}  "
            f"train {100 * e['train_accuracy']:5.1f}%  test {100 * e['test_accuracy']:5.1f}%  "
            f"{e['samples_per_second']:>9,.0f} samples/s  step {e['step_ms']:6.2f} ms"
            + (f"  ({e['note']})" if e.get("note") else ""))


def headline(s: Dict[str, Any]) -> str:
    """One line: the step time, what it is made of, and what waiting for the slowest rank costs.

    With backup workers (``slowest_by`` "compute") a step waits for the last rank in, not for the
    slowest, so the parts are that rank's, and the slowest rank is the one with the longest compute,
    whether or not its gradient was in."""
    by_compute = s.get("slowest_by") == "compute"
    waited = "the last rank in" if by_compute else "the slowest"
    return (f"step {s['step_ms_p50']:.2f} ms (median): {'last rank in' if by_compute else 'slowest rank'}'s compute"
            f" {s['slowest_compute_ms_p50']:.2f} ms"
            f" + transfer {s['transfer_ms_p50']:.2f} ms + update {s['update_ms_p50']:.2f} ms"
            f" + skew {s['skew_ms_p50']:.2f} ms; a rank waits {s['wait_ms_p50']:.2f} ms per step for"
            f" {waited} (median of the ranks' mean), {100 * s['wait_share']:.1f}%"
            f" of the run's rank-time lost to waiting; most often slowest: rank {s['slowest_rank']}"
            + (" (longest compute)" if by_compute else ""))


def straggler_table(s: Dict[str, Any]) -> str:
    """A row per rank: host, compute p50/p95, allreduce p50, wait p50, share slowest, score."""
    head = ["rank", "host", "compute p50", "compute p95", "allreduce p50", "wait p50", "slowest", "score"]
    rows: List[List[str]] = [[str(r["rank"]), r["host"], f"{r['compute_ms_p50']:.2f} ms",
                              f"{r['compute_ms_p95']:.2f} ms", f"{r['allreduce_ms_p50']:.2f} ms",
                              f"{r['wait_ms_p50']:.2f} ms", f"{100 * r['slowest_share']:.0f}%",
                              f"{r['score']:.2f}"] for r in s["ranks"]]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    fmt = lambda cells: "  ".join(c.rjust(w) if i != 1 else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([fmt(head), fmt(["-" * w for w in widths]), *map(fmt, rows)])


def plot(path: str, result: Dict[str, Any]) -> None:
    """Per-rank compute, transfer and wait as stacked bars, and the step-time timeline, as a PNG at ``path``."""
    from ..plots import save

    save(figure(result), path)


def figure(result: Dict[str, Any]):
    """The figure ``plot`` writes: bars with their legend below them; step times on a linear axis
    in ms when they span less than 10x (else log), with plain tick labels."""
    from ..plots import integer_axis, legend_below, pyplot, value_axis

    plt = pyplot()
    s = result["straggler"]
    ranks = [r["rank"] for r in s["ranks"]]
    compute = [r["compute_ms_p50"] for r in s["ranks"]]
    wait = [r["wait_ms_p50"] for r in s["ranks"]]
    transfer = [max(r["allreduce_ms_p50"] - r["wait_ms_p50"], 0.0) for r in s["ranks"]]
    fig, (bars, line) = plt.subplots(1, 2, figsize=(12, 4.8))
    bars.bar(ranks, compute, label="compute")
    bars.bar(ranks, transfer, bottom=compute, label="transfer")
    bars.bar(ranks, wait, bottom=[c + t for c, t in zip(compute, transfer)], label="wait for slowest")
    bars.set_xlabel("rank")
    bars.set_ylabel("ms per step (median)")
    bars.set_xticks(ranks)
    bars.set_ylim(0, 1.08 * max([c + t + w for c, t, w in zip(compute, transfer, wait)] + [1e-9]))
    bars.set_title("where each rank's step goes")
    value_axis(bars, [0.0])                          # plain ticks on a linear axis from 0
    legend_below(bars)
    line.plot(range(1, len(s["step_ms"]) + 1), s["step_ms"], lw=0.8, label="step time")
    line.axhline(s["step_ms_p50"], color="k", ls="--", lw=0.8, label=f"median {s['step_ms_p50']:.2f} ms")
    line.set_xlabel("step")
    line.set_ylabel("step time (ms, mean over ranks)")
    value_axis(line, s["step_ms"])
    integer_axis(line)
    line.set_title("step time")
    legend_below(line, columns=2)
    fig.suptitle(f"allreduce_kit.train: {result['ranks']} rank{'' if result['ranks'] == 1 else 's'}, "
                 f"{result['model']} MLP, {100 * (result['test_accuracy'] or 0):.1f}% test accuracy")
    fig.tight_layout()
    return fig
