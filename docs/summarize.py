"""Summarise the JSON files of docs/bench.sh as the Markdown tables of docs/performance.md.

    python docs/summarize.py [RESULTS_DIR]          # default: results (where docs/bench.sh writes)

Each section is printed only when its files are in RESULTS_DIR, so a directory holding some of
the steps' output gives the tables of those steps. Every ratio is of median times measured side
by side in one bench run; over repeated runs the median ratio is shown with its range (min-max).
"""
import glob
import json
import os
import statistics
import sys
from collections import defaultdict

OURS = ("naive", "tree", "ring", "recursive_doubling", "rabenseifner", "shared_memory", "two_shot")
#: Columns of the per-rank-count sweep tables, in the order of the algorithm table.
SWEEP_COLUMNS = ("naive", "tree", "recursive_doubling", "ring", "rabenseifner", "two_shot", "shared_memory", "mpi")
#: Rows of the sweep tables: every fourth power of two from 4 B to 64 MiB.
SWEEP_SIZES = tuple(4 << (2 * k) for k in range(13))


def load(path):
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def by_size(rows):
    table = defaultdict(dict)
    for row in rows:
        table[row["size"]][row["algorithm"]] = row
    return table


def human(n):
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n // scale} {unit}"
    return f"{n} B"


def micros(t):
    return f"{t:.1f}" if t < 100 else f"{t:.0f}"


def spread(values):
    values = sorted(values)
    if not values:
        return "-"
    mid = statistics.median(values)
    return f"{mid:.2f}x" if len(values) == 1 else f"{mid:.2f}x ({values[0]:.2f}-{values[-1]:.2f})"


def repeated(out, kind, p, metric):
    """metric(size_table) -> {size: ratio} per run; combine runs per size."""
    per_size = defaultdict(list)
    for path in sorted(glob.glob(os.path.join(out, f"{kind}-p{p}-r*.json"))):
        for size, value in metric(by_size(load(path)["rows"])).items():
            if value is not None:
                per_size[size].append(value)
    return per_size


def ranks_of(out, pattern):
    """The rank counts of the files matching ``pattern`` (like ``auto-p*-r*.json``), sorted."""
    return sorted({int(os.path.basename(x).split("-p")[1].split("-")[0])
                   for x in glob.glob(os.path.join(out, pattern))})


def best_ours(named):
    ours = [r for n, r in named.items() if n in OURS]
    return min(ours, key=lambda r: r["time_us"]) if ours else None


def sweeps(out):
    """The sweep files ``pP.json``, by rank count."""
    found = {}
    for path in glob.glob(os.path.join(out, "p[0-9]*.json")):
        data = load(path)
        found[data["preamble"]["ranks"]] = data
    return dict(sorted(found.items()))


def sweep_tables(out):
    for p, data in sweeps(out).items():
        pre = data["preamble"]
        t = by_size(data["rows"])
        print(f"### {p} ranks\n")
        print(f"Median time per call in microseconds over {pre['samples']} samples, {pre['dtype']} {pre['op']}, "
              f"{' '.join(pre['mpi_library'].splitlines()[0].replace('Version:', '').split())} (mpi4py {pre['mpi4py']}), "
              f"{pre['numba_threads_per_rank']} numba thread per rank; `mpi` is MPI's own `Allreduce`.\n")
        print("| size | " + " | ".join(f"`{a}`" for a in SWEEP_COLUMNS) + " | `auto` (runs) | `auto` busbw (GB/s) "
              "| best of ours / `mpi` |")
        print("|---:|" + "---:|" * len(SWEEP_COLUMNS) + "---|---:|---:|")
        for size in SWEEP_SIZES:
            named = t.get(size)
            if not named:
                continue
            cells = [micros(named[a]["time_us"]) if a in named else "-" for a in SWEEP_COLUMNS]
            auto = named.get("auto")
            auto_cells = [f"{micros(auto['time_us'])} ({auto['chosen']})", f"{auto['busbw']:.2f}"] if auto else ["-", "-"]
            best = best_ours(named)
            ratio = f"{best['time_us'] / named['mpi']['time_us']:.2f}x" if best and "mpi" in named else "-"
            print(f"| {human(size)} | " + " | ".join(cells + auto_cells + [ratio]) + " |")
        print()


