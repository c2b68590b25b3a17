"""Per-call cost of torch.distributed.all_reduce on a small CPU tensor, split into what the
calling thread burns and how often each thread sleeps: where the time of a blocking call goes
when ranks outnumber cores (issue G's "cost over the C API").

One rank per process; start WORLD_SIZE of them with RANK set (COLLECTIVED_SOCKET for the
collectived backend), or one with --backend fake (torch's own FakeProcessGroup: the floor that
Python and c10d's dispatch cost, with no communication at all):
    for r in 0 1 2 3; do RANK=$r WORLD_SIZE=4 python3 scripts/bench/torch_percall.py & done; wait
    python3 scripts/bench/torch_percall.py --backend fake
Prints per rank: wall time per call, the calling thread's CPU time per call, and voluntary
context switches per call of the busiest threads (* marks the calling thread).
"""
import argparse
import os
import time

import torch
import torch.distributed as dist


def switches():
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            name = open(f"/proc/self/task/{tid}/comm").read().strip()
            for line in open(f"/proc/self/task/{tid}/status"):
                if line.startswith("voluntary_ctxt_switches"):
                    out[(tid, name)] = int(line.split()[1])
        except OSError:
            pass  # a thread that ended
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="collectived")
    p.add_argument("--iters", type=int, default=20000)
    p.add_argument("--warmup", type=int, default=500)
    p.add_argument("--port", type=int, default=29533)
    a = p.parse_args()
    if a.backend == "fake":
        from torch.testing._internal.distributed.fake_pg import FakeStore
        rank, world = 0, 4
        dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    else:
        if a.backend == "collectived":
            import collectived_torch  # noqa: F401  (registers the backend)
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group(a.backend, rank=rank, world_size=world,
                                init_method=f"tcp://127.0.0.1:{a.port}")
    t = torch.ones(2)
    for _ in range(a.warmup):
        dist.all_reduce(t)
    if a.backend != "fake":
        dist.barrier()
    s0, c0, t0 = switches(), time.thread_time(), time.perf_counter()
    for _ in range(a.iters):
        dist.all_reduce(t)
    wall, cpu, s1 = time.perf_counter() - t0, time.thread_time() - c0, switches()
    me = str(os.getpid())
    busiest = sorted(((v - s0.get(k, 0), k) for k, v in s1.items()), reverse=True)[:3]
    print(f"{a.backend} rank {rank}/{world}: {wall / a.iters * 1e6:.1f} us/call, calling thread "
          f"{cpu / a.iters * 1e6:.1f} us CPU/call; voluntary switches/call: " +
          " ".join(f"{name}{'*' if tid == me else ''}={n / a.iters:.2f}" for n, (tid, name) in busiest),
          flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
