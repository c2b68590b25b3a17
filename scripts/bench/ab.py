"""Medians over rounds of B/A and A2/A time per operation (scripts/bench/ab)."""
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare import parse  # noqa: E402  (collective-perf's tables, one parser)


def table(path):
    """{(op, bytes): out-of-place time in us} of one run."""
    tables, warnings = parse(path)
    for w in warnings:
        print(f"ab: {w}", file=sys.stderr)
    return {(op, size): rows[0]["out"]["time"]
            for op, sizes in tables.items() for size, rows in sizes.items()}


out, rounds = sys.argv[1], int(sys.argv[2])
runs = {v: [table(f"{out}/{v}.{r}.txt") for r in range(1, rounds + 1)] for v in ("A", "B", "A2")}
keys = sorted(runs["A"][0])
print(f"{'op':<16}{'bytes':>10}{'A us':>10}{'B/A':>8}{'A2/A':>8}")
for k in keys:
    a = [t[k] for t in runs["A"]]
    ba = [b[k] / x[k] for b, x in zip(runs["B"], runs["A"])]
    aa = [b[k] / x[k] for b, x in zip(runs["A2"], runs["A"])]
    print(f"{k[0]:<16}{k[1]:>10}{statistics.median(a):>10.1f}"
          f"{statistics.median(ba):>8.3f}{statistics.median(aa):>8.3f}")