def repeat_table(out):
    ranks = sorted(set(ranks_of(out, "small-p*-r*.json")) | set(ranks_of(out, "large-p*-r*.json")))
    if not ranks:
        return
    print("### Repeated runs: small and large messages (median ratio over runs, range in brackets)\n")
    print("| p | size | best of ours / mpi | which | ring / mpi | rabenseifner / mpi | two_shot / mpi | "
          "auto / best of ours | auto / mpi |")
    print("|---|---|---|---|---|---|---|---|---|")
    for p in ranks:
        for kind in ("small", "large"):
            def metric_best(t):
                return {s: best_ours(n)["time_us"] / n["mpi"]["time_us"] for s, n in t.items() if best_ours(n)}

            def metric(name):
                return lambda t: {s: n[name]["time_us"] / n["mpi"]["time_us"] for s, n in t.items() if name in n}

            def metric_auto_best(t):
                return {s: n["auto"]["time_us"] / best_ours(n)["time_us"] for s, n in t.items()
                        if "auto" in n and best_ours(n)}

            winners = defaultdict(list)
            for path in sorted(glob.glob(os.path.join(out, f"{kind}-p{p}-r*.json"))):
                for s, n in by_size(load(path)["rows"]).items():
                    if best_ours(n):
                        winners[s].append(best_ours(n)["algorithm"])
            cols = [repeated(out, kind, p, m) for m in (metric_best, metric("ring"), metric("rabenseifner"),
                                                         metric("two_shot"), metric_auto_best, metric("auto"))]
            for size in sorted(cols[0]):
                which = "/".join(sorted(set(winners[size])))
                print(f"| {p} | {human(size)} | " + " | ".join(
                    [spread(cols[0][size]), which] + [spread(c.get(size, [])) for c in cols[1:]]) + " |")
    print()


def auto_sweep_table(out):
    found = sweeps(out)
    if not found:
        return
    print("### auto over the whole sweep (one run per p, every size from 4 B to 64 MiB)\n")
    print("| p | worst auto / best of ours (size) | worst auto / mpi (size) | sizes where auto > 1.1x best | "
          "sizes where auto > 1.3x mpi |")
    print("|---|---|---|---|---|")
    for p, data in found.items():
        t = by_size(data["rows"])
        vs_best = {s: n["auto"]["time_us"] / best_ours(n)["time_us"] for s, n in t.items() if "auto" in n}
        vs_mpi = {s: n["auto"]["time_us"] / n["mpi"]["time_us"] for s, n in t.items() if "auto" in n and "mpi" in n}
        if not vs_best or not vs_mpi:
            continue
        wb, wm = max(vs_best, key=vs_best.get), max(vs_mpi, key=vs_mpi.get)
        over_b = ", ".join(human(s) for s in sorted(vs_best) if vs_best[s] > 1.1) or "none"
        over_m = ", ".join(human(s) for s in sorted(vs_mpi) if vs_mpi[s] > 1.3) or "none"
        print(f"| {p} | {vs_best[wb]:.2f}x ({human(wb)}) | {vs_mpi[wm]:.2f}x ({human(wm)}) | {over_b} | {over_m} |")
    print()


def auto_repeat_tables(out):
    ranks = ranks_of(out, "auto-p*-r*.json")
    if not ranks:
        return
    print("### auto at every size, repeated (runs beside the algorithms auto chooses from)\n")
    print("| p | worst median auto / best (size) | sizes where the median is above 1.1x | "
          "worst median auto / mpi (size) | sizes where the median is above 1.3x mpi |")
    print("|---|---|---|---|---|")
    for p in ranks:
        def auto_best(t):
            return {s: n["auto"]["time_us"] / best_ours(n)["time_us"] for s, n in t.items() if "auto" in n and best_ours(n)}

        def auto_mpi(t):
            return {s: n["auto"]["time_us"] / n["mpi"]["time_us"] for s, n in t.items() if "auto" in n and "mpi" in n}

        vb = {s: statistics.median(v) for s, v in repeated(out, "auto", p, auto_best).items()}
        vm = {s: statistics.median(v) for s, v in repeated(out, "auto", p, auto_mpi).items()}
        if not vb or not vm:
            continue
        wb, wm = max(vb, key=vb.get), max(vm, key=vm.get)
        over_b = ", ".join(f"{human(s)} ({vb[s]:.2f}x)" for s in sorted(vb) if vb[s] > 1.1) or "none"
        over_m = ", ".join(human(s) for s in sorted(vm) if vm[s] > 1.3) or "none"
        print(f"| {p} | {vb[wb]:.2f}x ({human(wb)}) | {over_b} | {vm[wm]:.2f}x ({human(wm)}) | {over_m} |")

    print("\n### Does auto choose the fastest? (the same runs: each algorithm's median time over the runs)\n")
    print("| p | sizes | auto's choice is the fastest at | where it is not: choice / fastest | "
          "auto's row / its choice's row, same run: median (range) |")
    print("|---|---|---|---|---|")
    for p in ranks:
        times, chosen, same = defaultdict(list), {}, []
        for path in sorted(glob.glob(os.path.join(out, f"auto-p{p}-r*.json"))):
            for size, named in by_size(load(path)["rows"]).items():
                for name, row in named.items():
                    times[size, name].append(row["time_us"])
                if "auto" in named:
                    chosen[size] = named["auto"]["chosen"]
                    if chosen[size] in named:
                        same.append(named["auto"]["time_us"] / named[chosen[size]]["time_us"])
        misses, hits = [], 0
        for size in sorted(chosen):
            medians = {n: statistics.median(times[size, n]) for n in OURS if (size, n) in times}
            if not medians:
                continue
            fastest = min(medians, key=medians.get)
            if chosen[size] == fastest:
                hits += 1
            elif chosen[size] in medians:
                misses.append(f"{human(size)} ({chosen[size]} / {fastest} {medians[chosen[size]] / medians[fastest]:.2f}x)")
            else:
                misses.append(f"{human(size)} ({chosen[size]}, not measured beside it)")
        print(f"| {p} | {len(chosen)} | {hits} | {', '.join(misses) or 'none'} | {spread(same)} |")
    print()


