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
"""
import glob
import hashlib
import json
import os
import re
import zipfile
from typing import Any, Dict, List, Optional, Tuple

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

    Returns the path written. ``meta`` must be JSON-serialisable; ``step`` is stored in it.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    os.makedirs(directory, exist_ok=True)
    for stale in glob.glob(os.path.join(directory, TMP_PREFIX + "*")):
        try:                               # left by a writer that was killed mid-write
            os.unlink(stale)
        except OSError:
            pass
    final = os.path.join(directory, name_for(step))
    tmp = os.path.join(directory, f"{TMP_PREFIX}{os.getpid()}-{name_for(step)}")
    record = json.dumps({**meta, "step": step, "format": FORMAT, "version": VERSION})
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
    for _, old in listing(directory)[:-keep]:
        os.unlink(old)
    return final


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
