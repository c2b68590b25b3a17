#!/usr/bin/env python3
"""Tables of scripts/bench-torch: the collectived backend and Gloo through torch, and the same
sizes through collective-perf (the C API), per op and size, medians over paired rounds.

usage: torch_compare.py RESULTS_DIR

Reads RESULTS_DIR/torch-rK.jsonl (scripts/bench/torch_perf.py's records of round K) and
RESULTS_DIR/torch-capi-rK.txt (collective-perf's nccl-tests tables of round K, "# op: NAME"
before each). Prints per op and size (medians over rounds; ratios are the median over rounds of
each round's ratio, both sides of which ran back to back):

  coll, gloo, capi   busbw (GB/s) through torch with the collectived backend, with Gloo, and
                     through collective-perf against the same daemon
  coll/gloo          bandwidth ratio (> 1: collectived faster), [first-last quartile]
  A/A                the control: the same backend timed twice per size (torch_perf --control);
                     how far from 1.00 noise alone moves a ratio on this machine
  coll-us capi-us    time per call (us)
  +us                the backend's own cost over the C API: coll-us - capi-us (per round, median)
  coll/capi          torch-path bandwidth as a fraction of the C API's
and DDP step times, and init_process_group / new_group with the first all-reduce.
Standard library only (compare.py's parser for the collective-perf tables).
"""
import glob
import json
import os
import re
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare import machine, parse  # noqa: E402

OPS = ["all-reduce", "all-gather", "reduce-scatter", "broadcast", "reduce", "all-to-all"]
# torch's all_reduce, broadcast and reduce work in place; the others out of place.
PLACE = {"all-reduce": "in", "broadcast": "in", "reduce": "in"}


def bus_factor(op, n):
    """nccl-tests' doc/PERFORMANCE.md."""
    if op == "all-reduce":
        return 2.0 * (n - 1) / n
    if op in ("all-gather", "reduce-scatter", "all-to-all"):
        return (n - 1) / n
    return 1.0


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def quartiles(xs):
    xs = sorted(x for x in xs if x is not None)
    if len(xs) < 4:
        return None
    q = statistics.quantiles(xs, n=4)
    return q[0], q[2]


def f(v, fmt="{:.2f}"):
    return "-" if v is None else fmt.format(v)


def size_str(n):
    for unit, div in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return str(n)


def load(results):
    rounds = {}
    for path in glob.glob(os.path.join(results, "torch-r*.jsonl")):
        m = re.search(r"torch-r(\d+)\.jsonl$", path)
        if not m:
            continue
        recs = []
        with open(path) as fh:
            for line in fh:
                line = line.strip()
                if line.startswith("{"):
                    try:
                        recs.append(json.loads(line))
                    except ValueError:
                        pass
        rounds[int(m.group(1))] = {"torch": recs}
    for path in glob.glob(os.path.join(results, "torch-capi-r*.txt")):
        m = re.search(r"torch-capi-r(\d+)\.txt$", path)
        if m:
            tables, _ = parse(path)
            rounds.setdefault(int(m.group(1)), {"torch": []})["capi"] = tables
    return rounds


