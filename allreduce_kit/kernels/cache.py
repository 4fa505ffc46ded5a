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
"""
import hashlib
import os
from pathlib import Path
from typing import List

#: The package's folder: every module in it counts towards the stamp.
PACKAGE = Path(__file__).resolve().parent.parent
#: Where the stamp is kept: numba's cache files for the package's top level live there too.
STAMP = PACKAGE / "__pycache__" / "compiled-sources.stamp"


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
    the package now has; return whether anything was dropped."""
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
