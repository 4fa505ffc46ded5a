"""Atomic checkpoints: rank 0 writes a temporary file, fsyncs it, then renames it into place.

A crash at any moment leaves either the previous checkpoint or the new one, never half a file
(``os.replace`` is atomic on POSIX within one file system). The file is an ``.npz`` holding the
flat parameters, the optimizer's velocity, and a JSON record with the step and the random
generators' states; it is read with ``allow_pickle=False``.
"""
import json
import os
from typing import Any, Dict, Tuple

import numpy as np

FILENAME = "checkpoint.npz"


def path_in(directory: str) -> str:
    return os.path.join(directory, FILENAME)


def save(directory: str, arrays: Dict[str, np.ndarray], meta: Dict[str, Any]) -> str:
    """Write ``arrays`` and ``meta`` to ``directory/checkpoint.npz`` atomically; return the path."""
    os.makedirs(directory, exist_ok=True)
    final = path_in(directory)
    tmp = f"{final}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as out:
            np.savez(out, meta=np.array(json.dumps(meta)), **arrays)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, final)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    try:                                   # make the rename itself durable
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass
    return final


def load(directory: str) -> Tuple[Dict[str, np.ndarray], Dict[str, Any]]:
    """Read ``directory/checkpoint.npz``; raises ``FileNotFoundError``/``ValueError`` if absent or bad."""
    with np.load(path_in(directory), allow_pickle=False) as data:
        arrays = {k: data[k] for k in data.files if k != "meta"}
        meta = json.loads(str(data["meta"]))
    return arrays, meta