def main(argv):
    if len(argv) != 2:
        sys.stderr.write(__doc__)
        return 2
    rounds = load(argv[1])
    if not rounds:
        print(f"# no torch-r*.jsonl in {argv[1]}")
        return 1
    # per (op, size): lists over rounds
    cell = {}
    meta = {}
    control = None
    for k, rd in sorted(rounds.items()):
        by = {}
        for r in rd["torch"]:
            if r["kind"] == "op":
                by[(r["op"], r["bytes"], r["slot"])] = r
                meta.setdefault("dtype", r.get("dtype"))
                if r["slot"] == "control":
                    control = r["backend"]
        for (op, size, slot), r in by.items():
            c = cell.setdefault((op, size), {"coll": [], "gloo": [], "ctl": [], "ctl_main": [], "capi": [],
                                             "count": r["count"], "wrong": 0, "iters": r["iters"]})
            c["wrong"] += r["wrong"]
            if slot == "control":
                c["ctl"].append(r["time_us"])
                continue
            c["coll" if r["backend"] == "collectived" else "gloo"].append(r["time_us"])
            if r["backend"] == control:
                c["ctl_main"].append(r["time_us"])
        for (op, size), c in cell.items():
            row = rd.get("capi", {}).get(op, {}).get(size)
            if row:
                row = row[0]
                c["capi"].append(row[PLACE.get(op, "out")]["time"])
                if row[PLACE.get(op, "out")]["wrong"] not in ("0", "N/A"):
                    c["wrong"] += 1
            # keep the lists aligned per round
            n = max(len(c["coll"]), len(c["gloo"]))
            for key in ("coll", "gloo", "ctl", "ctl_main", "capi"):
                while len(c[key]) < n:
                    c[key].append(None)
    first = next((r for rd in rounds.values() for r in rd["torch"] if r["kind"] == "meta"), {})
    nranks = first.get("nranks", 1)

    print(machine())
    print(f"# bench-torch: {first.get('nranks', '?')} ranks, {first.get('device', '?')} tensors (Gloo: cpu), "
          f"{meta.get('dtype', '?')} sum, torch {first.get('torch', '?')}, "
          f"{'blocking calls' if first.get('blocking', 1) else 'calls submitted, then waited'}; "
          f"{len(rounds)} round(s)")
    print("# busbw GB/s (1e9 B/s, nccl-tests' factors), medians over rounds; ratios: median over rounds of the "
          "round's ratio [quartiles]")
    print(f"# A/A: {control or '(none)'} timed twice per size; its ratio is what noise alone does. "
          "+us: the backend's cost per call over collective-perf (C API, same daemon)")

    for op in OPS:
        sizes_ = sorted(s for (o, s) in cell if o == op)
        if not sizes_:
            continue
        print()
        print(f"## {op}")
        print(f"{'size':>8} {'count':>9} {'coll':>7} {'gloo':>7} {'capi':>7}  {'coll/gloo':>17} {'A/A':>5}  "
              f"{'coll-us':>9} {'gloo-us':>9} {'capi-us':>9} {'+us':>8} {'coll/capi':>9}")
        for size in sizes_:
            c = cell[(op, size)]
            n_ = len(c["coll"])
            bus = {}
            for key in ("coll", "gloo", "capi"):
                t = med(c[key])
                bus[key] = None if not t else size / (t * 1e-6) / 1e9 * bus_factor(op, nranks)
            ratios = [g / co for co, g in zip(c["coll"], c["gloo"]) if co and g]
            aa = [m / x for m, x in zip(c["ctl_main"], c["ctl"]) if m and x]
            over = [co - ca for co, ca in zip(c["coll"], c["capi"]) if co and ca]
            frac = [ca / co for co, ca in zip(c["coll"], c["capi"]) if co and ca]
            q = quartiles(ratios)
            rq = f"{f(med(ratios))} [{q[0]:.2f}-{q[1]:.2f}]" if q else f(med(ratios))
            flag = "  WRONG" if c["wrong"] else ""
            print(f"{size_str(size):>8} {c['count']:>9} {f(bus['coll']):>7} {f(bus['gloo']):>7} {f(bus['capi']):>7}  "
                  f"{rq:>17} {f(med(aa)):>5}  {f(med(c['coll']), '{:.1f}'):>9} {f(med(c['gloo']), '{:.1f}'):>9} "
                  f"{f(med(c['capi']), '{:.1f}'):>9} {f(med(over), '{:.1f}'):>8} {f(med(frac)):>9}{flag}"
                  + ("" if n_ == len(rounds) else f"  ({n_} rounds)"))

    ddp = {}
    for k, rd in sorted(rounds.items()):
        for r in rd["torch"]:
            if r["kind"] == "ddp":
                ddp.setdefault(k, {})[r["slot"]] = r
    if ddp:
        print()
        d0 = next(iter(next(iter(ddp.values())).values()))
        print(f"## DDP step ({d0['params']} parameters, batch {d0['batch']}, median of {d0['steps']} steps, "
              "slowest rank; medians over rounds)")
        coll = [next((r["step_ms"] for r in v.values() if r["backend"] == "collectived" and r["slot"] != "control"),
                     None) for v in ddp.values()]
        gloo = [next((r["step_ms"] for r in v.values() if r["backend"] == "gloo" and r["slot"] != "control"), None)
                for v in ddp.values()]
        ctl = [(next((r["step_ms"] for r in v.values() if r["backend"] == control and r["slot"] != "control"), None),
                v.get("control", {}).get("step_ms")) for v in ddp.values()]
        ratios = [g / c for c, g in zip(coll, gloo) if c and g]
        aa = [m / x for m, x in ctl if m and x]
        print(f"{'coll-ms':>9} {'gloo-ms':>9} {'gloo/coll':>9} {'A/A':>5}")
        print(f"{f(med(coll)):>9} {f(med(gloo)):>9} {f(med(ratios)):>9} {f(med(aa)):>5}")

    inits = [r for rd in rounds.values() for r in rd["torch"] if r["kind"] == "init"]
    if inits:
        print()
        print("## init (slowest rank, seconds; medians over the rounds that made each)")
        print(f"{'backend':>12} {'how':>19} {'rounds':>6} {'init-s':>8} {'first-op-s':>10}")
        for b in ("collectived", "gloo"):
            for how in ("init_process_group", "new_group"):
                xs = [r for r in inits if r["backend"] == b and r["how"] == how]
                if xs:
                    print(f"{b:>12} {how:>19} {len(xs):>6} {f(med(r['init_s'] for r in xs), '{:.3f}'):>8} "
                          f"{f(med(r['first_s'] for r in xs), '{:.4f}'):>10}")
    for k, rd in sorted(rounds.items()):
        for r in rd["torch"]:
            if r["kind"] == "warning":
                print(f"# WARNING, round {k}: {r['what']}")
    bad = [(o, s) for (o, s), c in cell.items() if c["wrong"]]
    if bad:
        print()
        print("# WRONG results (a checked call after timing, or collective-perf's #wrong): "
              + ", ".join(f"{o} {size_str(s)}" for o, s in sorted(bad)))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
