"""The reduction step in plain numpy, for ``bench --kernel numpy``: what the numba kernels buy.

Same interface as ``allreduce_kit.kernels`` (``reduce_into``, ``reduce_serial``, ``OP_CODES``,
``divide``, ``sum_divide_into``).
A mean's last step takes two passes here (add, then divide) where the numba kernel takes one.
numpy's ``maximum``/``minimum`` do not promise which zero ``max(+0.0, -0.0)`` returns, so this
backend is for measuring, not for results that must match bit for bit across operand orders.
"""
import numpy as np

_UFUNCS = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}
OP_CODES = {op: code for code, op in enumerate(_UFUNCS)}
_BY_CODE = tuple(_UFUNCS.values())


def reduce_into(dst: np.ndarray, src: np.ndarray, op: str, threads: int = 0) -> None:
    _UFUNCS[op](dst, src, out=dst)


def reduce_serial(dst: np.ndarray, src: np.ndarray, code: int) -> None:
    _BY_CODE[code](dst, src, out=dst)


def divide(buf: np.ndarray, divisor: int) -> None:
    if buf.dtype.kind == "f":
        np.divide(buf, buf.dtype.type(divisor), out=buf)
    else:  # truncate toward zero, as the kernels do
        negative = buf < 0
        np.abs(buf, out=buf)
        np.floor_divide(buf, divisor, out=buf)
        np.negative(buf, out=buf, where=negative)


def sum_divide_into(dst: np.ndarray, src: np.ndarray, divisor: int) -> None:
    np.add(dst, src, out=dst)
    divide(dst, divisor)
