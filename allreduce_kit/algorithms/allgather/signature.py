"""An allgather's signature (``algorithms/signature.py``): what its messages' tags and its
published word carry, so that a call whose ranks differ raises the same ``ValueError`` on every
rank.

A well-formed call has the same ``out`` length, dtype and blocks (``bounds``) on every rank. The
tag and the word are the allreduce's for ``out`` (its length and dtype) where the blocks are the
block rule's (``blocks.shard_bounds``), which the length fixes; other blocks (``Allgatherv``'s
case) are hashed in as well (``signature.keyed_tag``, ``keyed_word``), so that blocks that
differ between ranks with the same total are found too.
"""
from typing import Sequence

import numpy as np

from ...blocks import shard_bounds
from .. import signature

CALLER = "allgather"


def _key(out: np.ndarray, bounds: Sequence[int], p: int):
    """The blocks, where they are not the block rule's for ``out``; else ``None``."""
    bounds = tuple(bounds)
    return None if bounds == tuple(shard_bounds(out.size, p)) else bounds


def tag(comm, out: np.ndarray, bounds: Sequence[int], algorithm: int) -> int:
    """The tag of the call's messages for ``algorithm`` (its module's ``TAG``)."""
    key = _key(out, bounds, comm.nranks)
    return signature.tag(out, algorithm) if key is None else signature.keyed_tag(out, algorithm, key)


def word(comm, out: np.ndarray, bounds: Sequence[int], algorithm: int) -> int:
    """The word the call publishes for ``direct.begin_word``."""
    key = _key(out, bounds, comm.nranks)
    return int(signature.word(out, algorithm)) if key is None else signature.keyed_word(out, algorithm, key)


def mismatch(comm, out: np.ndarray, bounds: Sequence[int], name: str) -> ValueError:
    """``signature.mismatch`` for an allgather: what each rank passed (collective)."""
    lengths = tuple(int(bounds[i + 1] - bounds[i]) for i in range(len(bounds) - 1))
    fields = (("block dtype", out.dtype.name), ("block lengths", lengths), ("algorithm", name))
    return signature.mismatch(comm, out, name, CALLER, fields, result="out")
