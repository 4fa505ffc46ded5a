"""Checkpoints of a pipeline run (``--pipeline S --checkpoint-dir DIR``): one file per stage, a manifest.

The ranks of replica 0 write their stage's layers (parameters and optimizer state, the layers one
after the other as the stage holds them) to ``checkpoint-STEP.shards/stage-K.npz``, atomically;
then rank 0 writes the manifest ``checkpoint-STEP.npz``: the record a data-parallel run's
checkpoint holds (run identity, step, position in the data, history, optimizer scalars), with D
replicas in the place of its ranks, and ``pipeline``: each file's layers and every layer's
``[start, stop)`` in the model's flat layout. A crash before the manifest leaves the previous
checkpoint the newest.

``--resume`` reads the newest checkpoint of the same run, whole or in parts: a pipeline run's at
any S, V, split and D, a data-parallel or sharded run's too (a rank reads only the files that hold
its layers), and continues from its sample. A data-parallel run resumes from a pipeline
checkpoint as it does from a sharded one; ``python -m allreduce_kit.checkpoint consolidate`` writes
it as one whole file.
"""
import os
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Dict, List, Optional

import numpy as np

from ..train import checkpoint, resize
from ..train.trainer import ResumeError

if TYPE_CHECKING:                                        # pragma: no cover
    from .train import PipelineTrainer

__all__ = ["save", "resume"]


def save(t: "PipelineTrainer", sums: np.ndarray, seconds: Optional[float]) -> None:
    """Write the checkpoint of step ``t.step`` (collective). ``sums``: this rank's (loss, correct,
    samples) of the open epoch so far, ``seconds`` its time so far (None: no epoch is open).
    A failure on any rank raises ``CheckpointError`` on every rank."""
    directory, step = t.config.checkpoint_dir, t.step
    final = os.path.join(directory, checkpoint.name_for(step))
    folder = checkpoint.shards_dir(final)
    error = None
    if t.replica == 0:
        try:
            os.makedirs(folder, exist_ok=True)
            checkpoint.write(os.path.join(folder, checkpoint.stage_name(t.stage)),
                             {"params": t.params, **t.optimizer.state()},
                             {"stage": t.stage, "layers": t.my_layers, "step": step, "run": t.run_identity})
        except OSError as bad:
            error = f"rank {t.rank} (stage {t.stage}) could not write its checkpoint file in {folder}: {bad}"
    gathered = t.comm.allgather((error, t.replica, t.my_layers if t.replica == 0 else None, sums.tolist()))
    errors = [e for e, *_ in gathered if e]
    error = errors[0] if errors else None
    if t.rank == 0 and error is None:
        try:
            checkpoint.save(directory, step, {}, meta(t, gathered, seconds), keep=t.config.keep_checkpoints)
        except (OSError, checkpoint.CheckpointError) as bad:
            error = str(bad)
    error = t.comm.bcast(error, root=0)
    if error:
        raise checkpoint.CheckpointError(error)
    t.saved_step = step


def meta(t: "PipelineTrainer", gathered: List[Any], seconds: Optional[float]) -> Dict[str, Any]:
    """The manifest's record: a data-parallel checkpoint's, D replicas as its ranks, and ``pipeline``."""
    epoch, into = t.plan.position(t.step)
    per_replica = np.zeros((t.replicas, 3))
    for _, replica, _, sums in gathered:
        per_replica[replica] += sums
    layers = {tuple(held) for _, replica, held, _ in gathered if held is not None}
    stages = sorted(layers, key=lambda held: held[0])
    at = t.plan.offset(t.step)
    s = t.settings
    record = {"stages": s.stages, "virtual_stages": s.virtual_stages, "split": list(s.split),
              "layers": [list(held) for held in stages], "size": t.model.size,
              "bounds": [list(t.model.layer_bounds(layer)) for layer in range(t.model.layers)],
              "arrays": ["params", *t.optimizer.state()],
              "files": [os.path.join(os.path.basename(checkpoint.shards_dir(checkpoint.name_for(t.step))),
                                     checkpoint.stage_name(k)) for k in range(len(stages))]}
    return {**checkpoint.sync_record(t, t.replicas, epoch, [],
                                     None if seconds is None or into == 0 else
                                     {"epoch": epoch, "sums": per_replica.tolist(), "seconds": seconds},
                                     {"position": {"epoch": at[0], "offset": at[1], "steps": into}, "accum_steps": 1,
                                      "base_global_batch": t.replicas * t.config.batch_size, "lr": t.config.lr}),
            "pipeline": record}


