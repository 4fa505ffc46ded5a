"""numba's on-disk cache of this package's compiled code, kept consistent across its modules.

numba checks a cached function against the source file that defines it, and nothing else; but a
compiled function also holds, inlined, every compiled function it calls from other modules (the
algorithms' loops hold ``spin.py``'s waits, ``direct.py``'s transfers, the kernels). A version of
this package that changed a helper but not its caller's file would load the caller's old code
beside the new helpers, which can read its arguments wrongly and crash the process.

So the package keeps one stamp, a hash of the text of every module of it, beside the cache: when
the package's sources differ from the stamp's, every cached function of the package is dropped
once (and compiled again on first use: a few seconds at the first start after an upgrade).
``refresh`` runs when ``allreduce_kit.kernels`` is first imported, before anything compiled is
loaded; while the files' sizes and times match the stamp's, it reads none of them. Where the package's folders cannot be
written, numba keeps its cache elsewhere and nothing is done here.

The ranks of a job start together and, on the first run after an install or an upgrade, find the
same functions missing from the cache. ``compiling`` is a lock shared by the node's processes
(an ``flock`` beside the stamp): the CLIs make the package's functions compile under it
(``one_at_a_time``, through ``allreduce_kit.startup``), so one rank compiles each into the cache
while the others wait and then load it, instead of every rank compiling every one.
"""
import hashlib
import os
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, List, Optional

#: The package's folder: every module in it counts towards the stamp.
PACKAGE = Path(__file__).resolve().parent.parent
#: Where the stamp is kept: numba's cache files for the package's top level live there too.
STAMP = PACKAGE / "__pycache__" / "compiled-sources.stamp"
#: The node's lock on compiling the package's functions (``compiling``).
LOCK = PACKAGE / "__pycache__" / "compile.lock"


def sources(package: Path = PACKAGE) -> List[Path]:
    """The package's modules, in a fixed order."""
    return sorted(p for p in package.rglob("*.py") if "__pycache__" not in p.parts)


def stamp(package: Path = PACKAGE) -> str:
    """A hash of every module's path in the package and text."""
    digest = hashlib.blake2b(digest_size=16)
    for path in sources(package):
        digest.update(str(path.relative_to(package)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _quick(package: Path, paths: List[Path]) -> str:
    """What the files look like from outside (path, size, modification time): if this matches
    the stamp's, the texts are not read."""
    digest = hashlib.blake2b(digest_size=16)
    for path in paths:
        info = path.stat()
        digest.update(f"{path.relative_to(package)} {info.st_size} {info.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def refresh(package: Path = PACKAGE, stamp_file: Path = STAMP) -> bool:
    """Drop the package's cached compiled functions if they were compiled from other sources than
    the package now has; return whether anything was dropped. Under the node's lock on compiling
    (``compiling``), so that no process drops what another has just compiled for these sources."""
    with compiling(stamp_file.with_name(LOCK.name)):
        return _refresh(package, stamp_file)


def _refresh(package: Path, stamp_file: Path) -> bool:
    try:
        quick = _quick(package, sources(package))
        recorded = stamp_file.read_text().split() if stamp_file.is_file() else []
        if recorded[:1] == [quick]:
            return False
        current = stamp(package)
        stamp_file.parent.mkdir(exist_ok=True)  # where it cannot be, nothing is dropped either
        dropped = False
        if recorded[1:2] != [current]:
            for cached in list(package.rglob("*.nbi")) + list(package.rglob("*.nbc")):
                try:
                    cached.unlink()
                    dropped = True
                except FileNotFoundError:  # another rank of the same start dropped it first
                    pass
        partial = stamp_file.with_name(f"{stamp_file.name}.{os.getpid()}")
        partial.write_text(f"{quick} {current}\n")
        os.replace(partial, stamp_file)
        return dropped
    except OSError:  # a read-only install: numba caches elsewhere (or not at all)
        return False


_held = threading.RLock()
_depth = 0
_fd: Optional[int] = None


def _lock(path: Path) -> Optional[int]:
    """An exclusive ``flock`` on ``path`` (waits for it), as an open descriptor; None where there is none."""
    try:
        import fcntl

        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except (ImportError, OSError):             # no flock here, or a folder that cannot be written
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:
        os.close(fd)
        return None
    return fd


@contextmanager
def compiling(lock_file: Path = LOCK) -> Iterator[None]:
    """Hold the node's lock on compiling: one process of the node at a time, reentrant in a process.

    Processes that start together (the ranks of a job) and find a function missing from numba's
    cache would each compile it; under this lock the first compiles it into the cache and the
    others, once they hold the lock, load it from there. The lock is an ``flock`` on
    ``lock_file``, released when its holder leaves or dies; where it cannot be taken nothing waits.
    """
    global _depth, _fd
    with _held:
        if _depth == 0:
            _fd = _lock(lock_file)
        _depth += 1
        try:
            yield
        finally:
            _depth -= 1
            if _depth == 0 and _fd is not None:
                os.close(_fd)                  # closing it releases the flock
                _fd = None


def _in_cache(dispatcher, sig) -> bool:
    """Whether numba's cache holds ``dispatcher`` for ``sig`` (its index is read, not the code);
    True where that cannot be told (then nothing waits). Sets numba's compiler up first."""
    try:
        context = dispatcher.targetctx
        context.refresh()                      # numba's set-up (tenths of a second), outside the lock
        key = dispatcher._cache._index_key(sig, context.codegen())
        return key in dispatcher._cache._cache_file._load_index()
    except Exception:                          # no cache for it, or another numba's internals
        return True


def one_at_a_time(dispatcher, lock_file: Path = LOCK):
    """Make ``dispatcher`` (a numba function) compile under ``compiling`` a signature that numba's
    cache does not hold yet: its first use waits while another process of the node compiles it,
    then loads it. A signature the cache holds is loaded without the lock, as before."""
    from numba.core.compiler_lock import global_compiler_lock

    plain = dispatcher.compile

    def compile(sig):
        with global_compiler_lock:             # numba's lock first: one order on every path
            if _in_cache(dispatcher, sig):
                return plain(sig)
            with compiling(lock_file):
                return plain(sig)

    dispatcher.compile = compile
    return dispatcher
