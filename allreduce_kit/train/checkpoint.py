"""Checkpoints that survive a crash: atomic, checksummed, versioned, the last K kept.

Rank 0 writes ``DIR/checkpoint-<step>.npz`` through a temporary file in the same directory:
write, flush, ``fsync``, ``os.replace`` into place, then ``fsync`` the directory. A crash at any
moment leaves either the previous checkpoint or the new one, never half a file under a final
name (``os.replace`` is atomic on POSIX within one file system); leftover temporary files are
never read and are removed by the next save. After a save only the newest ``keep`` checkpoints
remain.

The file is an ``.npz`` (read with ``allow_pickle=False``) holding the arrays and a JSON record
with a format name and version and a blake2b checksum over the record and every array's name,
dtype, shape and bytes. ``load`` refuses, with a ``CheckpointError`` naming the file, anything
truncated, corrupted, of another format or version; it never falls back silently to an older
checkpoint.

A checkpoint belongs to a run: its record holds the run's identity (``run``, a digest of
``run_settings``: the mode, the data and its order, the model), the settings that must be the
same for its step to mean the same model trained on the same samples in the same order.
Everything else (the rank count, the batch, the learning rate, the number of epochs, ...) may
change at ``--resume``. A checkpoint without ``run`` in its record has it worked out from the
configuration it records; one that records neither has no identity (``None``). ``save`` keeps
the newest ``keep`` checkpoints of its own run and never deletes, nor writes over, another's.
"""
import glob
import hashlib
import json
import os
import re
import shutil
import zipfile
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

import numpy as np

FORMAT = "allreduce_kit.train checkpoint"
VERSION = 1
PATTERN = re.compile(r"^checkpoint-(\d+)\.npz$")
TMP_PREFIX = ".checkpoint-tmp-"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file and says why."""


def name_for(step: int) -> str:
    return f"checkpoint-{step:09d}.npz"


def listing(directory: str) -> List[Tuple[int, str]]:
    """The checkpoints in ``directory`` as (step, path), oldest first (temporary files excluded)."""
    found = []
    for entry in os.listdir(directory):
        match = PATTERN.match(entry)
        if match:
            found.append((int(match.group(1)), os.path.join(directory, entry)))
    return sorted(found)


#: The configuration fields a run's identity is made of (see the module's docstring), and the
#: option each comes from; the synthetic data set's sizes count only for that data set.
IDENTITY_OPTIONS = (("mode", "--mode"), ("dataset", "--dataset"), ("seed", "--seed"),
                    ("test_fraction", "--test-fraction"), ("hidden", "--hidden"), ("dtype", "--dtype"))
SYNTHETIC_OPTIONS = (("samples", "--samples"), ("features", "--features"), ("classes", "--classes"))


def run_settings(config: Mapping[str, Any], mode: str) -> Dict[str, Any]:
    """The settings that make a run's identity, from a configuration (``Config.as_dict()``, the CLI's
    options) and the ``--mode``. ``KeyError`` if ``config`` lacks one."""
    settings = {"mode": mode, **{name: config[name] for name, _ in IDENTITY_OPTIONS[1:]}}
    settings["hidden"] = [int(width) for width in settings["hidden"]]
    if settings["dataset"] == "synthetic":
        settings.update({name: config[name] for name, _ in SYNTHETIC_OPTIONS})
    return settings


def sync_record(t: Any, ranks: int, epochs_done: int, jitter_rng_states: List[Any],
                open_epoch: Optional[Dict[str, Any]], position: Dict[str, Any]) -> Dict[str, Any]:
    """A ``--mode sync`` checkpoint's record of trainer ``t``'s step (``t.step``, ``t.config``,
    ``t.model``, ``t.run_identity``, ``t.run_settings``, ``t.skipped_steps``, ``t.history``,
    ``t.optimizer``), with ``ranks`` data-parallel ranks, the epochs finished, each rank's
    jitter RNG state, the open epoch's sums and the position in the data (``position``,
    ``accum_steps``, ``base_global_batch``, ``lr``): the one format every synchronous trainer
    writes, and so resumes from another's."""
    return {"step": t.step, "ranks": ranks, "batch_size": t.config.batch_size, "widths": t.model.widths,
            "dtype": t.model.dtype.name, "seed": t.config.seed, "mode": "sync",
            "run": t.run_identity, "run_settings": t.run_settings,
            "data_rng": {"scheme": "permutation of epoch e drawn from numpy default_rng([seed, 3, e])",
                         "seed": t.config.seed},
            "jitter_rng_states": jitter_rng_states, "skipped_steps": t.skipped_steps,
            "history": [e for e in t.history if e["epoch"] <= epochs_done], "open_epoch": open_epoch,
            "config": t.config.as_dict(), "optimizer_scalars": t.optimizer.scalars(), **position}


