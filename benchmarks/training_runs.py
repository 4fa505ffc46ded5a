"""What the training benchmarks share: one ``python -m allreduce_kit.train`` run under this
environment's ``mpiexec``, read back from its ``--json``; and a target checked and printed."""
import json
import subprocess
import sys
from pathlib import Path
from typing import List, Optional, Sequence

BIN = Path(sys.executable).parent
MPIEXEC = str(BIN / "mpiexec") if (BIN / "mpiexec").exists() else "mpiexec"
TRAIN = [sys.executable, "-m", "allreduce_kit.train", "--progress", "lines"]


def train(ranks: int, args: Sequence[str], out: Path, timeout: float, cwd: Optional[str] = None) -> Optional[dict]:
    """``mpiexec -n ranks python -m allreduce_kit.train ARGS --json OUT``: its report, or None
    (with the command and its error output printed) if it failed."""
    command = [MPIEXEC, "-n", str(ranks), *TRAIN, *map(str, args), "--json", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=cwd, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        print(f"FAILED ({done.returncode}): {' '.join(command)}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}",
              file=sys.stderr)
        return None
    return json.loads(Path(out).read_text())


def check(label: str, holds: bool, failures: List[str]) -> None:
    """Print whether a target holds; a failed one is added to ``failures``."""
    print(f"  {'holds' if holds else 'FAILS'}: {label}")
    if not holds:
        failures.append(label)
