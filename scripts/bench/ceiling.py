#!/usr/bin/env python3
"""Against the loopback TCP ceiling (scripts/bench/tcp-ring.c): per collective
and size, ours, MPI and Gloo busbw (medians over the rounds, out-of-place) as a
fraction of what a ring can move over loopback TCP on this machine with no
computation at all, and what the 1.5x Gloo goal would need (>= 1x MPI needs
the mpi column itself).

With TCP_RING_COLD (tcp-ring -o 1: sends and reads at their offsets in
buffers of the bytes streamed, as a collective's input and output are), the
fractions are of that ceiling, and "bound" is the most any implementation
moving the collective's bytes over TCP can reach on a machine whose CPUs
are the limit (4 processes on 2 cores): 1 for all-reduce, all-gather and
reduce-scatter (the ring's bytes), N/(N-1) for broadcast and reduce (N-1
transfers of the size in all, where the ring moves N streams). A need above
the bound cannot be met here by any implementation; those cells end in "!".

With --lean LEAN (scripts/bench/tcp-lean.c's tables: the same collectives
done by a lean implementation, no daemon, every step pipelined over the same
loopback ring), a second table per collective: ours, lean and Gloo busbw,
ours/lean, lean/gloo, and whether lean itself reaches 1.5x Gloo ("no": that
cell of the goal is beyond what a lean implementation of the algorithm
reaches on this machine, measured in the same run).

usage: ceiling.py OURS MPI GLOO TCP_RING [TCP_RING_COLD] [--lean LEAN]
       (nccl-tests tables; tcp-ring's output)
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


def bound(op, nranks):
    return nranks / (nranks - 1) if op in ("broadcast", "reduce") else 1.0


def lean_table(ours, gloo, lean_path):
    lean, _ = compare.parse(lean_path)
    f = lambda v: "-" if v is None else f"{v:.2f}"
    r = lambda a, b: None if a is None or b is None or b <= 0 else a / b
    print("\n# against tcp-lean (the same collectives, lean: no daemon, no client, ring/chain pipelined in"
          " pieces, out of place), medians over the rounds; 'lean >= 1.5 gloo': whether lean itself meets the goal")
    for op in sorted(set(ours) & set(lean)):
        print(f"\n## {op}")
        print(f"{'size':>12} {'ours':>6} {'lean':>6} {'gloo':>6} {'ours/lean':>10} {'lean/gloo':>10} "
              f"{'ours/gloo':>10} {'lean >= 1.5 gloo':>17}")
        for size in sorted(lean[op]):
            o, l, g = med(ours, op, size), med(lean, op, size), med(gloo, op, size)
            lg = r(l, g)
            meets = "-" if lg is None else ("yes" if lg >= 1.5 else "no")
            print(f"{size:>12} {f(o):>6} {f(l):>6} {f(g):>6} {f(r(o, l)):>10} {f(lg):>10} {f(r(o, g)):>10} "
                  f"{meets:>17}")


def main(argv):
    lean_path = None
    if "--lean" in argv:
        k = argv.index("--lean")
        if k + 1 >= len(argv):
            print(__doc__, file=sys.stderr)
            return 2
        lean_path = argv[k + 1]
        argv = argv[:k] + argv[k + 2:]
    if len(argv) not in (5, 6):
        print(__doc__, file=sys.stderr)
        return 2
    ours, _ = compare.parse(argv[1])
    mpi, _ = compare.parse(argv[2])
    gloo, _ = compare.parse(argv[3])
    hot = ring_table(argv[4])
    cold = ring_table(argv[5]) if len(argv) == 6 else None
    nranks = 4
    with open(argv[4]) as fh:
        for line in fh:
            if line.startswith("# tcp-ring:"):
                nranks = int(line.split()[2])
                break
    if cold:
        print("# busbw as a fraction of the loopback TCP ceiling with buffers of the bytes streamed (tcp-ring -o 1);"
              " 'hot': the same ring reading into one cache-hot piece; ! = the need is above the bound")
    else:
        print("# busbw as a fraction of the loopback TCP ceiling (tcp-ring: a ring streaming the same bytes, no compute)")
    f = lambda v: "-" if v is None else f"{v:.2f}"
    ceiling = cold or hot
    for op in sorted(set(ours) | set(mpi) | set(gloo)):
        print(f"\n## {op}")
        if cold:
            print(f"{'size':>12} {'hot':>6} {'ceiling':>8} {'ours':>6} {'mpi':>6} {'gloo':>6} {'need(1.5gloo)':>14} "
                  f"{'bound':>6}")
        else:
            print(f"{'size':>12} {'ceiling':>8} {'ours':>6} {'mpi':>6} {'gloo':>6} {'need(1.5gloo)':>14}")
        for size in sorted(ceiling):
            c = ceiling[size]
            o, m, g = med(ours, op, size), med(mpi, op, size), med(gloo, op, size)
            if o is None and m is None and g is None:
                continue
            # Small sizes print a busbw of 0.00: no fraction there.
            div = lambda v: None if v is None or c <= 0 else v / c
            need_g = None if g is None or c <= 0 else 1.5 * g / c
            if cold:
                b = bound(op, nranks)
                mark = "!" if need_g is not None and need_g > b else " "
                print(f"{size:>12} {hot.get(size, 0):>6.2f} {c:>8.2f} {f(div(o)):>6} {f(div(m)):>6} {f(div(g)):>6} "
                      f"{f(need_g):>13}{mark} {b:>6.2f}")
            else:
                print(f"{size:>12} {c:>8.2f} {f(div(o)):>6} {f(div(m)):>6} {f(div(g)):>6} {f(need_g):>14}")
    if lean_path:
        lean_table(ours, gloo, lean_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
