"""Less work per rank at the start of a command-line run: for the CLIs' own processes, never on import.

``python -m allreduce_kit.train`` starts every rank of a job on the same node at once, each doing
the same set-up; with more ranks than cores, every CPU-second a rank spends starting is paid
about ranks / cores times over in wall time (docs/training.md, "Start-up cost").
"""
import sys

#: The module numba imports to look for BLAS, and the one numba module that asks for it.
_BLAS_PROBE = "scipy.linalg.cython_blas"
_ASKS = "numba.np.arraymath"


def numba_without_scipy() -> bool:
    """Import numba's numpy implementations without letting them import ``scipy.linalg``; return
    whether it was kept out.

    At a process's first compiled call (from numba's cache or not) numba registers its numpy
    implementations, and one of them, if scipy is installed (scikit-learn installs it), imports
    ``scipy.linalg`` to decide whether compiled ``np.correlate`` and ``np.convolve`` may call BLAS:
    about 0.1-0.2 s of CPU per rank, for functions this package's compiled code never calls. Here
    that import finds nothing, so in this process those two use numba's own loop; everything
    else is as before (numba still imports ``scipy.linalg`` when it compiles a function that needs
    BLAS, such as ``np.dot``). Does nothing if numba's module or ``scipy.linalg`` is loaded already.
    Only for a process that runs no code of the user's (the CLIs): the user's compiled
    ``np.correlate`` would give other rounding.
    """
    if _ASKS in sys.modules or "scipy.linalg" in sys.modules or _BLAS_PROBE in sys.modules:
        return False
    sys.modules[_BLAS_PROBE] = None          # an import of it raises ImportError: "no BLAS"
    try:
        import numba.np.arraymath  # noqa: F401
    finally:
        if _BLAS_PROBE in sys.modules and sys.modules[_BLAS_PROBE] is None:
            del sys.modules[_BLAS_PROBE]
    return True


def one_rank_compiles() -> int:
    """Make every numba function of the package's loaded modules compile under the node's lock
    (``kernels.cache.compiling``); return how many.

    On the first run after installing, no kernel is in numba's cache yet, and every rank of the
    node would compile the same ones at the same time (8 ranks on 2 cores: four times the wall
    time of one compile). Under the lock one rank compiles each into the cache while the others
    wait, then they load it. A kernel the cache holds is loaded without the lock.
    """
    from numba.core.dispatcher import Dispatcher

    from .kernels import cache

    done = 0
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "allreduce_kit" or name.startswith("allreduce_kit.")):
            continue
        for value in list(vars(module).values()):
            if isinstance(value, Dispatcher) and "compile" not in vars(value):
                cache.one_at_a_time(value)
                done += 1
    return done
