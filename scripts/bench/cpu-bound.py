#!/usr/bin/env python3
"""How fast any implementation could be on this machine, against Gloo, where
the collectives are bound by the CPU rather than the network: 4 ranks on one
2-core machine, every byte crossing loopback TCP.

Every collective here pays, in kernel time, for the bytes it puts on TCP:
a copy into the socket, a copy out of it, and the TCP stack between. Those
bytes are fixed by the collective (all-gather and broadcast over 4 nodes: 3 x
the size, whether in a ring, pairwise or one-to-all), and no implementation
on TCP avoids them. This script measures:

  c     CPU seconds per byte on TCP, from tcp-ring (4 processes streaming, no
        computation): "hot" reads into one cache-hot piece (a lower bound on
        what a real collective pays per byte), "cold" sends and reads at
        their offsets in buffers of the bytes streamed (tcp-ring -o 1), as a
        collective's input and output are;
  W     Gloo's wall time per operation (its own timing, out of place);
  C     Gloo's CPU time per operation (all processes, all CPUs);
  ours  the same two for collective-perf through 4 daemons (if built).

CPU per operation is measured from /proc/stat as the difference between a
run of N2 and a run of N1 iterations (the set-up of processes and buffers
cancels out; Gloo's and our tools time out-of-place and in-place, so 2
operations per iteration). With P CPUs, no implementation finishes an
operation in less than L = c x bytes_on_tcp / P, so none is faster than
Gloo by more than W / L ("max x gloo", from c hot; "cold": from c cold, what
an implementation that did nothing but move the bytes between buffers of
the collective's size could reach).

usage: cpu-bound.py [--sizes 16M,32M,64M] [--ops all-gather,broadcast]
                    [--rounds 3] [--n1 5] [--n2 45] [--build build]
Run as root to put the system on cubic for the run, as scripts/bench-tcp does
(restored at the end). Only loopback addresses are used.
"""
import argparse
import os
import re
import secrets
import statistics
import subprocess
import sys
import tempfile
import time

MUL = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
CC = "/proc/sys/net/ipv4/tcp_congestion_control"


def nbytes(s):
    return int(float(s[:-1]) * MUL[s[-1]]) if s[-1] in MUL else int(s)


