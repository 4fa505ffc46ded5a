"""One public entry per collective beyond ``allreduce``, each in its own module: validate locally,
optionally agree across ranks, choose an algorithm from that collective's registry
(``allreduce_kit/algorithms/<collective>/``), run it watched by the stall inspector.

- ``reduce_scatter.py``: ``reduce_scatter(buf, out=None, *, op="sum", ...)``
- ``allgather.py``: ``allgather(block, out=None, *, counts=None, ...)``
- ``broadcast.py``: ``broadcast(buf, root=0, ...)``
- ``common.py``: what the three share (argument checks, the agreement step, the watch).

``allreduce`` itself stays in ``allreduce_kit/collective.py``. Importing this package starts
nothing; the public names are re-exported from ``allreduce_kit``.
"""
