"""``python -m allreduce_kit.bench``: every algorithm side by side with MPI's own ``Allreduce``.

Modules: ``__main__`` (the command line), ``sweep`` (what runs for each size and algorithm),
``timing`` (the timed loop), ``output`` (table, CSV, JSON), ``plot``, ``tune`` (crossover
points for ``auto``), ``fit`` (the alpha-beta-gamma cost model, least squares) and
``numpy_kernels`` (plain-numpy arithmetic, to show what the numba kernels buy).
"""
