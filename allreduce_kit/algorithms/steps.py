"""Whole-buffer schedules of sends and receives: written once, run compiled or in Python.

``naive`` and ``tree`` move the whole buffer in every message, so each rank's part of either is
a list of steps ``(kind, peer)``: ``SEND`` its buffer to ``peer``; ``RECV`` ``peer``'s message
into its buffer; ``COMBINE``, receive it into scratch and fold it in; ``LAST``, the same, then
finish the reduction (a mean divides). ``run`` runs a rank's list: for a short buffer where
this MPI library allows it, in one call into compiled code (``native.run_steps``); else step
by step through mpi4py. Both tag every message with the call's signature and check every
message received (``signature.py``). If the compiled loop stops at a step (a message whose tag
shows that the ranks' calls differ, or that did not fit), the Python loop takes over after
that step with ``BAD`` set, so that either way every rank ends with the same error, and
otherwise with the same bits.
"""
from typing import Sequence, Tuple

from mpi4py import MPI

from . import native
from .native import COMBINE, LAST, RECV, SEND
from .signature import BAD, mismatch, recv, send, tag as signature

__all__ = ["SEND", "RECV", "COMBINE", "LAST", "Schedule", "run"]


class Schedule:
    """One rank's steps of one algorithm on one communicator, and their compiled form
    (``None`` where MPI cannot be called from compiled code). Each algorithm keeps its own
    subclass in the communicator's state."""

    __slots__ = ("steps", "compiled")

    def __init__(self, comm, steps: Sequence[Tuple[int, int]], algorithm: int):
        self.steps = tuple(steps)
        self.compiled = native.steps_for(comm, self.steps, algorithm)


def run(comm, buf, op, schedule: Schedule, algorithm: int, name: str) -> None:
    """Run ``schedule`` on ``buf`` with ``op``; ``algorithm``: the caller's ``TAG``, ``name``:
    its name, for the error every rank raises if the ranks' buffers differ."""
    steps, compiled = schedule.steps, schedule.compiled
    done = 0
    if compiled is not None and op.code is not None and buf.nbytes <= native.MAX_BYTES:
        done = native.run_steps(buf, compiled.state, compiled.handles, op.code, op.divisor)
        if done == len(steps):
            return
        err = compiled.error()
        if err and MPI.Get_error_class(err) != MPI.ERR_TRUNCATE:
            raise MPI.Exception(err)
        tag = signature(buf, algorithm) | BAD  # step ``done`` received a message that differs
        done += 1
    else:
        tag = signature(buf, algorithm)
    incoming = None
    for kind, peer in steps[done:]:
        if kind == SEND:
            send(comm, buf, peer, tag)
        elif kind == RECV:
            tag = recv(comm, buf, peer, tag)
        else:
            if incoming is None:
                incoming = comm.scratch(buf.size, buf.dtype)
            tag = recv(comm, incoming, peer, tag)
            op.combine(buf, incoming, last=kind == LAST)
    if tag & BAD:
        raise mismatch(comm, buf, name)
