#!/usr/bin/env python3
"""Side-by-side bus bandwidth of collective-perf ("ours") and the anchors.

usage: compare.py OURS MPI GLOO [--in-place] [--no-machine]

Each argument is a file holding nccl-tests-format output (any may be missing
or empty; pass "-" for none). A file may hold several tables, one per
collective. A table's collective is named by a "# op: NAME" line before it
(mpi-perf and gloo-perf print one; scripts/bench-host writes one before each
collective-perf run) or, failing that, by the "# Collective test concluded:
all_reduce_perf" line after it (nccl-tests' binary names).

Data lines are the lines not starting with '#' that split into at least 13
fields: size count type redop root  time algbw busbw #wrong  time algbw busbw
#wrong (out-of-place, then in-place). Anything else (warnings, banners) is
ignored.

Prints, per collective and per size: size, ours-busbw, mpi-busbw,
gloo-busbw, ours/mpi, ours/gloo (out-of-place busbw unless --in-place; GB/s,
GB = 1e9 B; ratios to 2 decimals, computed as time_other/time_ours, which is
the busbw ratio at full precision; "-" where missing), and for all-reduce
the 8-byte latency (time column) of each and the ratios. Rows whose #wrong is
not 0 are flagged. Standard library only.

A file may hold the same table several times (scripts/bench-host ROUNDS=N
appends one per round): each size then shows its median round (by time, in
the chosen placement; the lower middle for an even count), and a header line
says how many rounds each source had.
"""
import os
import re
import sys

OPS = ["all-reduce", "all-gather", "reduce-scatter", "broadcast", "reduce", "all-to-all"]
_ALIASES = {
    "allreduce": "all-reduce",
    "allgather": "all-gather",
    "reducescatter": "reduce-scatter",
    "broadcast": "broadcast",
    "bcast": "broadcast",
    "reduce": "reduce",
    "alltoall": "all-to-all",
}
SOURCES = ["ours", "mpi", "gloo"]


def norm_op(name):
    """'all_reduce_perf', 'all-reduce', 'AllReduce', 'alltoall_perf_mpi' -> canonical."""
    key = re.sub(r"[^a-z]", "", name.lower())
    for suffix in ("perfmpi", "perf", "mpi", "gloo"):
        if key.endswith(suffix) and key[: -len(suffix)] in _ALIASES:
            key = key[: -len(suffix)]
            break
    return _ALIASES.get(key)


def parse(path):
    """-> ({op: {size: row}}, [warnings]); row = dict of the parsed columns."""
    tables, warnings = {}, []
    if not path or path == "-" or not os.path.exists(path):
        return tables, warnings
    with open(path, errors="replace") as f:
        lines = f.read().splitlines()
    current = None  # op named by "# op:"
    pending = []  # rows seen with no op named yet
    for line in lines:
        s = line.strip()
        if not s:
            continue
        if s.startswith("#"):
            m = re.match(r"#\s*op:\s*(\S+)", s)
            if m:
                current = norm_op(m.group(1))
                if current is None:
                    warnings.append(f"{path}: unknown op '{m.group(1)}'")
                continue
            m = re.match(r"#\s*Collective test concluded:\s*(\S+)", s)
            if m:
                op = norm_op(m.group(1))
                if pending and op:
                    for row in pending:
                        tables.setdefault(op, {}).setdefault(row["size"], []).append(row)
                pending = []
                current = None  # each table ends here
            continue
        f = s.split()
        if len(f) < 13:
            continue
        try:
            row = {
                "size": int(f[0]),
                "count": int(f[1]),
                "type": f[2],
                "redop": f[3],
                "root": f[4],
                "out": {"time": float(f[5]), "algbw": float(f[6]), "busbw": float(f[7]), "wrong": f[8]},
                "in": {"time": float(f[9]), "algbw": float(f[10]), "busbw": float(f[11]), "wrong": f[12]},
            }
        except ValueError:
            continue
        if current:
            tables.setdefault(current, {}).setdefault(row["size"], []).append(row)
        else:
            pending.append(row)
    if pending:
        warnings.append(f"{path}: {len(pending)} data line(s) with no '# op:' or "
                        "'# Collective test concluded:' line naming the collective; ignored")
    return tables, warnings


def machine():
    model = "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"# machine: nproc {os.cpu_count()}, CPU {model}"


def fmt_bw(v):
    return "-" if v is None else f"{v:.2f}"


