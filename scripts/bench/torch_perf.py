#!/usr/bin/env python3
"""One rank of scripts/bench-torch: collectives through torch.distributed, timed, for the
collectived backend and Gloo in the same processes.

Started NRANKS times by scripts/bench-torch with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT and COLLECTIVED_SOCKET set. Rank 0 writes one JSON object a line on stdout:

  {"kind": "init", "backend", "how": "init_process_group"|"new_group", "init_s", "first_s"}
      the default group (backend --default) is made first and timed with its first all-reduce
      (4 bytes); then the other backend's new_group with its first all-reduce. With --sync-dir
      the ranks meet there first (files), so that the time is not the ranks' start skew.
  {"kind": "op", "backend", "slot": "a"|"b"|"control", "op", "bytes", "count", "iters",
   "time_us", "algbw", "busbw", "wrong"}
      per op and size: the two backends in the order --order, then the control backend
      (--control) again: an A/A pair whose ratio shows what noise alone does to a ratio.
      time: each rank times `iters` calls after `warmup` and a barrier of the group measured;
      the slowest rank's mean (nccl-tests' -a 3). Sizes and busbw follow nccl-tests: S is the
      per-rank buffer of all-reduce, broadcast and reduce, the whole gathered/scattered array of
      all-gather, reduce-scatter and all-to-all; busbw = S / time x 2(n-1)/n (all-reduce),
      (n-1)/n (all-gather, reduce-scatter, all-to-all), 1 (broadcast, reduce).
      wrong: elements off in one checked call after timing (0 when right).
  {"kind": "ddp", "backend", "slot", "step_ms" (median), "steps", "params"}

Gloo runs on CPU tensors always; --device cuda puts the collectived backend's tensors on
cuda:(LOCAL_RANK % GPUs) (ranks share GPU 0 on a one-GPU machine) and synchronizes the device
after each timed loop (and each call with --blocking 1).
"""
import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_compare import bus_factor  # noqa: E402  (nccl-tests' factors, one copy)

OPS = ["all-reduce", "all-gather", "reduce-scatter", "broadcast", "reduce", "all-to-all"]
DTYPES = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16, "half": torch.float16,
          "bfloat16": torch.bfloat16, "float64": torch.float64, "double": torch.float64,
          "int32": torch.int32, "int64": torch.int64, "int8": torch.int8, "uint8": torch.uint8}


def sharded(op):
    return op in ("all-gather", "reduce-scatter", "all-to-all")


def parse_size(s):
    s = s.strip()
    mul = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:].upper(), 1)
    return int(float(s[:-1] if mul != 1 else s) * mul)


def sizes(lo, hi, factor):
    """nccl-tests' MINBYTES x FACTOR^k up to MAXBYTES, and MAXBYTES itself when the steps miss it."""
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= factor
    if not out or out[-1] != hi:
        out.append(hi)
    return out


