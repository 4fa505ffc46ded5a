"""``--plot`` of a pipeline run: where each rank's step goes, and the step time over the run."""
from typing import Any, Dict

__all__ = ["plot", "figure"]


def plot(path: str, result: Dict[str, Any]) -> None:
    """Per-rank compute, waiting for messages and idle after its list as stacked bars (ms per
    step), and the step-time timeline, as a PNG at ``path``."""
    from ..plots import save

    save(figure(result), path)


def figure(result: Dict[str, Any]):
    """The figure ``plot`` writes, from a pipeline run's results (``PipelineTrainer.results``)."""
    from ..plots import integer_axis, legend_below, pyplot, value_axis

    plt = pyplot()
    pipe, steps = result["pipeline"], result["step_ms"]
    span = steps["pipeline_p50"]                     # the pipeline part of a step, ms
    ranks = [r["rank"] for r in pipe["ranks"]]
    idle = [span * r["idle_share"] for r in pipe["ranks"]]
    wait = [span * min(r["wait_share"], r["idle_share"]) for r in pipe["ranks"]]
    compute = [span - i for i in idle]
    after = [i - w for i, w in zip(idle, wait)]
    fig, (bars, line) = plt.subplots(1, 2, figsize=(12, 4.8))
    bars.bar(ranks, compute, label="compute")
    bars.bar(ranks, wait, bottom=compute, label="wait for a message")
    bars.bar(ranks, after, bottom=[c + w for c, w in zip(compute, wait)], label="done, others draining")
    bars.set_xlabel("rank (stage)")
    bars.set_ylabel("ms per step, pipeline part")
    bars.set_xticks(ranks, [f"{r['rank']} ({r['stage']})" for r in pipe["ranks"]])
    bars.set_ylim(0, 1.08 * max([span, 1e-9]))
    bars.set_title(f"{pipe['schedule']}, {pipe['stages']} stages x {pipe['replicas']} replicas, "
                   f"M = {pipe['micro_batches']}")
    value_axis(bars, [0.0])
    legend_below(bars)
    series = steps.get("per_step") or []
    line.plot(range(1, len(series) + 1), series, lw=0.8, label="step time")
    line.axhline(steps["step_p50"], color="k", ls="--", lw=0.8, label=f"median {steps['step_p50']:.2f} ms")
    line.set_xlabel("step")
    line.set_ylabel("step time (ms, rank 0)")
    value_axis(line, series or [steps["step_p50"]])
    integer_axis(line)
    line.set_title("step time")
    legend_below(line, columns=2)
    fig.suptitle(f"allreduce_kit.train --pipeline {pipe['stages']}: {result['ranks']} ranks, "
                 f"{100 * (result['test_accuracy'] or 0):.1f}% test accuracy")
    fig.tight_layout()
    return fig