def busy_seconds():
    """CPU time spent not idle, all CPUs, since boot (user..steal, no idle/iowait)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, idle, iowait, irq, softirq, steal = v[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def run(cmd, env=None):
    t0 = busy_seconds()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    t1 = busy_seconds()
    if out.returncode != 0:
        sys.exit(f"cpu-bound: {' '.join(cmd)} failed:\n{out.stdout}\n{out.stderr}")
    return out.stdout, t1 - t0


def nccl_time(text):
    """Out-of-place time (us) of the last data line of an nccl-tests table."""
    t = None
    for line in text.splitlines():
        p = line.split()
        if len(p) >= 6 and not line.startswith("#") and p[0].isdigit():
            t = float(p[5])
    return t


def ring_time(text):
    for line in text.splitlines():
        p = line.split()
        if len(p) == 4 and not line.startswith("#"):
            return float(p[2])
    return None


def per_op(cmd_of, n1, n2, parse, ops_per_iter=1):
    """(wall us per op from the tool at n2, CPU s per op from the difference)."""
    _, c1 = run(cmd_of(n1))
    out, c2 = run(cmd_of(n2))
    return parse(out), (c2 - c1) / (n2 - n1) / ops_per_iter


def start_daemons(build, tmp):
    secret = os.path.join(tmp, "secret")
    with open(secret, "w") as f:
        f.write(secrets.token_hex(32))
    os.chmod(secret, 0o600)
    procs, socks = [], []
    base = 20000 + secrets.randbelow(20000)
    for i in range(4):
        sock = os.path.join(tmp, f"cd{i}.sock")
        procs.append(subprocess.Popen(
            [f"{build}/bin/collectived", "--set", f"client.socket={sock}", "--set", "log.level=warn",
             "--set", f"node.name=node{i}", "--set", f"peer.listen_address=127.0.9.{i + 2}",
             "--set", f"peer.port={base + i}", "--set", f"peer.secret_file={secret}"],
            stderr=subprocess.DEVNULL))
        socks.append(sock)
    for _ in range(100):
        if all(os.path.exists(s) for s in socks):
            break
        time.sleep(0.1)
    return procs, ",".join(socks)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="16M,32M,64M")
    ap.add_argument("--ops", default="all-gather,broadcast")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--n1", type=int, default=5)
    ap.add_argument("--n2", type=int, default=45)
    ap.add_argument("--build", default="build")
    a = ap.parse_args()
    b = a.build
    ring, gloo, perf = f"{b}/bench/tcp-ring", f"{b}/bench/gloo-perf", f"{b}/bin/collective-perf"
    for tool in (ring, gloo):
        if not os.access(tool, os.X_OK):
            sys.exit(f"cpu-bound: {tool} missing: run scripts/bench-tcp once (it builds the anchors)")
    cpus = os.cpu_count()
    old_cc = None
    if os.geteuid() == 0 and os.path.exists(CC):
        old_cc = open(CC).read().strip()
        if old_cc != "cubic":
            open(CC, "w").write("cubic")
    tmp = tempfile.mkdtemp(prefix="cpu-bound.")
    procs, socks = start_daemons(b, tmp) if os.access(perf, os.X_OK) else ([], None)
    rows = {}
    try:
        for r in range(a.rounds):
            for s in a.sizes.split(","):
                size = nbytes(s)
                # tcp-ring: each of 4 processes streams 2 (N-1)/N x size = 1.5 x size.
                cs = []
                for o in ("0", "1"):
                    _, cpu = per_op(lambda n: [ring, "-t", "4", "-b", s, "-e", s, "-n", str(n), "-w", "1", "-o", o],
                                    a.n1, a.n2, ring_time)
                    cs.append(cpu / (4 * 1.5 * size))
                c, c_cold = cs
                for op in a.ops.split(","):
                    common = ["-b", s, "-e", s, "-w", "2", "-d", "float", "--op", op]
                    gw, gc = per_op(lambda n: [gloo, "-t", "4", "-n", str(n)] + common, a.n1, a.n2, nccl_time, 2)
                    ow = oc = None
                    if socks:
                        ow, oc = per_op(lambda n: [perf, "-t", "4", "--daemons", socks, "-c", "0", "-n", str(n)]
                                        + common, a.n1, a.n2, nccl_time, 2)
                    wire = 3 * size  # all-gather or broadcast over 4 nodes: 3 x size on TCP
                    low, low_cold = c * wire / cpus * 1e6, c_cold * wire / cpus * 1e6  # us
                    rows.setdefault((op, size), []).append((c, gw, gc, ow, oc, low, low_cold))
                    print(f"round {r + 1} {op} {s}: floor {low:.0f} us (cold {low_cold:.0f}); gloo {gw:.0f} us, "
                          f"{gc * 1e3:.1f} ms CPU; ours {ow or 0:.0f} us, {(oc or 0) * 1e3:.1f} ms CPU",
                          flush=True)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait()
        if old_cc and old_cc != "cubic":
            open(CC, "w").write(old_cc)
    print(f"\n# {cpus} CPUs; medians of {a.rounds} rounds; CPU per op from runs of {a.n2} and {a.n1} "
          "iterations; floor = TCP CPU of the bytes / CPUs")
    print(f"{'op':>11} {'size':>9} {'ns/B tcp':>8} {'floor us':>9} {'gloo us':>8} {'gloo cpu':>8} "
          f"{'ours us':>8} {'ours cpu':>8} {'max x gloo':>10} {'cold':>5} {'ours x gloo':>11}")
    med = statistics.median
    for (op, size), v in sorted(rows.items()):
        c, gw, gc, low = med(x[0] for x in v), med(x[1] for x in v), med(x[2] for x in v), med(x[5] for x in v)
        ow = med(x[3] for x in v) if v[0][3] else float("nan")
        oc = med(x[4] for x in v) if v[0][4] else float("nan")
        mx = med(x[1] / x[5] for x in v)
        mxc = med(x[1] / x[6] for x in v)
        ox = med(x[1] / x[3] for x in v) if v[0][3] else float("nan")
        print(f"{op:>11} {size:>9} {c * 1e9:>8.3f} {low:>9.0f} {gw:>8.0f} {gc * 1e3:>7.1f}m "
              f"{ow:>8.0f} {oc * 1e3:>7.1f}m {mx:>10.2f} {mxc:>5.2f} {ox:>11.2f}")


if __name__ == "__main__":
    main()
