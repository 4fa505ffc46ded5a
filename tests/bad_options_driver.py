"""Run many command lines of ``python -m allreduce_kit.train`` (or another CLI) in ONE MPI job (a test helper).

``mpiexec -n P python bad_options_driver.py CASES.json OUT.json [MODULE]``: for each case (an argv
list) every rank calls the CLI's ``main(argv)`` as ``python -m MODULE ARGV`` would (MODULE:
``allreduce_kit.train`` unless given, e.g. ``allreduce_kit.bench``), with
its stdout and stderr captured, and records the exit status (``SystemExit`` code or return
value) and whether it raised anything else. Rank 0 writes every rank's record per case to
OUT.json. A case where the ranks disagree would leave some rank inside a collective and the job
would hang: the launching test's timeout catches that.
"""
import contextlib
import importlib
import io
import json
import sys

from mpi4py import MPI


def run(main, argv):
    out, err = io.StringIO(), io.StringIO()
    status, raised = None, None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(argv)
        except SystemExit as exit_:
            status = exit_.code
        except BaseException as error:            # noqa: BLE001 - recorded, the test fails on it
            raised = f"{type(error).__name__}: {error}"
    return {"status": status, "stdout": out.getvalue(), "stderr": err.getvalue(), "raised": raised}


def drive(cases_path: str, out_path: str, module: str = "allreduce_kit.train") -> None:
    main = importlib.import_module(f"{module}.__main__").main
    comm = MPI.COMM_WORLD
    with open(cases_path) as f:
        cases = json.load(f)
    results = []
    for argv in cases:
        comm.Barrier()
        results.append(comm.gather(run(main, argv), root=0))
    if comm.Get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    drive(*sys.argv[1:4])