def ratio(a, b):
    if a is None or b is None or b == 0:
        return "-"
    return f"{a / b:.2f}"


def bw_ratio(ours, other, place):
    """Bandwidth ratio ours/other for one size. Both rows move the same bytes
    with the same busbw factor, so it is time_other / time_ours: the time
    column keeps the precision that a 2-decimal busbw (0.00 below ~10 KB)
    loses. Falls back to the busbw columns where a time is missing or 0."""
    if ours is None or other is None or ours["size"] == 0:
        return "-"  # a 0-byte row (gather-type ops at 8 B) times an empty call
    to, tx = ours[place]["time"], other[place]["time"]
    if to > 0 and tx > 0:
        return f"{tx / to:.2f}"
    return ratio(ours[place]["busbw"], other[place]["busbw"])


def is_wrong(cell):
    return cell not in ("0", "N/A")


def main(argv):
    args = [a for a in argv[1:] if not a.startswith("--")]
    flags = {a for a in argv[1:] if a.startswith("--")}
    if len(args) != 3 or flags - {"--in-place", "--no-machine"}:
        sys.stderr.write(__doc__)
        return 2
    place = "in" if "--in-place" in flags else "out"
    parsed, warnings, rounds = {}, [], {}
    for name, path in zip(SOURCES, args):
        tables, w = parse(path)
        warnings += w
        if not tables:
            warnings.append(f"{name}: no table in {path if path != '-' else '(none given)'}")
        # Several rounds of one table: the median row per size.
        parsed[name] = {}
        counts = set()
        for op, by_size in tables.items():
            for size, rows in by_size.items():
                rows = sorted(rows, key=lambda r: r[place]["time"])
                parsed[name].setdefault(op, {})[size] = rows[(len(rows) - 1) // 2]
                counts.add(len(rows))
        rounds[name] = counts

    if "--no-machine" not in flags:
        print(machine())
    print(f"# busbw in GB/s (1e9 B/s), {'in' if place == 'in' else 'out-of'}-place; "
          f"ratios are bandwidth ours/other (> 1: ours is faster), from the time columns")
    if any(c and c != {1} for c in rounds.values()):
        print("# rounds (median shown): " + "  ".join(
            f"{src} {'/'.join(str(n) for n in sorted(rounds[src])) or '-'}" for src in SOURCES))
    for w in warnings:
        print(f"# note: {w}")

    any_table = False
    for op in OPS:
        have = {src: parsed[src].get(op, {}) for src in SOURCES}
        sizes = sorted(set().union(*[set(t) for t in have.values()]))
        if not sizes:
            continue
        any_table = True
        print()
        meta = next(iter(next(t for t in have.values() if t).values()))
        print(f"## {op}  ({meta['type']} {meta['redop']})")
        print(f"{'size':>12}  {'ours-busbw':>10}  {'mpi-busbw':>10}  {'gloo-busbw':>10}  "
              f"{'ours/mpi':>8}  {'ours/gloo':>9}")
        for size in sizes:
            vals, rows, flags_row = {}, {}, []
            for src in SOURCES:
                row = rows[src] = have[src].get(size)
                vals[src] = row[place]["busbw"] if row else None
                if row and is_wrong(row[place]["wrong"]):
                    flags_row.append(f"{src} #wrong={row[place]['wrong']}")
            line = (f"{size:>12}  {fmt_bw(vals['ours']):>10}  {fmt_bw(vals['mpi']):>10}  "
                    f"{fmt_bw(vals['gloo']):>10}  {bw_ratio(rows['ours'], rows['mpi'], place):>8}  "
                    f"{bw_ratio(rows['ours'], rows['gloo'], place):>9}")
            if flags_row:
                line += "  WRONG: " + ", ".join(flags_row)
            print(line)
        if op == "all-reduce":
            lat = {}
            for src in SOURCES:
                row = have[src].get(8)
                lat[src] = row[place]["time"] if row else None
            print("# all-reduce 8-byte latency (time column, us): "
                  + "  ".join(f"{src} {('-' if lat[src] is None else f'{lat[src]:.2f}')}" for src in SOURCES)
                  + f"  ours/mpi {ratio(lat['ours'], lat['mpi'])}"
                  + f"  ours/gloo {ratio(lat['ours'], lat['gloo'])}"
                  + "  (ratios > 1 mean ours is slower)")
    if not any_table:
        print("# no data to compare")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
