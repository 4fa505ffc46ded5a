#!/usr/bin/env bash
# Make every measurement that docs/performance.md quotes, on this machine, into OUTDIR.
#
#   docs/bench.sh [OUTDIR] [STEP...]      STEP: tune sweep numpy repeat autorepeat fit (default: all, in that order)
#
# OUTDIR defaults to results/ at the repository root (ignored by git). Run from the repository
# root with the venv built as docs/performance.md says, pip install ".[test,plot]" (the sweep's
# --plot needs matplotlib), or set PYTHON and MPIEXEC; RANKS="2 4 8" by default.
# Takes 20-25 minutes on a 2-core machine; run it when nothing else is running, since every
# rank count above the core count shares the cores. Then `python docs/summarize.py OUTDIR`
# prints the tables of docs/performance.md from the JSON files.
set -euo pipefail
OUT=${1:-results}
shift || true
STEPS=${*:-tune sweep numpy repeat autorepeat fit}
PY=${PYTHON:-.venv/bin/python}
MPIEXEC=${MPIEXEC:-.venv/bin/mpiexec}
RANKS=${RANKS:-2 4 8}
BENCH="$PY -m allreduce_kit.bench"
mkdir -p "$OUT"

for step in $STEPS; do
  case $step in
  tune)    # crossover points for auto -> OUTDIR/tuning.json (copy the rules into selection.BUILTIN)
    rm -f "$OUT/tuning.json"  # rules for each p are added in turn
    for p in $RANKS; do
      $MPIEXEC -n "$p" $BENCH -b 4 -e 64M -f 2 -n 6 -w 2 -a naive,tree,ring,recursive_doubling,rabenseifner,shared_memory,two_shot,mpi \
        --tune "$OUT/tuning.json" --json "$OUT/tune-p$p.json" | tee "$OUT/tune-p$p.txt"
    done ;;
  sweep)   # the tables and plots: float32 sum, 4 B to 64 MiB, every algorithm, auto on the built-in table
    for p in $RANKS; do
      ALLREDUCE_KIT_TUNING=builtin $MPIEXEC -n "$p" $BENCH -b 4 -e 64M -f 2 -n 10 -w 2 \
        --json "$OUT/p$p.json" --csv "$OUT/p$p.csv" --plot "$OUT/p$p.png" | tee "$OUT/p$p.txt"
    done ;;
  numpy)   # what the numba kernels buy: the same large messages with the reduction step in numba or numpy.
           # kernel-numba-* and kernel-numpy-* keep to messages (ALLREDUCE_KIT_DIRECT=0), so that they differ in
           # the kernel alone; kernel-direct-* is the default: numba, with the direct paths that only
           # compiled kernels make possible (they fold inside compiled loops).
           # Three sets of the three runs, one after another, for medians.
    for rep in 1 2 3; do
      for p in $RANKS; do
        for run in direct numba numpy; do
          kernel=$([ $run = numpy ] && echo numpy || echo numba)
          direct=$([ $run = direct ] && echo 1 || echo 0)
          ALLREDUCE_KIT_DIRECT=$direct $MPIEXEC -n "$p" $BENCH -b 1M -e 64M -f 4 -n 10 -w 2 \
            -a ring,rabenseifner,two_shot,mpi --kernel $kernel --json "$OUT/kernel-$run-p$p-r$rep.json" \
            > "$OUT/kernel-$run-p$p-r$rep.txt"
        done
      done
    done ;;
  repeat)  # the target sizes again, three times each, for medians and ranges
    for rep in 1 2 3; do
      for p in $RANKS; do
        ALLREDUCE_KIT_TUNING=builtin $MPIEXEC -n "$p" $BENCH -b 8 -e 1K -f 2 -n 20 -w 5 \
          --json "$OUT/small-p$p-r$rep.json" > "$OUT/small-p$p-r$rep.txt"
        ALLREDUCE_KIT_TUNING=builtin $MPIEXEC -n "$p" $BENCH -b 16M -e 64M -f 4 -n 10 -w 2 \
          -a ring,rabenseifner,two_shot,auto,mpi --json "$OUT/large-p$p-r$rep.json" > "$OUT/large-p$p-r$rep.txt"
      done
    done ;;
  autorepeat)  # auto at every size, three times, beside the algorithms its table chooses from
    for rep in 1 2 3; do
      for p in $RANKS; do
        ALLREDUCE_KIT_TUNING=builtin $MPIEXEC -n "$p" $BENCH -b 4 -e 64M -f 2 -n 10 -w 2 \
          -a shared_memory,two_shot,auto,mpi --json "$OUT/auto-p$p-r$rep.json" > "$OUT/auto-p$p-r$rep.txt"
      done
    done ;;
  fit)     # alpha, beta, gamma from the sweeps, predicted beside measured
    $BENCH --fit $(for p in $RANKS; do echo "$OUT/p$p.json"; done) --json "$OUT/fit.json" | tee "$OUT/fit.txt" ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
# The tables of docs/performance.md, from whatever the steps above (and earlier runs into OUTDIR) left there.
$PY docs/summarize.py "$OUT" > "$OUT/summary.md"
echo "tables in $OUT/summary.md"