def run_identity(settings: Mapping[str, Any]) -> str:
    """A run's identity: a short digest of its ``run_settings``."""
    return hashlib.blake2b(json.dumps(settings, sort_keys=True).encode(), digest_size=8).hexdigest()


def settings_of(meta: Mapping[str, Any]) -> Optional[Dict[str, Any]]:
    """The ``run_settings`` of the run that wrote a checkpoint with this record, or None if it records
    neither them nor a configuration to work them out from."""
    if isinstance(meta.get("run_settings"), dict):
        return dict(meta["run_settings"])
    try:
        return run_settings(meta["config"], mode_of(meta))
    except (KeyError, TypeError, ValueError):
        return None


def identity_of(meta: Mapping[str, Any]) -> Optional[str]:
    """The identity of the run that wrote a checkpoint with this record (None: it has none)."""
    if isinstance(meta.get("run"), str):
        return meta["run"]
    settings = settings_of(meta)
    return None if settings is None else run_identity(settings)


def differences(theirs: Mapping[str, Any], mine: Mapping[str, Any]) -> str:
    """The options in which two runs' settings differ, in words: ``--seed 1 where this run has --seed 0``."""
    said = []
    for name, option in IDENTITY_OPTIONS + SYNTHETIC_OPTIONS:
        if theirs.get(name) != mine.get(name) and (name in theirs or name in mine):
            def shown(settings):
                value = settings.get(name)
                return ",".join(map(str, value)) if name == "hidden" and value is not None else value
            said.append(f"{option} {shown(theirs)} where this run has {option} {shown(mine)}")
    return "; ".join(said) or "the same settings"


@dataclass
class Found:
    """One checkpoint file in a directory, as its record says (read, not verified)."""
    step: int
    path: str
    run: Optional[str]                     # its run's identity; None: unknown (no record of it, or unreadable)
    settings: Optional[Dict[str, Any]]
    mode: Optional[str]
    readable: bool                         # whether its record could be read at all


_records: Dict[Tuple[str, int, int, int], Tuple[Optional[str], Optional[Dict[str, Any]], Optional[str], bool]] = {}


def _record(path: str) -> Tuple[Optional[str], Optional[Dict[str, Any]], Optional[str], bool]:
    """(identity, settings, mode, readable) of the checkpoint at ``path``, from its record, unverified;
    remembered per file version (a checkpoint is only ever replaced whole)."""
    try:
        info = os.stat(path)
    except OSError:
        return None, None, None, False
    key = (path, info.st_ino, info.st_mtime_ns, info.st_size)
    if key not in _records:
        try:
            with np.load(path, allow_pickle=False) as data:
                meta = json.loads(str(data["meta"]))
            if not isinstance(meta, dict):
                raise ValueError("bad meta record")
            _records[key] = (identity_of(meta), settings_of(meta), mode_of(meta), True)
        except (OSError, ValueError, EOFError, zipfile.BadZipFile, KeyError):
            _records[key] = (None, None, None, False)
    return _records[key]


def survey(directory: str) -> List[Found]:
    """The checkpoints in ``directory``, oldest first, each with its run as its record says."""
    return [Found(step, path, *_record(path)) for step, path in listing(directory)]


def latest(directory: str) -> Optional[str]:
    """The newest checkpoint's path in ``directory``, or None if it holds none."""
    found = listing(directory)
    return found[-1][1] if found else None


def checksum(arrays: Dict[str, np.ndarray], record: str) -> str:
    """blake2b over the JSON record and every array's name, dtype, shape and bytes, in name order."""
    h = hashlib.blake2b(digest_size=16)
    h.update(record.encode())
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"|{name}|{a.dtype.str}|{a.shape}|".encode())
        h.update(a.data)
    return h.hexdigest()


