"""``python -m allreduce_kit.kernels``: the kernels' throughput against numpy, in one run.

Throughput counts bytes read and written: ``dst op= src`` reads two arrays and writes one.
"""
import argparse
import time

import numba
import numpy as np

from .. import __version__
from . import OPS, reduce_into, warm_up
from . import reduce as _k

NUMPY = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}


def median_seconds(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m allreduce_kit.kernels", description=__doc__,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--version", action="version", version=f"allreduce_kit {__version__}")
    parser.add_argument("--mib", type=float, default=64, help="array size in MiB")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64", "int32", "int64"])
    parser.add_argument("--ops", default="sum", help="comma-separated ops, or 'all'")
    parser.add_argument("--repeat", type=int, default=20, help="timed calls per row (median reported)")
    args = parser.parse_args(argv)
    if args.mib <= 0 or args.repeat < 1:
        parser.error("--mib and --repeat must be positive")
    ops = OPS if args.ops == "all" else args.ops.split(",")
    for op in ops:
        if op not in OPS:
            parser.error(f"--ops: unknown op {op!r}; choose from {', '.join(OPS)}")

    dtype = np.dtype(args.dtype)
    n = int(args.mib * 2**20) // dtype.itemsize
    rng = np.random.default_rng(0)
    dst = rng.random(n).astype(dtype) if dtype.kind == "f" else rng.integers(0, 2, n).astype(dtype)
    src = dst.copy()
    warm_up([dtype], ops)
    moved = 3 * dst.nbytes
    print(f"# {args.mib:g} MiB {dtype} per array, median of {args.repeat}, numba threads: {numba.get_num_threads()}")
    print(f"{'op':>5} {'implementation':<26} {'time(ms)':>9} {'GB/s':>7} {'vs numpy':>9}")
    for op in ops:
        code = {"sum": _k.SUM, "prod": _k.PROD, "max": _k.MAX, "min": _k.MIN}[op]
        rows = [(f"numpy {NUMPY[op].__name__}(out=dst)", lambda: NUMPY[op](dst, src, out=dst)),
                ("numba, 1 thread", lambda: _k.combine(dst, src, code)),
                (f"numba, {numba.get_num_threads()} threads", lambda: _k.combine_parallel(dst, src, code)),
                ("reduce_into (dispatch)", lambda: reduce_into(dst, src, op))]
        base = None
        for name, fn in rows:
            seconds = median_seconds(fn, args.repeat)
            base = base or seconds
            print(f"{op:>5} {name:<26} {seconds * 1e3:9.2f} {moved / seconds / 1e9:7.2f} {base / seconds:8.2f}x")


if __name__ == "__main__":
    main()
