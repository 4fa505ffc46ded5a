"""Every ``ALLREDUCE_KIT_*`` setting, read here and nowhere else.

Each setting is one line: its variable, how its text is parsed, its default and what it does.
A value is read when it is first used, not when the package is imported, so a typo in a
variable raises ``ValueError`` naming the variable at that point (the first collective, the
first ``auto`` call, the CLI's start), never at ``import allreduce_kit``.

Precedence, where a setting has more than one source: a CLI flag, then an argument to the API
(``allreduce(..., check=True)``, ``set_stall_timeout(5)``), then the environment, then the
default below. ``docs/settings.md`` is the same table for users.
"""
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Tuple

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def boolean(text: str) -> bool:
    """``1/true/yes/on`` or ``0/false/no/off``, any case."""
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError(f"expected one of {'/'.join(_TRUE)} or {'/'.join(_FALSE)}")


def seconds(value: Any) -> float:
    """A finite number of seconds >= 0 (0 turns the feature off), from text or a number."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(f"expected a number of seconds, got {type(value).__name__}")
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"expected a number of seconds, got {value!r}") from None
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"expected a finite number of seconds >= 0 (0: off), got {value!r}")
    return number


def seconds_argument(value: Any) -> float:
    """``seconds`` for a value passed to the API: a number (an int or a float), not text."""
    if isinstance(value, (str, bool)) or not isinstance(value, (int, float)):
        raise TypeError(f"expected a number of seconds, got {type(value).__name__}")
    return seconds(value)


def text(value: str) -> str:
    return value.strip()


def online_mode(text: str) -> str:
    """``on``/``1``/..., ``off``/``0``/..., or ``save`` (any case)."""
    lowered = text.strip().lower()
    if lowered == "save":
        return "save"
    return "on" if boolean(lowered) else "off"


def wait_mode(text: str) -> str:
    """``auto``, ``spin``, ``yield`` or ``block`` (any case)."""
    lowered = text.strip().lower()
    if lowered not in ("auto", "spin", "yield", "block"):
        raise ValueError("expected auto, spin, yield or block")
    return lowered


def host_offsets(text: str) -> dict:
    """``HOST:US[,HOST:US...]``: microseconds (any sign) per host name, as a ``{host: ns}`` dict."""
    offsets = {}
    for item in text.split(","):
        host, sep, number = item.strip().rpartition(":")
        try:
            value = float(number)
        except ValueError:
            value = math.nan
        if not sep or not host or not math.isfinite(value):
            raise ValueError(f"expected HOST:US[,HOST:US...] such as node2:5000, got {item.strip()!r}")
        offsets[host] = int(round(value * 1000))
    return offsets


@dataclass(frozen=True)
class Setting:
    """One environment variable: its name, parser, default and a line for the docs."""

    name: str
    parse: Callable[[str], Any]
    default: Any
    doc: str


STALL_TIMEOUT = Setting("ALLREDUCE_KIT_STALL_TIMEOUT", seconds, 60.0,
                        "seconds a collective may wait before the stall inspector names the missing ranks "
                        "and aborts the job; 0 turns it off (CLI: --stall-timeout; API: stall_timeout=, "
                        "set_stall_timeout)")
CHECK = Setting("ALLREDUCE_KIT_CHECK", boolean, False,
                "check=True for every allreduce that does not say otherwise: one small agreement step "
                "so that calls differing between ranks raise on every rank")
TUNING = Setting("ALLREDUCE_KIT_TUNING", text, "",
                 "the table auto uses: a tuning file's path, or 'builtin'; unset: the default tuning "
                 "file if it exists, else the built-in table")
ONLINE_TUNING = Setting("ALLREDUCE_KIT_ONLINE_TUNING", online_mode, "on",
                        "auto times its candidates during the first calls of each message size class, agrees "
                        "across ranks and keeps the fastest, wherever the built-in table would choose; "
                        "'save' also writes what it learns into the tuning file; 0 leaves auto to its table")
DIRECT = Setting("ALLREDUCE_KIT_DIRECT", boolean, True,
                 "on one node, let ring, rabenseifner and two_shot read and write peers' buffers "
                 "directly (process_vm_readv/writev); 0 keeps them to messages")
YIELD = Setting("ALLREDUCE_KIT_YIELD", boolean, True,
                "the CLIs, python -m allreduce_kit.run and allreduce_kit.torch's init() (called before MPI "
                "starts) set MPIR_CVAR_ENABLE_HEAVY_YIELD=1 (MPICH, when the job runs on that node alone) or "
                "OMPI_MCA_mpi_yield_when_idle=1 (Open MPI) before MPI starts when a node has more ranks than "
                "cores; 0 leaves them alone")
WAIT = Setting("ALLREDUCE_KIT_WAIT", wait_mode, "auto",
               "how ranks wait on a node's shared flags: spin, yield (sched_yield each turn) or block (a few "
               "yields, then sleep until woken); auto: spin if every rank has a core, else yield for up to 1 ms, "
               "then sleep until woken; block is faster only on a machine busy with other work; rank 0's value "
               "holds for the node")
ABORT_ON_ERROR = Setting("ALLREDUCE_KIT_ABORT_ON_ERROR", boolean, True,
                         "the CLIs and python -m allreduce_kit.run abort the whole job when one rank "
                         "raises an uncaught exception; 0 leaves the default (the other ranks hang)")
ELASTIC_DIR = Setting("ALLREDUCE_KIT_ELASTIC_DIR", text, "",
                      "set by python -m allreduce_kit.train --elastic for the ranks it launches: the directory "
                      "where each rank writes its pid, host and heartbeat, and rank 0 the step it has finished; unset: "
                      "not supervised")
ELASTIC_TIMEOUT = Setting("ALLREDUCE_KIT_ELASTIC_TIMEOUT", seconds, 10.0,
                          "python -m allreduce_kit.train --elastic: seconds without a heartbeat (each rank writes "
                          "one every tenth of this) after which a rank on another host is taken for dead, and a "
                          "host whose ranks are all dead for a dead node; 0: only the ranks on the "
                          "supervisor's host are watched")
TRACE = Setting("ALLREDUCE_KIT_TRACE", text, "",
                "a path: trace the program from its first library call on COMM_WORLD until it exits, every "
                "rank's collectives on rank 0's clock in one Chrome trace file that rank 0 writes "
                "(docs/trace.md); unset: not traced (the train and bench CLIs: --trace)")
TRACE_CLOCK_SKEW_US = Setting("ALLREDUCE_KIT_TRACE_CLOCK_SKEW_US", host_offsets, {},
                              "for testing a trace's clock alignment: HOST:US[,HOST:US...] moves the clock the "
                              "trace reads on the ranks of each HOST (MPI's processor name) US microseconds ahead "
                              "(behind if negative), its events and its clock measurements alike; the trace's offsets "
                              "must find it (docs/trace.md); unset: the clocks as they are")

#: Every setting, in the order of the docs' table.
SETTINGS: Tuple[Setting, ...] = (STALL_TIMEOUT, CHECK, TUNING, ONLINE_TUNING, DIRECT, YIELD, WAIT,
                                 ABORT_ON_ERROR, ELASTIC_DIR, ELASTIC_TIMEOUT, TRACE, TRACE_CLOCK_SKEW_US)

def read(setting: Setting, environ: Optional[Mapping[str, str]] = None) -> Any:
    """The setting's value from ``environ`` (default ``os.environ``), or its default if unset.

    ``ValueError`` names the variable and the value when it does not parse. Nothing is cached:
    each setting is read where it is used, once per communicator or per process (never per call).
    """
    raw = (os.environ if environ is None else environ).get(setting.name)
    if raw is None or not raw.strip():
        return setting.default
    try:
        return setting.parse(raw)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{setting.name}={raw!r}: {error}") from None


def table() -> str:
    """The settings as a Markdown table (the one in docs/settings.md)."""
    rows = ["| variable | default | what it does |", "| --- | --- | --- |"]
    for s in SETTINGS:
        default = "unset" if s.default == {} else {True: "1", False: "0", "": "unset"}.get(s.default, s.default) \
            if not isinstance(s.default, float) else f"{s.default:g}"
        rows.append(f"| `{s.name}` | {default} | {s.doc} |")
    return "\n".join(rows)