def directory_problem(directory: str) -> Optional[str]:
    """Why checkpoints cannot be written to ``directory``, found by trying; None if they can.

    Creates ``directory`` (and any missing parents), creates, writes and removes a small file in
    it and lists it, then removes the directories it created: the check leaves nothing behind.
    The answer is about this process (rank 0 writes the checkpoints) and this moment.
    """
    path = os.path.abspath(directory)
    missing: List[str] = []
    existing = path
    while not os.path.lexists(existing):
        missing.append(existing)
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        if existing == path:
            return f"{path} exists and is not a directory"
        return f"cannot create {path}: {existing} is not a directory"
    made: List[str] = []
    try:
        try:
            for parent in reversed(missing):
                os.mkdir(parent)
                made.append(parent)
        except OSError as error:
            return f"cannot create {path}: {error.strerror or error}"
        probe = os.path.join(path, f"{TMP_PREFIX}probe-{os.getpid()}")
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(fd, b"allreduce_kit checkpoint directory probe\n")
            finally:
                os.close(fd)
                os.unlink(probe)
        except OSError as error:
            return f"cannot write a file in {path}: {error.strerror or error}"
        try:
            os.listdir(path)                   # saving lists it to keep the newest K
        except OSError as error:
            return f"cannot list {path}: {error.strerror or error}"
        return None
    finally:
        for parent in reversed(made):
            try:
                os.rmdir(parent)
            except OSError:
                pass


def _fsync_directory(directory: str) -> None:
    try:                                   # makes the rename itself durable
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def save(directory: str, step: int, arrays: Dict[str, np.ndarray], meta: Dict[str, Any], keep: int = 3) -> str:
    """Write ``arrays`` and ``meta`` as ``directory/checkpoint-<step>.npz`` atomically; keep the newest ``keep``.

    Returns the path written. ``meta`` must be JSON-serialisable; ``step`` is stored in it. Only
    checkpoints of the same run as ``meta``'s (``identity_of``) count towards ``keep`` and are
    deleted; a file of another run (or one whose record cannot be read) at ``step`` is not written
    over: ``CheckpointError``, before anything is written.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    os.makedirs(directory, exist_ok=True)
    mine = identity_of(meta)
    final = os.path.join(directory, name_for(step))
    if os.path.lexists(final):
        run, _, _, readable = _record(final)
        if run != mine or not readable:
            held = "a checkpoint of another run" if readable else "a file whose record cannot be read"
            raise CheckpointError(f"{final} holds {held}; it is not written over: move it away")
    for stale in glob.glob(os.path.join(directory, TMP_PREFIX + "*")):
        try:                               # left by a writer that was killed mid-write
            os.unlink(stale)
        except OSError:
            pass
    write(final, arrays, {**meta, "step": step})
    own = [found.path for found in survey(directory) if found.readable and found.run == mine]
    for old in own[:-keep]:
        os.unlink(old)
        shutil.rmtree(shards_dir(old), ignore_errors=True)     # a sharded run's blocks of it
    return final


def write(final: str, arrays: Dict[str, np.ndarray], meta: Dict[str, Any]) -> None:
    """Write ``arrays`` and the record ``meta`` (with format, version and checksum) as the ``.npz``
    ``final``, atomically: a temporary file in the same directory, flushed, fsynced, renamed."""
    directory = os.path.dirname(os.path.abspath(final))
    tmp = os.path.join(directory, f"{TMP_PREFIX}{os.getpid()}-{os.path.basename(final)}")
    record = json.dumps({**meta, "format": FORMAT, "version": VERSION})
    fields = {"meta": np.array(record), "checksum": np.array(checksum(arrays, record)), **arrays}
    try:
        with open(tmp, "wb") as out:
            np.savez(out, **fields)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, final)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    _fsync_directory(directory)


# -- sharded checkpoints (python -m allreduce_kit.train --zero 1|2|3) --------------------------------
#: How a sharded checkpoint's blocks are cut, as its manifest names it.
BLOCK_RULE = "allreduce_kit.blocks.block(stop - start, ranks, rank) of every unit [start, stop)"


def shards_dir(path: str) -> str:
    """The directory of a sharded checkpoint's per-rank files, beside its manifest ``path``."""
    return path[:-len(".npz")] + ".shards" if path.endswith(".npz") else path + ".shards"


def shard_name(rank: int) -> str:
    return f"rank-{rank:05d}.npz"


def is_sharded(meta: Mapping[str, Any]) -> bool:
    """Whether a checkpoint's record is a sharded run's manifest (its arrays in per-rank files)."""
    return isinstance(meta.get("sharded"), dict)


