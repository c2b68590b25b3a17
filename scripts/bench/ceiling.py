#!/usr/bin/env python3
"""Against the loopback TCP ceiling (scripts/bench/tcp-ring.c): per collective
and size, ours, MPI and Gloo busbw (medians over the rounds, out-of-place) as a
fraction of what a ring can move over loopback TCP on this machine with no
computation at all, and what the 1.5x Gloo goal would need (>= 1x MPI needs
the mpi column itself). A goal above 1.00 of the ceiling cannot be met by any implementation that
moves the ring's bytes over TCP here.

usage: ceiling.py OURS MPI GLOO TCP_RING   (nccl-tests tables; tcp-ring's output)
"""
import statistics
import sys

sys.path.insert(0, __import__("os").path.dirname(__file__))
import compare  # noqa: E402


def ring_table(path):
    out = {}
    with open(path) as f:
        for line in f:
            p = line.split()
            if len(p) == 4 and not line.startswith("#"):
                out.setdefault(int(p[0]), []).append(float(p[3]))
    return {k: statistics.median(v) for k, v in out.items()}


def med(tables, op, size):
    rows = tables.get(op, {}).get(size)
    if not rows:
        return None
    return statistics.median(r["out"]["busbw"] for r in rows)


def main(argv):
    if len(argv) != 5:
        print(__doc__, file=sys.stderr)
        return 2
    ours, _ = compare.parse(argv[1])
    mpi, _ = compare.parse(argv[2])
    gloo, _ = compare.parse(argv[3])
    ceiling = ring_table(argv[4])
    print("# busbw as a fraction of the loopback TCP ceiling (tcp-ring: a ring streaming the same bytes, no compute)")
    f = lambda v: "-" if v is None else f"{v:.2f}"
    for op in sorted(set(ours) | set(mpi) | set(gloo)):
        print(f"\n## {op}")
        print(f"{'size':>12} {'ceiling':>8} {'ours':>6} {'mpi':>6} {'gloo':>6} {'need(1.5gloo)':>14}")
        for size in sorted(ceiling):
            c = ceiling[size]
            o, m, g = med(ours, op, size), med(mpi, op, size), med(gloo, op, size)
            if o is None and m is None and g is None:
                continue
            # Small sizes print a busbw of 0.00: no fraction there.
            div = lambda v: None if v is None or c <= 0 else v / c
            need_g = None if g is None or c <= 0 else 1.5 * g / c
            print(f"{size:>12} {c:>8.2f} {f(div(o)):>6} {f(div(m)):>6} {f(div(g)):>6} {f(need_g):>14}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