def kernel_table(out):
    ranks = ranks_of(out, "kernel-*-p*-r*.json")
    if not ranks:
        return
    print("### What the numba kernel buys (time / mpi's in the same run, median over the rounds; "
          "messages: ALLREDUCE_KIT_DIRECT=0)\n")
    runs = ("direct", "numba", "numpy")
    kinds = ("direct", "messages, numba", "messages, numpy")
    algorithms = ("ring", "two_shot", "rabenseifner")
    print("| p | size | " + " | ".join(f"{a} {k}" for a in algorithms for k in kinds) + " | mpi (ms) |")
    print("|---" * (3 + len(algorithms) * len(runs)) + "|")
    for p in ranks:
        ratio, mpi = defaultdict(list), defaultdict(list)  # (run, size, algorithm) -> one per round
        for run in runs:
            for path in sorted(glob.glob(os.path.join(out, f"kernel-{run}-p{p}-r*.json"))):
                for size, named in by_size(load(path)["rows"]).items():
                    mpi[size].append(named["mpi"]["time_us"] / 1e3)
                    for name, row in named.items():
                        ratio[run, size, name].append(row["time_us"] / named["mpi"]["time_us"])
        for size in sorted(mpi):
            def cell(run, name):
                values = ratio.get((run, size, name))
                return f"{statistics.median(values):.2f}x" if values else "-"
            cells = [cell(r, a) for a in algorithms for r in runs] + [f"{statistics.median(mpi[size]):.2f}"]
            print(f"| {p} | {human(size)} | " + " | ".join(cells) + " |")
    print()


def fit_tables(out, fit_name):
    fit_path = os.path.join(out, fit_name)
    if not os.path.exists(fit_path):
        return
    fitted = load(fit_path)
    f = fitted["fit"]
    print("### The fit (all rank counts together)\n")
    print(f"alpha = {f['alpha'] * 1e6:.2f} us, beta = {f['beta'] * 1e9:.4f} ns/B "
          f"({1 / f['beta'] / 1e9 if f['beta'] else float('inf'):.2f} GB/s), gamma = {f['gamma'] * 1e9:.4f} ns/B "
          f"({1 / f['gamma'] / 1e9 if f['gamma'] else float('inf'):.2f} GB/s); median |relative error| "
          f"{f['median_abs_rel_error']:.0%} over {f['points']} rows.\n")
    print("| p alone | alpha (us) | beta (ns/B) | gamma (ns/B) | median abs. rel. error |")
    print("|---|---|---|---|---|")
    for p, g in sorted(fitted["fit_per_ranks"].items(), key=lambda kv: int(kv[0])):
        print(f"| {p} | {g['alpha'] * 1e6:.2f} | {g['beta'] * 1e9:.4f} | {g['gamma'] * 1e9:.4f} | "
              f"{g['median_abs_rel_error']:.0%} |")
    shown = (8, 64 << 20)
    print("\n### Predicted (each rank count's own fit) beside measured, median time per call in microseconds\n")
    names = ("naive", "tree", "ring", "recursive_doubling", "rabenseifner")
    print("| p | size | " + " | ".join(f"{n} meas. / pred." for n in names) + " |")
    print("|---|---|" + "---|" * len(names))
    table = defaultdict(dict)
    for r in fitted["predicted"]:
        table[(r["ranks"], r["size"])][r["algorithm"]] = r
    for (p, size) in sorted(table):
        if size not in shown:
            continue
        cells = []
        for n in names:
            r = table[(p, size)].get(n)
            cells.append(f"{r['measured_us']:.0f} / {r['predicted_us']:.0f}" if r else "-")
        print(f"| {p} | {human(size)} | " + " | ".join(cells) + " |")
    print()


def main(out="results", fit_name="fit.json"):
    if not os.path.isdir(out):
        sys.exit(f"summarize.py: no directory {out!r}; run docs/bench.sh first (it writes to results/ by default)")
    if not glob.glob(os.path.join(out, "*.json")):
        sys.exit(f"summarize.py: no bench JSON files in {out!r}")
    sweep_tables(out)
    repeat_table(out)
    auto_sweep_table(out)
    auto_repeat_tables(out)
    kernel_table(out)
    fit_tables(out, fit_name)


if __name__ == "__main__":
    main(*sys.argv[1:])