def read_sharded(path: str, meta: Mapping[str, Any], names: List[str],
                 into: Optional[Dict[str, np.ndarray]] = None) -> Dict[str, np.ndarray]:
    """The whole flat arrays ``names`` (``params`` and the optimizer state's) of the sharded
    checkpoint whose manifest at ``path`` holds ``meta``: every rank's file read and verified in
    turn, its blocks put in place (``into``, or new arrays). Holds one rank's file at a time besides
    the result. ``CheckpointError`` naming the file if one is missing, unsound, of another run,
    stage or rank count than the manifest says, or lacks an array."""
    record = meta["sharded"]
    ranks, units, size = int(record["ranks"]), [tuple(u) for u in record["units"]], int(record["size"])
    dtype = np.dtype(meta.get("dtype", "float32"))
    out = into if into is not None else {name: np.empty(size, dtype) for name in names}
    folder = shards_dir(path)
    from ..blocks import block
    for rank in range(ranks):
        file = os.path.join(folder, shard_name(rank))
        try:
            arrays, shard = load(file)
        except FileNotFoundError:
            raise CheckpointError(f"{file} is missing: the sharded checkpoint {path} names {ranks} rank files") from None
        expected = {"rank": rank, "ranks": ranks, "stage": record["stage"], "step": meta.get("step"),
                    "run": meta.get("run")}
        for key, value in expected.items():
            if shard.get(key) != value:
                raise CheckpointError(f"{file} is not rank {rank}'s file of {path}: its record has {key} "
                                      f"{shard.get(key)!r} where the manifest says {value!r}")
        at = 0
        pieces = [(a + block(b - a, ranks, rank)[0], a + block(b - a, ranks, rank)[1]) for a, b in units]
        length = sum(hi - lo for lo, hi in pieces)
        for name in names:
            got = arrays.get(name)
            if got is None or got.shape != (length,):
                raise CheckpointError(f"{file} holds {name} of shape {None if got is None else got.shape}; rank "
                                      f"{rank}'s blocks by the manifest's rule have {length} elements")
        for lo, hi in pieces:
            for name in names:
                out[name][lo:hi] = arrays[name][at:at + hi - lo]
            at += hi - lo
        del arrays
    return out


# -- pipeline checkpoints (python -m allreduce_kit.train --pipeline S) -----------------------------
def stage_name(stage: int) -> str:
    return f"stage-{stage:05d}.npz"


def is_pipeline(meta: Mapping[str, Any]) -> bool:
    """Whether a checkpoint's record is a pipeline run's manifest (its layers in per-stage files)."""
    return isinstance(meta.get("pipeline"), dict)


def parts_of(meta: Mapping[str, Any]) -> Optional[Mapping[str, Any]]:
    """The record of a checkpoint kept in parts (a sharded or a pipeline run's manifest: ``arrays``,
    ``size``, ...), or None for a whole one."""
    return meta["sharded"] if is_sharded(meta) else meta["pipeline"] if is_pipeline(meta) else None


def read_pipeline(path: str, meta: Mapping[str, Any], names: List[str],
                  layers: Optional[List[int]] = None) -> Dict[str, np.ndarray]:
    """The whole flat arrays ``names`` of the pipeline checkpoint whose manifest at ``path`` holds
    ``meta``: each stage's file holds its layers' ``[start, stop)`` of the model's flat layout, one
    after the other. ``layers``: read only the files holding one of them (the rest of each array is
    left unwritten). ``CheckpointError`` naming the file if one is missing, unsound, of another run
    or step than the manifest says, or lacks an array."""
    record = meta["pipeline"]
    bounds = [tuple(b) for b in record["bounds"]]
    dtype = np.dtype(meta.get("dtype", "float32"))
    out = {name: np.empty(int(record["size"]), dtype) for name in names}
    folder = shards_dir(path)
    for stage, held in enumerate(record["layers"]):
        if layers is not None and not set(held) & set(layers):
            continue
        file = os.path.join(folder, stage_name(stage))
        try:
            arrays, part = load(file)
        except FileNotFoundError:
            raise CheckpointError(f"{file} is missing: the pipeline checkpoint {path} names "
                                  f"{len(record['layers'])} stage files") from None
        for key, value in {"stage": stage, "layers": list(held), "step": meta.get("step"), "run": meta.get("run")}.items():
            if part.get(key) != value:
                raise CheckpointError(f"{file} is not stage {stage}'s file of {path}: its record has {key} "
                                      f"{part.get(key)!r} where the manifest says {value!r}")
        length = sum(bounds[layer][1] - bounds[layer][0] for layer in held)
        for name in names:
            got = arrays.get(name)
            if got is None or got.shape != (length,):
                raise CheckpointError(f"{file} holds {name} of shape {None if got is None else got.shape}; stage "
                                      f"{stage}'s layers {list(held)} have {length} elements")
            at = 0
            for layer in held:
                lo, hi = bounds[layer]
                out[name][lo:hi] = got[at:at + hi - lo]
                at += hi - lo
        del arrays
    return out