def iters_for(nbytes, iters, budget, min_iters):
    """Fewer iterations for large sizes: about `budget` bytes per timed loop, at least min_iters."""
    return max(min_iters, min(iters, budget // max(nbytes, 1)))


class Bench:
    def __init__(self, a):
        self.a = a
        self.rank = int(os.environ["RANK"])
        self.n = int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", self.rank))
        self.dtype = DTYPES[a.dtype]
        self.esize = torch.empty(0, dtype=self.dtype).element_size()
        if a.device == "cuda":
            self.cdev = torch.device("cuda", local % torch.cuda.device_count())
            torch.cuda.set_device(self.cdev)
        else:
            self.cdev = torch.device("cpu")
        self.groups = {}
        self.devs = {}

    def emit(self, **kw):
        if self.rank == 0:
            print(json.dumps(kw), flush=True)

    def sync(self, backend):
        if self.devs[backend].type == "cuda":
            torch.cuda.synchronize(self.devs[backend])

    def first_allreduce(self, backend):
        t = torch.ones(1, device=self.devs[backend])
        t0 = time.perf_counter()
        dist.all_reduce(t, group=self.groups[backend])
        self.sync(backend)
        return time.perf_counter() - t0

    def setup(self):
        a = self.a
        other = "gloo" if a.default == "collectived" else "collectived"
        for b in (a.default, other):
            self.devs[b] = self.cdev if b == "collectived" else torch.device("cpu")
        if a.sync_dir:  # every rank here first, so that the time is init's, not the ranks' start skew
            open(os.path.join(a.sync_dir, f"rank{self.rank}"), "w").close()
            t_sync = time.time()
            while not all(os.path.exists(os.path.join(a.sync_dir, f"rank{r}")) for r in range(self.n)):
                if time.time() - t_sync > a.timeout:
                    raise RuntimeError(f"not every rank reached {a.sync_dir} in {a.timeout} s")
                time.sleep(0.001)
        t0 = time.perf_counter()
        dist.init_process_group(a.default, timeout=timedelta(seconds=a.timeout))
        init_s = time.perf_counter() - t0
        self.groups[a.default] = dist.group.WORLD
        first_s = self.first_allreduce(a.default)
        t0 = time.perf_counter()
        self.groups[other] = dist.new_group(backend=other, timeout=timedelta(seconds=a.timeout))
        new_s = time.perf_counter() - t0
        new_first_s = self.first_allreduce(other)
        # the slowest rank's times, through Gloo (not timed)
        t = torch.tensor([init_s, first_s, new_s, new_first_s], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.groups["gloo"])
        self.emit(kind="init", backend=a.default, how="init_process_group", init_s=t[0].item(), first_s=t[1].item())
        self.emit(kind="init", backend=other, how="new_group", init_s=t[2].item(), first_s=t[3].item())

    # ---- one op at one size
    def buffers(self, op, nbytes, backend):
        n, dev = self.n, self.devs[backend]
        count = nbytes // self.esize // n if sharded(op) else nbytes // self.esize
        if op == "all-gather":
            return count, torch.empty(count, dtype=self.dtype, device=dev), \
                torch.empty(count * n, dtype=self.dtype, device=dev)
        if op in ("reduce-scatter", "all-to-all"):
            out = torch.empty(count * (1 if op == "reduce-scatter" else n), dtype=self.dtype, device=dev)
            return count, torch.empty(count * n, dtype=self.dtype, device=dev), out
        return count, torch.empty(count, dtype=self.dtype, device=dev), None

    def call(self, op, g, inp, out, async_op):
        if op == "all-reduce":
            return dist.all_reduce(inp, group=g, async_op=async_op)
        if op == "all-gather":
            return dist.all_gather_into_tensor(out, inp, group=g, async_op=async_op)
        if op == "reduce-scatter":
            return dist.reduce_scatter_tensor(out, inp, group=g, async_op=async_op)
        if op == "broadcast":
            return dist.broadcast(inp, 0, group=g, async_op=async_op)
        if op == "reduce":
            return dist.reduce(inp, 0, group=g, async_op=async_op)
        if op == "all-to-all":
            return dist.all_to_all_single(out, inp, group=g, async_op=async_op)
        raise ValueError(op)

    def check(self, op, g, count, inp, out, backend):
        """One call with known data; returns the number of wrong elements on this rank."""
        n, r = self.n, self.rank
        if op == "all-to-all":  # chunk for peer p holds r*n + p
            inp.copy_(torch.arange(n, device=inp.device).repeat_interleave(count).to(self.dtype) + r * n)
        else:
            inp.fill_(r + 1)
        if out is not None:
            out.fill_(-1)
        self.call(op, g, inp, out, False)
        self.sync(backend)
        tot = n * (n + 1) // 2
        if op == "all-reduce":
            want, got = torch.full_like(inp, tot), inp
        elif op == "all-gather":
            want = torch.arange(1, n + 1, device=out.device).repeat_interleave(count).to(self.dtype)
            got = out
        elif op == "reduce-scatter":
            want, got = torch.full_like(out, tot), out
        elif op == "broadcast":
            want, got = torch.full_like(inp, 1), inp
        elif op == "reduce":
            if r != 0:
                return 0
            want, got = torch.full_like(inp, tot), inp
        else:  # all-to-all: from peer p, its chunk for me: p*n + r
            want = (torch.arange(n, device=out.device) * n + r).repeat_interleave(count).to(self.dtype)
            got = out
        return int((got != want).sum().item())

    def measure(self, op, nbytes, backend):
        a = self.a
        g = self.groups[backend]
        count, inp, out = self.buffers(op, nbytes, backend)
        inp.fill_(1)
        iters = iters_for(nbytes, a.iters, a.byte_budget, a.min_iters)
        warmup = max(1, min(a.warmup, iters // 2))
        blocking = a.blocking == 1
        for _ in range(warmup):
            self.call(op, g, inp, out, False)
        self.sync(backend)
        dist.barrier(group=g)
        t0 = time.perf_counter()
        if blocking:
            for _ in range(iters):
                self.call(op, g, inp, out, False)
                if self.devs[backend].type == "cuda":
                    self.sync(backend)
        else:
            works = [self.call(op, g, inp, out, True) for _ in range(iters)]
            for w in works:
                w.wait()
        self.sync(backend)
        dt = (time.perf_counter() - t0) / iters
        wrong = self.check(op, g, count, inp, out, backend) if a.check else 0
        t = torch.tensor([dt, wrong], dtype=torch.float64)
        tmax = torch.tensor([dt], dtype=torch.float64)
        dist.all_reduce(tmax, op=dist.ReduceOp.MAX, group=self.groups["gloo"])
        dist.all_reduce(t, group=self.groups["gloo"])
        time_s = tmax.item()
        if sharded(op):
            nbytes = count * self.n * self.esize
        algbw = nbytes / time_s / 1e9 if time_s > 0 else 0.0
        return dict(count=count, iters=iters, time_us=time_s * 1e6, algbw=algbw,
                    busbw=algbw * bus_factor(op, self.n), wrong=int(t[1].item()))

    def run_ops(self):
        a = self.a
        order = a.order.split(",")
        slots = [(order[0], "a"), (order[1], "b"), (a.control, "control")] if a.control else \
            [(order[0], "a"), (order[1], "b")]
        for op in a.ops.split(","):
            for nbytes in sizes(parse_size(a.minbytes), parse_size(a.maxbytes), a.factor):
                if sharded(op) and nbytes // self.esize // self.n == 0:
                    continue  # a 0-element array: nothing to time
                # the size printed is what moves, as collective-perf prints it: count x ranks x element
                shown = nbytes // self.esize // self.n * self.n * self.esize if sharded(op) else nbytes
                for backend, slot in slots:
                    r = self.measure(op, nbytes, backend)
                    self.emit(kind="op", backend=backend, slot=slot, op=op, bytes=shown, dtype=a.dtype, **r)

    # ---- DDP
    def ddp(self, backend, slot):
        from torch.nn.parallel import DistributedDataParallel as DDP
        a = self.a
        dev = self.devs[backend]
        torch.manual_seed(0)
        h = a.ddp_hidden
        model = torch.nn.Sequential(torch.nn.Linear(256, h), torch.nn.ReLU(), torch.nn.Linear(h, h),
                                    torch.nn.ReLU(), torch.nn.Linear(h, 256)).to(dev)
        ddp = DDP(model, process_group=self.groups[backend],
                  device_ids=[dev.index] if dev.type == "cuda" else None)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        g = torch.Generator().manual_seed(self.rank)
        x = torch.randn(a.ddp_batch, 256, generator=g).to(dev)
        y = torch.randn(a.ddp_batch, 256, generator=g).to(dev)
        times = []
        for step in range(a.ddp_warmup + a.ddp_steps):
            self.sync(backend)
            t0 = time.perf_counter()
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
            self.sync(backend)
            if step >= a.ddp_warmup:
                times.append(time.perf_counter() - t0)
        t = torch.tensor([statistics.median(times)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.groups["gloo"])
        self.emit(kind="ddp", backend=backend, slot=slot, step_ms=t.item() * 1e3, steps=a.ddp_steps,
                  params=sum(p.numel() for p in model.parameters()), batch=a.ddp_batch)

    def run_ddp(self):
        a = self.a
        order = a.order.split(",")
        self.ddp(order[0], "a")
        self.ddp(order[1], "b")
        if a.control:
            self.ddp(a.control, "control")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--default", default="collectived", help="backend of the default group (the other: new_group)")
    p.add_argument("--order", default="collectived,gloo", help="which backend is timed first, per size")
    p.add_argument("--control", default="gloo", help="backend timed a second time per size (A/A); '' for none")
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--minbytes", default="8")
    p.add_argument("--maxbytes", default="64M")
    p.add_argument("--factor", type=int, default=4)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--min-iters", type=int, default=3)
    p.add_argument("--byte-budget", type=int, default=256 << 20, help="about this many bytes per timed loop")
    p.add_argument("--blocking", type=int, default=1, help="1: wait for each call; 0: submit all, then wait")
    p.add_argument("--check", type=int, default=1)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--sync-dir", default="", help="ranks meet here (files) before init_process_group is timed")
    p.add_argument("--ddp-steps", type=int, default=20, help="0: no DDP")
    p.add_argument("--ddp-warmup", type=int, default=3)
    p.add_argument("--ddp-hidden", type=int, default=1024)
    p.add_argument("--ddp-batch", type=int, default=32)
    a = p.parse_args()
    import collectived_torch  # noqa: F401  (registers the backend)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    b = Bench(a)
    b.emit(kind="meta", nranks=b.n, device=a.device, torch=torch.__version__, blocking=a.blocking,
           dtype=a.dtype, default=a.default, order=a.order, control=a.control)
    b.setup()
    if a.ops:
        b.run_ops()
    if a.ddp_steps > 0:
        b.run_ddp()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
