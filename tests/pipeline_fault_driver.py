"""``python -m allreduce_kit.train ARGS`` with one rank's pipeline stage raising (a test helper).

``mpiexec -n P python pipeline_fault_driver.py RANK CALL ARGS...``: on rank RANK (its ``PMI_RANK``),
the CALL-th forward of a stage raises ``ValueError("injected fault")``; everything else is the
trainer's own command line, run as ``python -m allreduce_kit.train ARGS`` runs it (its abort hook
included).
"""
import os
import runpy
import sys

rank, call = int(sys.argv[1]), int(sys.argv[2])
if os.environ.get("PMI_RANK") == str(rank):
    from allreduce_kit.pipeline.stage import StageLayers

    forward, calls = StageLayers.forward, [0]

    def failing(self, mb, x, keep=True):
        calls[0] += 1
        if calls[0] == call:
            raise ValueError("injected fault")
        return forward(self, mb, x, keep)

    StageLayers.forward = failing
sys.argv = ["allreduce_kit.train", *sys.argv[3:]]
runpy.run_module("allreduce_kit.train", run_name="__main__", alter_sys=True)
