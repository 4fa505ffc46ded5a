"""``ALLREDUCE_KIT_TRACE=PATH``: a program of its own is traced from its first library call on
``COMM_WORLD`` (the calls after it) until it exits, without a line of tracing code (one process: the wiring and the
write at exit; the clocks of several ranks are tested in ``tests/mpi/test_trace.py``)."""
import json
import os
import subprocess
import sys

from trace_schema import problems

PROGRAM = """
import numpy as np
import allreduce_kit
buf = np.ones(16)
for _ in range(3):
    allreduce_kit.allreduce(buf, algorithm="mpi")
allreduce_kit.broadcast(buf)
"""


def _run(env):
    return subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, **env))


def test_the_setting_traces_a_program_until_it_exits(tmp_path):
    path = tmp_path / "loop.json"
    result = _run({"ALLREDUCE_KIT_TRACE": str(path)})
    assert result.returncode == 0, result.stderr
    document = json.loads(path.read_text())
    assert problems(document) == []
    calls = [(e["name"], e["args"]["bytes"]) for e in document["traceEvents"] if e.get("cat") == "collective"]
    # the first call sets the library up on COMM_WORLD and starts tracing there: the calls after it are events
    assert calls == [("allreduce", 128)] * 2 + [("broadcast", 128)]

