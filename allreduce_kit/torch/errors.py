"""The exceptions Horovod's callers catch, with this package's own contract kept.

A call that cannot run as the ranks gave it (shapes or dtypes that differ between ranks, an op a
collective does not take) raises ``CollectiveError``: a ``ValueError``, as everywhere in this
package, and a ``RuntimeError``, which is what code written for Horovod catches. An
asynchronous call that failed raises ``HorovodInternalError`` (a ``RuntimeError``) from
``synchronize``, as Horovod's does, with the error the call raised as its ``__cause__``.
"""


class CollectiveError(ValueError, RuntimeError):
    """A collective call the ranks cannot run as given; raised the same way on every rank."""


class HorovodInternalError(RuntimeError):
    """An asynchronous call failed; raised by ``synchronize`` (the call's own error is ``__cause__``)."""
