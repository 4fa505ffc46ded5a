"""The repository speaks of the product, not of the work that made it.

Docs, comments, docstrings and scripts state what is true now; git keeps the history. Every
tracked text file is searched for labels that narrate that history: numbered work sessions,
issue and pull-request numbers, rounds of the work, superseded figures, things tried and not
kept. Product text that merely uses the words ("a Slurm session", "rounds of the ring",
"each rank issues a send") does not match.
"""
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SUFFIXES = {".py", ".md", ".sh", ".sbatch", ".txt", ".ini", ".cfg", ".toml", ".yml", ".yaml"}

#: What each pattern catches, and the pattern. Case-insensitive.
LABELS = {
    "a numbered work session": r"\bsessions?[ _-]?#?\d+",
    "a work session named by its place in time": r"\b(?:this|that|last|previous|earlier|next|later) session\b",
    "an issue number": r"\bissue #?\d+|\bissues #\d+",
    "a pull-request number": r"\b(?:PR|pull request) #?\d+",
    "a round of the work": r"\b(?:round \d+|(?:first|second|third|earlier|previous|last|next|later) rounds?) "
                           r"of (?:the )?work",
    "a superseded figure": r"\b(?:superseded|previously measured|used to be)\b",
    "something tried and not kept": r"\(not kept\)|\btried and not kept\b|[:;,] not kept\b",
}
PATTERNS = {name: re.compile(pattern, re.IGNORECASE) for name, pattern in LABELS.items()}


def tracked_text_files():
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    names = [n for n in listed.decode().split("\0") if n]
    return [ROOT / n for n in names if Path(n).suffix in SUFFIXES and (ROOT / n).is_file()
            and (ROOT / n).resolve() != Path(__file__).resolve()]


def history_labels(text: str):
    """(line number, label, matched text) for every history label in ``text``."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for name, pattern in PATTERNS.items():
            for match in pattern.finditer(line):
                found.append((number, name, match.group(0)))
    return found


@pytest.mark.parametrize("text", [
    "measured in session {n}, after the compiled copy",
    "files in results/autorepeat-session{n}/",
    "Sessions {n} and {m}'s runs",
    "the target stays open (issue {n})",
    "see issue #{n}",
    "merged in PR #{n}",
    "the second round of the work moved it",
    "figures from round {n} of the work",
    "this session did not achieve it",
    "a superseded figure: 0.82x",
    "the ring used to be slower",
    "previously measured at 4.1 ms",
    "a fused ring over a window (not kept)",
    "Tried and not kept: 1-2 MiB pieces",
])
def test_each_kind_of_history_label_is_caught(text):
    text = text.format(n=11, m=12)  # numbered here, so this file holds no label itself
    assert history_labels(text), text


@pytest.mark.parametrize("text", [
    "the test machine runs a Slurm {s} for the whole pytest {s}",
    "2 lg p rounds of the ring, one message each",
    "each rank {i}s 2 sends and 2 receives per step",
    "an {i} with the site's MPI: build mpi4py against it",
    "messages are kept in order per sender",
    "the buffer is used to hold the partial sums",
])
def test_product_text_is_not_taken_for_history(text):
    text = text.format(s="sess" + "ion", i="iss" + "ue")  # put together here, as above
    assert not history_labels(text), history_labels(text)


def test_no_tracked_text_file_narrates_the_history_of_the_work():
    files = tracked_text_files()
    if files is None:
        pytest.skip("not a git checkout")
    hits = []
    for path in files:
        for number, name, matched in history_labels(path.read_text(encoding="utf-8", errors="replace")):
            hits.append(f"{path.relative_to(ROOT)}:{number}: {name}: {matched!r}")
    assert not hits, f"{len(hits)} history label(s); state what is true now instead:\n" + "\n".join(hits)


def test_the_performance_page_is_read_in_minutes():
    """One current table per rank count and the model behind them, not pasted bench output."""
    lines = (ROOT / "docs" / "performance.md").read_text(encoding="utf-8").count("\n")
    assert lines < 300, f"docs/performance.md has {lines} lines; move detail to its own page"
