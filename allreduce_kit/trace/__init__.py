"""One clock-aligned timeline of a whole job, in the Chrome trace event format.

- ``recorder.py``: the per-rank recorder (append-only, a tuple per event) and the two slots the
  library's hooks read (``ACTIVE``: recording now; ``CURRENT``: tracing this run at all).
- ``clock.py``: each rank's clock offset to rank 0, measured by ping-pong at the start and end.
- ``merge.py``: every rank's events on rank 0's clock, as one trace file.
- ``session.py``: ``start`` and ``finish`` (collective), and ``ALLREDUCE_KIT_TRACE``.
- ``summary.py``: ``python -m allreduce_kit.trace summary PATH.json``.
- ``split.py``: ``python -m allreduce_kit.trace split PATH.json OUTDIR``, one file per rank for
  readers of per-rank profiler traces (Holistic Trace Analysis).

Importing this package starts nothing: tracing is off until ``start`` (or the setting) turns it on.
See ``docs/trace.md``.
"""