def resume(t: "PipelineTrainer") -> Optional[str]:
    """Continue from the newest checkpoint of this run in ``t.config.checkpoint_dir`` (collective):
    this rank's layers of its parameters and optimizer state, the step, the history and the open
    epoch's sums (carried on rank 0), the position in the data. Returns the path resumed from;
    ``ResumeError`` (on every rank, the same) says why it cannot."""
    directory = t.config.checkpoint_dir
    error, path, record = None, None, None
    if t.rank == 0:
        try:
            found = checkpoint.survey(directory)
            own = [f for f in found if f.run == t.run_identity]
            if not found:
                error = f"no checkpoint in {directory} (no checkpoint-*.npz)"
            elif not own:
                newest = found[-1]
                how = "its settings are not recorded" if newest.settings is None else \
                    checkpoint.differences(newest.settings, t.run_settings)
                error = f"{directory} holds no checkpoint of this run (the newest, {newest.path}: {how})"
            else:
                path = own[-1].path
                _, record = checkpoint.load(path)
        except (checkpoint.CheckpointError, OSError) as bad:
            error = str(bad)
    error, path, record = t.comm.bcast((error, path, record), root=0)
    if error is None:
        error = _take(t, path, record)
    errors = [e for e in t.comm.allgather(error) if e]
    if errors:
        raise ResumeError(f"--resume: {errors[0]}")
    t.optimizer.load_scalars(record.get("optimizer_scalars", {}))
    t.step = t.saved_step = int(record["step"])
    t.skipped_steps = list(record.get("skipped_steps", []))
    t.history = [dict(e) for e in record.get("history", [])]
    where = resize.position_of(record, len(t.data.y_train))
    t.plan = replace(t.plan, step0=t.step, epoch0=where["epoch"], offset0=where["offset"], before=where["steps"])
    now = record.get("open_epoch")
    if now:
        t.carried = {"epoch": int(now["epoch"]), "seconds": float(now["seconds"]),
                     "sums": np.sum(now["sums"], axis=0) * (t.rank == 0)}   # the epoch's record adds every rank's
    return path


def _take(t: "PipelineTrainer", path: str, record: Dict[str, Any]) -> Optional[str]:
    """Put this rank's layers of the checkpoint at ``path`` in place; why it cannot, or None."""
    if record["widths"] != t.model.widths or record["dtype"] != t.model.dtype.name:
        return (f"{path} holds a {'-'.join(map(str, record['widths']))} {record['dtype']} model, this run builds "
                f"{t.model.describe()} {t.model.dtype.name}")
    names = ["params", *t.optimizer.state()]
    try:
        if checkpoint.is_pipeline(record):
            arrays = checkpoint.read_pipeline(path, record, names, layers=t.my_layers)
        elif checkpoint.is_sharded(record):
            arrays = checkpoint.read_sharded(path, record, names)
        else:
            arrays, _ = checkpoint.load(path)
    except (checkpoint.CheckpointError, OSError, ValueError) as bad:
        return str(bad)
    missing = [name for name in names if name not in arrays or arrays[name].shape != (t.model.size,)]
    if missing:
        return (f"{path} holds no {', '.join(missing)} for this model; this run's --optimizer {t.config.optimizer} "
                f"needs them (resume with the --optimizer that wrote it)")
    at = 0
    for layer in t.my_layers:
        lo, hi = t.model.layer_bounds(layer)
        t.params[at:at + hi - lo] = arrays["params"][lo:hi]
        for name, state in t.optimizer.state().items():
            state[at:at + hi - lo] = arrays[name][lo:hi]
        at += hi - lo
    return None