def read_parts(path: str, meta: Mapping[str, Any], names: List[str]) -> Dict[str, np.ndarray]:
    """The whole arrays ``names`` of a checkpoint kept in parts (``parts_of(meta)`` is not None)."""
    return read_sharded(path, meta, names) if is_sharded(meta) else read_pipeline(path, meta, names)


def consolidate(source: str, out: str) -> str:
    """Write the newest sharded checkpoint in directory ``source`` (or the manifest ``source``) as
    one whole checkpoint at ``out``: every array whole, the manifest's record without its
    ``sharded`` part. Returns the manifest's path. ``CheckpointError``/``FileNotFoundError`` say
    what is wrong."""
    path = source
    if os.path.isdir(source):
        found = [f for f in survey(source) if f.readable]
        if not found:
            raise FileNotFoundError(f"no checkpoint in {source} (no checkpoint-*.npz)")
        path = found[-1].path
    _, meta = load(path)
    record = parts_of(meta)
    if record is None:
        raise CheckpointError(f"{path} is not a sharded or pipeline checkpoint (a --zero 0 run's is whole already)")
    names = list(record["arrays"])
    arrays = read_parts(path, meta, names)
    whole = {key: value for key, value in meta.items() if key not in ("sharded", "pipeline", "format", "version")}
    whole["consolidated_from"] = {"path": os.path.abspath(path), "stage": meta["sharded"]["stage"],
                                  "ranks": meta["sharded"]["ranks"]} if is_sharded(meta) else \
        {"path": os.path.abspath(path), "pipeline": meta["pipeline"]["stages"]}
    write(out, arrays, whole)
    return path


def load(path: str) -> Tuple[Dict[str, np.ndarray], Dict[str, Any]]:
    """Read and verify one checkpoint file; ``CheckpointError`` (naming ``path``) if it is not sound."""
    try:
        with np.load(path, allow_pickle=False) as data:
            fields = {k: data[k] for k in data.files}
    except FileNotFoundError:
        raise
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, KeyError) as bad:
        raise CheckpointError(f"{path} is truncated or corrupted ({type(bad).__name__}: {bad})") from None
    if "meta" not in fields or "checksum" not in fields:
        raise CheckpointError(f"{path} is not an allreduce_kit.train checkpoint (no meta record or checksum)")
    record = str(fields.pop("meta"))
    stored = str(fields.pop("checksum"))
    try:
        meta = json.loads(record)
    except ValueError:
        raise CheckpointError(f"{path} is corrupted: its meta record is not JSON") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not an allreduce_kit.train checkpoint (format {meta.get('format')!r})"
                              if isinstance(meta, dict) else f"{path} is corrupted: bad meta record")
    if meta.get("version") != VERSION:
        raise CheckpointError(f"{path} has checkpoint format version {meta.get('version')!r}; this allreduce_kit "
                              f"reads version {VERSION}")
    if checksum(fields, record) != stored:
        raise CheckpointError(f"{path} is corrupted: its checksum does not match its contents")
    return fields, meta


def mode_of(meta: Dict[str, Any]) -> str:
    """The ``--mode`` of the run that wrote a checkpoint with this record (``sync`` records none)."""
    return str(meta.get("mode", "sync"))


def newest_mode(directory: str) -> Optional[Tuple[str, str]]:
    """``(path, mode)`` of the newest checkpoint in ``directory``, or None if it holds none or cannot
    be read (``load`` then says why, when it matters). Reads the record only, unverified."""
    try:
        path = latest(directory)
        if path is None:
            return None
        with np.load(path, allow_pickle=False) as data:
            meta = json.loads(str(data["meta"]))
        return (path, mode_of(meta)) if isinstance(meta, dict) else None
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, KeyError):
        return None
