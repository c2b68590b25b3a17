#!/usr/bin/env python3
"""One rank of a tests/torch scenario: `python worker.py SCENARIO [ARGS...]`.

Started by conftest.py (or by torchrun) with RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT set, and:
  TT_OUT           directory for this rank's records (rankR.jsonl, one JSON object a line)
  TT_BACKEND       backend under test (collectived; "gloo" runs the harness with Gloo standing in)
  TT_DEVICE        cpu (default) or cuda: tensors under test live there (references stay on CPU)
  TT_HARD_TIMEOUT  seconds after which faulthandler dumps every thread and exits (no hang)
  COLLECTIVED_SOCKET  the daemon's socket

Records: {"kind": "fail", "what": ..., "detail": ...} for each failed check
(checks go on after a failure), {"kind": "note", ...}, {"kind": "ready", ...}
for the harness of the failure scenarios, and {"kind": "done", "checks": N}
last. Every rank runs the same sequence of collectives; references come from
a Gloo group (new_group(backend="gloo")) in the same run.
"""
import faulthandler
import json
import os
import re
import sys
import time
import traceback
import zlib
from datetime import timedelta

SCENARIO = sys.argv[1] if len(sys.argv) > 1 else "ops"
faulthandler.dump_traceback_later(float(os.environ.get("TT_HARD_TIMEOUT", "240")), exit=True)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

BACKEND = os.environ.get("TT_BACKEND", "collectived")
if BACKEND == "collectived":
    import collectived_torch  # noqa: F401,E402  (registers the backend)

DEVICE = torch.device(os.environ.get("TT_DEVICE", "cpu"))
OUT = os.environ["TT_OUT"]
RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
LOCAL_RANK = int(os.environ.get("LOCAL_RANK", RANK))
if DEVICE.type == "cuda":
    # Ranks may share GPU 0 (the MPS runs); one device per rank where there are enough.
    DEVICE = torch.device("cuda", LOCAL_RANK % torch.cuda.device_count())
    torch.cuda.set_device(DEVICE)
torch.set_num_threads(1)

R = dist.ReduceOp
FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int8, torch.uint8, torch.int32, torch.int64]
DTYPES = FLOATS + INTS
COMPLEX = [torch.complex64, torch.complex128]
MOVE_DTYPES = DTYPES + [torch.bool] + COMPLEX  # data movement: every dtype that maps
REDS = ["sum", "avg", "product", "min", "max", "premul_scalar", "premul_tensor"]
PREMUL_SCALAR = 0.375  # exact in every float type, and not 1/n for any n here
PREMUL_TENSOR = 1.25
COUNTS = [0, 1, 7, 1001]


# ---------------------------------------------------------------- reporting
class Report:
    def __init__(self):
        os.makedirs(OUT, exist_ok=True)
        self.f = open(os.path.join(OUT, f"rank{RANK}.jsonl"), "a", buffering=1)
        self.checks = 0
        self.failures = 0
        self.t0 = time.time()

    def rec(self, kind, **kw):
        kw.update(kind=kind, rank=RANK, t=time.time())
        self.f.write(json.dumps(kw, default=str) + "\n")

    def fail(self, what, detail):
        self.failures += 1
        self.rec("fail", what=what, detail=str(detail)[:2000])

    def note(self, what, detail=""):
        self.rec("note", what=what, detail=str(detail)[:2000])

    def ok(self, cond, what, detail=""):
        self.checks += 1
        if not cond:
            self.fail(what, detail)
        return bool(cond)

    def case(self, what, fn, *a, **kw):
        """Runs one case; an exception is a failure of that case, and the run goes on."""
        try:
            fn(*a, **kw)
        except Exception as e:  # noqa: BLE001
            self.checks += 1
            self.fail(what, f"raised {type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}")

    def done(self, **kw):
        self.rec("done", checks=self.checks, failures=self.failures, elapsed=time.time() - self.t0, **kw)


REP = Report()


def dname(dtype):
    return str(dtype).replace("torch.", "")


# ---------------------------------------------------------------- data
def gen(key, rank, count, dtype, red=None, shape=None):
    """Deterministic input of `rank` for case `key` (any rank can make any rank's)."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{key}/{rank}".encode()))
    shape = tuple(shape) if shape is not None else (count,)
    if dtype.is_complex:
        base = torch.float32 if dtype == torch.complex64 else torch.float64
        return torch.view_as_complex((torch.rand(*shape, 2, generator=g, dtype=torch.float64) * 2 - 1).to(base))
    if dtype.is_floating_point:
        x = torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1
        if red == "product":  # |x| in [0.5, 1.5]: no underflow in fp16 on 4 ranks
            x = torch.where(x < 0, -0.5 + x, 0.5 + x)
        return x.to(dtype)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) < 0.5
    if red == "product":
        lo, hi = {torch.int8: (-3, 3), torch.uint8: (0, 3)}.get(dtype, (-5, 5))
    else:  # sums of 4 ranks stay in range; int64 beyond 2**53 (no trip through double)
        lo, hi = {torch.int8: (-30, 30), torch.uint8: (0, 60), torch.int32: (-10**8, 10**8),
                  torch.int64: (-2**59, 2**59)}[dtype]
    return torch.randint(lo, hi + 1, shape, generator=g, dtype=torch.int64).to(dtype)


def settle():
    """CUDA work: wait() only orders the current stream; wait for the device before timing or
    polling what the CPU sees. Nothing on CPU."""
    if DEVICE.type == "cuda":
        torch.cuda.current_stream().synchronize()


def dev(x):
    """A copy on the device under test (never the CPU input itself: inputs stay pristine)."""
    return x.to(DEVICE, copy=True)


def torch_op(red, dtype):
    if red == "premul_scalar":
        return dist._make_nccl_premul_sum(PREMUL_SCALAR)
    if red == "premul_tensor":
        return dist._make_nccl_premul_sum(torch.tensor([PREMUL_TENSOR], dtype=dtype, device=DEVICE))
    return getattr(R, red.upper())


# TT_BACKEND=nccl (torch's own ProcessGroupNCCL over collectived's libnccl.so.2): torch hands
# NCCL a float factor for a bfloat16 PREMUL_SUM (ProcessGroupNCCL's unpackPreMulSum<float,
# ncclBfloat16>), whose first 2 bytes NCCL reads as the bfloat16 scalar (NVIDIA's NCCL and ours
# alike), and refuses a tensor factor of bfloat16: torch's behaviour, not the library's.
NCCL_BF16_PREMUL = BACKEND == "nccl"


def reds_for(dtype):
    if dtype in FLOATS:
        if NCCL_BF16_PREMUL and dtype == torch.bfloat16:
            return REDS[:5]
        return REDS
    if dtype in INTS:
        return REDS[:5]
    if dtype.is_complex:
        return ["sum", "avg"]
    return ["min", "max"]  # bool


def tol(dtype, red=None):
    k = 4 if red and red.startswith("premul") else 2
    return {torch.float32: 1e-5, torch.float64: 1e-12, torch.complex64: 1e-5, torch.complex128: 1e-12,
            torch.float16: k * torch.finfo(torch.float16).eps,
            torch.bfloat16: k * torch.finfo(torch.bfloat16).eps}[dtype]


def ref_reduce(x, red, dtype, group, gloo):
    """The reduction of every member's x (CPU) through Gloo: float64 for floats (rounded by the
    comparison), int64 for integers, bool for bool. AVG and PREMUL_SUM, which Gloo lacks for some
    types, are Gloo SUM then the division / the factor (integers: C's truncating division, as our
    C API says)."""
    n = dist.get_world_size(group)
    if dtype.is_complex:
        y = torch.view_as_real(x).to(torch.float64, copy=True)
        dist.all_reduce(y, R.SUM, group=gloo)
        if red == "avg":
            y /= n
        return torch.view_as_complex(y)
    if dtype.is_floating_point:
        y = x.to(torch.float64, copy=True)
        if red == "premul_scalar":
            y = y * PREMUL_SCALAR
        elif red == "premul_tensor":
            y = y * PREMUL_TENSOR
        op = {"sum": R.SUM, "avg": R.SUM, "product": R.PRODUCT, "min": R.MIN, "max": R.MAX}.get(red, R.SUM)
        dist.all_reduce(y, op, group=gloo)
        if red == "avg":
            y /= n
        return y
    if dtype == torch.bool:
        y = x.clone()
        dist.all_reduce(y, R.MIN if red == "min" else R.MAX, group=gloo)
        return y
    if red == "avg":
        y = x.to(torch.int64, copy=True)
        dist.all_reduce(y, R.SUM, group=gloo)
        return torch.div(y, n, rounding_mode="trunc")
    y = x.clone()  # the type's own arithmetic, as ours
    dist.all_reduce(y, getattr(R, red.upper()), group=gloo)
    return y.long()


def close(what, got, want, dtype, red=None):
    """got: the tensor under test (any device); want: from ref_reduce or exact data."""
    got = got.detach().cpu()
    if got.dtype != dtype:
        return REP.ok(False, what, f"dtype {got.dtype}, want {dtype}")
    if tuple(got.shape) != tuple(want.shape):
        return REP.ok(False, what, f"shape {tuple(got.shape)}, want {tuple(want.shape)}")
    if got.numel() == 0:
        return REP.ok(True, what)
    if dtype.is_complex or dtype.is_floating_point:
        g = torch.view_as_real(got).double() if dtype.is_complex else got.double()
        w = torch.view_as_real(want).double() if want.is_complex() else want.double()
        t = tol(dtype, red)
        ok = torch.allclose(g, w, rtol=t, atol=t)
        if not ok:
            err = (g - w).abs()
            i = int(err.reshape(-1).argmax())
            return REP.ok(False, what, f"max |err| {err.max().item():.3g} at flat {i}: got "
                          f"{g.reshape(-1)[i].item()!r}, want {w.reshape(-1)[i].item()!r} (tol {t:.2g}); "
                          f"{int((~torch.isclose(g, w, rtol=t, atol=t)).sum())} of {g.numel()} off")
        return REP.ok(True, what)
    w = want.to(got.dtype) if dtype == torch.bool else want.long()
    g = got if dtype == torch.bool else got.long()
    if not torch.equal(g, w):
        bad = (g != w).reshape(-1).nonzero()
        i = int(bad[0])
        return REP.ok(False, what, f"{bad.numel()} of {g.numel()} differ; first at flat {i}: got "
                      f"{g.reshape(-1)[i].item()!r}, want {w.reshape(-1)[i].item()!r}")
    return REP.ok(True, what)


def same(what, got, want):
    """Exact equality (data movement)."""
    got = got.detach().cpu()
    want = want.detach().cpu()
    if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
        return REP.ok(False, what, f"got {got.dtype}{tuple(got.shape)}, want {want.dtype}{tuple(want.shape)}")
    if got.numel() == 0 or torch.equal(got, want):
        return REP.ok(True, what)
    a = got.reshape(-1)
    b = want.reshape(-1)
    if a.is_complex():
        a, b = torch.view_as_real(a).reshape(-1), torch.view_as_real(b).reshape(-1)
    bad = (a != b).nonzero()
    i = int(bad[0]) if bad.numel() else -1
    return REP.ok(False, what, f"{bad.numel()} of {a.numel()} elements differ; first at {i}: "
                  f"got {a[i].item()!r}, want {b[i].item()!r}")


def init_default(timeout=60, **kw):
    t0 = time.time()
    dist.init_process_group(BACKEND, timeout=timedelta(seconds=timeout), **kw)
    return time.time() - t0


# ---------------------------------------------------------------- reductions
def allreduce_case(gloo, dtype, red, count, variant="plain", group=None):
    what = f"all_reduce {dname(dtype)} {red} count={count} {variant}"
    x = gen(what, RANK, count, dtype, red)
    want = ref_reduce(x, red, dtype, group, gloo)
    op = torch_op(red, dtype)
    if variant == "view":  # a slice at an offset of a larger tensor: the neighbours stay as they are
        big = torch.zeros(count + 6, dtype=dtype) if dtype != torch.bool else torch.ones(count + 6, dtype=dtype)
        big[3:3 + count] = x
        big_before = big.clone()
        big = dev(big)
        t = big[3:3 + count]
    else:
        t = dev(x)
    if variant == "async":
        w = dist.all_reduce(t, op=op, group=group, async_op=True)
        REP.ok(w.wait(timeout=timedelta(seconds=60)) is not False, what + ": wait() returned False")
        settle()
        REP.ok(w.is_completed(), what + ": is_completed() False after wait()")
    else:
        dist.all_reduce(t, op=op, group=group)
    close(what, t, want, dtype, red)
    if variant == "view":
        same(what + " (neighbours untouched)", torch.cat([big[:3], big[3 + count:]]),
             torch.cat([big_before[:3], big_before[3 + count:]]))


def allreduce_coalesced_case(gloo, dtype, red, how):
    what = f"all_reduce coalesced ({how}) {dname(dtype)} {red}"
    counts = [5, 0, 17, 1]
    xs = [gen(what + f"/{i}", RANK, c, dtype, red) for i, c in enumerate(counts)]
    wants = [ref_reduce(x, red, dtype, None, gloo) for x in xs]
    ts = [dev(x) for x in xs]
    op = torch_op(red, dtype)
    if how == "all_reduce_coalesced":
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dist.all_reduce_coalesced(ts, op=op)
    else:
        with dist._coalescing_manager(async_ops=True) as cm:
            for t in ts:
                dist.all_reduce(t, op=op)
        cm.wait()
    for i, (t, w) in enumerate(zip(ts, wants)):
        close(f"{what} tensor {i}", t, w, dtype, red)


def reduce_case(gloo, dtype, red, count, dst):
    what = f"reduce {dname(dtype)} {red} count={count} dst={dst}"
    x = gen(what, RANK, count, dtype, red)
    want = ref_reduce(x, red, dtype, None, gloo)
    t = dev(x)
    dist.reduce(t, dst, op=torch_op(red, dtype))
    if RANK == dst:
        close(what, t, want, dtype, red)


def reduce_scatter_case(gloo, dtype, red, count, variant):
    what = f"reduce_scatter {variant} {dname(dtype)} {red} count={count}"
    x = gen(what, RANK, count * WORLD, dtype, red)
    want = ref_reduce(x, red, dtype, None, gloo)[RANK * count:(RANK + 1) * count]
    op = torch_op(red, dtype)
    xin = dev(x)
    if variant == "tensor":
        out = torch.empty(count, dtype=dtype, device=DEVICE)
        dist.reduce_scatter_tensor(out, xin, op=op)
        same(what + " (input untouched)", xin, x)
    elif variant == "tensor-2d":  # input (world, count), as FSDP's flat shards
        out = torch.empty(count, dtype=dtype, device=DEVICE)
        dist.reduce_scatter_tensor(out, xin.view(WORLD, count), op=op)
    elif variant == "in-place":
        out = xin.narrow(0, RANK * count, count)
        dist.reduce_scatter_tensor(out, xin, op=op)
    elif variant == "list":
        out = torch.empty(count, dtype=dtype, device=DEVICE)
        dist.reduce_scatter(out, list(xin.split(count)) if count else
                            [torch.empty(0, dtype=dtype, device=DEVICE) for _ in range(WORLD)], op=op)
        same(what + " (inputs untouched)", xin, x)
    else:
        raise ValueError(variant)
    close(what, out, want, dtype, red)


def reduce_scatter_coalesced_case(gloo, dtype, red):
    what = f"reduce_scatter_tensor coalesced {dname(dtype)} {red}"
    counts = [3, 0, 11]
    xs = [gen(what + f"/{i}", RANK, c * WORLD, dtype, red) for i, c in enumerate(counts)]
    wants = [ref_reduce(x, red, dtype, None, gloo)[RANK * c:(RANK + 1) * c] for x, c in zip(xs, counts)]
    outs = [torch.empty(c, dtype=dtype, device=DEVICE) for c in counts]
    op = torch_op(red, dtype)
    ins = [dev(x) for x in xs]
    with dist._coalescing_manager(async_ops=True) as cm:
        for o, i in zip(outs, ins):
            dist.reduce_scatter_tensor(o, i, op=op)
    cm.wait()
    for k, (o, w) in enumerate(zip(outs, wants)):
        close(f"{what} tensor {k}", o, w, dtype, red)


# ---------------------------------------------------------------- data movement
def broadcast_case(gloo, dtype, count, src):
    what = f"broadcast {dname(dtype)} count={count} src={src}"
    x = gen(what, RANK, count, dtype)
    want = x.clone()
    dist.broadcast(want, src, group=gloo)
    t = dev(x)
    dist.broadcast(t, src)
    same(what, t, want)


def allgather_case(gloo, dtype, count, variant):
    what = f"all_gather {variant} {dname(dtype)} count={count}"
    x = gen(what, RANK, count, dtype)
    want = torch.empty(WORLD * count, dtype=dtype)
    dist.all_gather_into_tensor(want, x.clone(), group=gloo)
    xin = dev(x)
    if variant == "list":
        outs = [torch.empty(count, dtype=dtype, device=DEVICE) for _ in range(WORLD)]
        dist.all_gather(outs, xin)
        got = torch.cat([o.cpu() for o in outs])
        same(what + " (input untouched)", xin, x)
    elif variant == "tensor":
        got = torch.empty(WORLD * count, dtype=dtype, device=DEVICE)
        dist.all_gather_into_tensor(got, xin)
        same(what + " (input untouched)", xin, x)
    elif variant == "tensor-2d":  # output (world, count)
        out = torch.empty(WORLD, count, dtype=dtype, device=DEVICE)
        dist.all_gather_into_tensor(out, xin)
        got = out.reshape(-1)
    elif variant == "in-place":
        got = torch.empty(WORLD * count, dtype=dtype, device=DEVICE)
        got[RANK * count:(RANK + 1) * count] = xin
        dist.all_gather_into_tensor(got, got.narrow(0, RANK * count, count))
    else:
        raise ValueError(variant)
    same(what, got, want)


def allgather_coalesced_case(gloo, dtype):
    what = f"all_gather_into_tensor coalesced {dname(dtype)}"
    counts = [3, 0, 11]
    xs = [gen(what + f"/{i}", RANK, c, dtype) for i, c in enumerate(counts)]
    wants = []
    for x, c in zip(xs, counts):
        w = torch.empty(WORLD * c, dtype=dtype)
        dist.all_gather_into_tensor(w, x.clone(), group=gloo)
        wants.append(w)
    outs = [torch.empty(WORLD * c, dtype=dtype, device=DEVICE) for c in counts]
    ins = [dev(x) for x in xs]
    with dist._coalescing_manager(async_ops=True) as cm:
        for o, i in zip(outs, ins):
            dist.all_gather_into_tensor(o, i)
    cm.wait()
    for k, (o, w) in enumerate(zip(outs, wants)):
        same(f"{what} tensor {k}", o, w)


def split(src, dst, salt, scale=1):
    """Uneven all-to-all: elements `src` sends to `dst` (zeros included)."""
    return scale * ((src * 3 + dst * 5 + salt) % 4)


def alltoall_case(gloo, dtype, count, variant):
    what = f"all_to_all {variant} {dname(dtype)} count={count}"
    if variant == "equal":
        ins_ = [count] * WORLD
        outs_ = [count] * WORLD
    else:
        ins_ = [split(RANK, p, count) for p in range(WORLD)]
        outs_ = [split(p, RANK, count) for p in range(WORLD)]
    shape = (sum(ins_), 3) if variant == "uneven-2d" else (sum(ins_),)
    x = gen(what, RANK, None, dtype, shape=shape)
    want = torch.empty((sum(outs_),) + shape[1:], dtype=dtype)
    dist.all_to_all_single(want, x.clone(), outs_, ins_, group=gloo)
    xin = dev(x)
    if variant == "list":
        ins_l = list(xin.split(ins_))
        outs_l = [torch.empty(c, dtype=dtype, device=DEVICE) for c in outs_]
        dist.all_to_all(outs_l, ins_l)
        got = torch.cat([o.cpu() for o in outs_l])
    else:
        got = torch.empty((sum(outs_),) + shape[1:], dtype=dtype, device=DEVICE)
        if variant == "equal":
            dist.all_to_all_single(got, xin)
        else:
            dist.all_to_all_single(got, xin, outs_, ins_)
    same(what, got, want)
    same(what + " (input untouched)", xin, x)


def gather_scatter_case(gloo, dtype, count, root):
    what = f"gather {dname(dtype)} count={count} dst={root}"
    x = gen(what, RANK, count, dtype)
    want = torch.empty(WORLD * count, dtype=dtype)
    dist.all_gather_into_tensor(want, x.clone(), group=gloo)
    lst = [torch.empty(count, dtype=dtype, device=DEVICE) for _ in range(WORLD)] if RANK == root else None
    dist.gather(dev(x), lst, dst=root)
    if RANK == root:
        same(what, torch.cat([t.cpu() for t in lst]), want)

    what = f"scatter {dname(dtype)} count={count} src={root}"
    full = gen(what, RANK, WORLD * count, dtype)
    want = full.clone()
    dist.broadcast(want, root, group=gloo)
    want = want[RANK * count:(RANK + 1) * count]
    out = torch.empty(count, dtype=dtype, device=DEVICE)
    dist.scatter(out, list(dev(full).split(count)) if RANK == root and count else
                 ([torch.empty(0, dtype=dtype, device=DEVICE)] * WORLD if RANK == root else None), src=root)
    same(what, out, want)


def p2p_cases():
    nxt, prv = (RANK + 1) % WORLD, (RANK - 1) % WORLD
    for dtype, count in [(torch.float32, 7), (torch.int64, 1001), (torch.bfloat16, 1), (torch.uint8, 0),
                         (torch.complex64, 5), (torch.bool, 9)]:
        what = f"send/recv ring {dname(dtype)} count={count}"

        def blocking():
            t = dev(gen(what, RANK, count, dtype))
            r = torch.empty(count, dtype=dtype, device=DEVICE)
            if RANK % 2 == 0:
                dist.send(t, nxt)
                dist.recv(r, prv)
            else:
                dist.recv(r, prv)
                dist.send(t, nxt)
            same(what, r, gen(what, prv, count, dtype))
        REP.case(what, blocking)

    # The non-blocking patterns run on a group of their own with a short timeout: a backend that
    # cannot match them fails each at that deadline instead of the default group's.
    pg = dist.new_group(backend=BACKEND, timeout=timedelta(seconds=10))

    def exchange(what, order, tags):
        """Both directions between next and prev; each rank posts in `order` (s: isend, r: irecv),
        then waits for all."""
        a = dev(gen(what + "a", RANK, 5, torch.float32))
        b = dev(gen(what + "b", RANK, 5, torch.float32))
        ra = torch.empty(5, device=DEVICE)
        rb = torch.empty(5, device=DEVICE)
        post = {"sa": lambda: dist.isend(a, nxt, group=pg, tag=tags[0]),
                "sb": lambda: dist.isend(b, nxt, group=pg, tag=tags[1]),
                "ra": lambda: dist.irecv(ra, prv, group=pg, tag=tags[0]),
                "rb": lambda: dist.irecv(rb, prv, group=pg, tag=tags[1])}
        ws = [post[o]() for o in order]
        for w in ws:
            w.wait()
        same(what + f" (tag {tags[0]})", ra, gen(what + "a", prv, 5, torch.float32))
        same(what + f" (tag {tags[1]})", rb, gen(what + "b", prv, 5, torch.float32))

    # TT_BACKEND=nccl: ProcessGroupNCCL posts each isend/irecv as its own stream-ordered group,
    # which collectived's libnccl runs in stream order (no eager send), so a ring of them,
    # each rank's first op waiting for its neighbour's second, never completes (issue L:
    # open). Real NCCL completes small ones eagerly.
    cycles = [] if BACKEND == "nccl" else [
            ("isend then irecv on every rank, waited after (tag 0)", ["sa", "ra", "sb", "rb"], (0, 0)),
            ("irecv then isend on every rank, waited after (tag 0)", ["ra", "sa", "rb", "sb"], (0, 0)),
            ("two isends, then two irecvs in the same order (tags 7, 9)", ["sa", "sb", "ra", "rb"], (7, 9))]
    if BACKEND == "nccl":
        REP.note("skipped", "rings of lone isend/irecv (collectived's libnccl has no eager sends)")
    for what, order, tags in [
            *cycles,
            # Tags are not matched by collectived, as by NCCL: the k-th send from a to b
            # meets the k-th receive at b from a (README); Gloo matches them.
            *([] if BACKEND in ("collectived", "nccl") else
              [("isend/irecv with tags posted in the other order (tags 7, 9)", ["sa", "sb", "rb", "ra"], (7, 9))])]:
        REP.case(what, exchange, what, order, tags)

    what = "isend/irecv both directions"

    def both():
        a = dev(gen(what, RANK, 33, torch.float64))
        r1 = torch.empty(33, dtype=torch.float64, device=DEVICE)
        r2 = torch.empty(33, dtype=torch.float64, device=DEVICE)
        ws = [dist.irecv(r1, prv, group=pg), dist.isend(a, nxt, group=pg), dist.isend(a, prv, group=pg),
              dist.irecv(r2, nxt, group=pg)]
        for w in ws:
            w.wait()
        same(what + " (from prev)", r1, gen(what, prv, 33, torch.float64))
        same(what + " (from next)", r2, gen(what, nxt, 33, torch.float64))
    if WORLD > 2:
        REP.case(what, both)

    what = "batch_isend_irecv ring"

    def batch():
        a = dev(gen(what, RANK, 17, torch.float32))
        r = torch.empty(17, device=DEVICE)
        ops = [dist.P2POp(dist.isend, a, nxt), dist.P2POp(dist.irecv, r, prv)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        same(what, r, gen(what, prv, 17, torch.float32))
    REP.case(what, batch)


# ---------------------------------------------------------------- groups, work, errors
def groups_cases(gloo):
    """Several process groups at once: a second full group, a subset, the even ranks."""
    full2 = dist.new_group(backend=BACKEND)
    sub_ranks = list(range(1, WORLD))
    even_ranks = list(range(0, WORLD, 2))
    sub = dist.new_group(ranks=sub_ranks, backend=BACKEND)
    even = dist.new_group(ranks=even_ranks, backend=BACKEND)
    gloo_sub = dist.new_group(ranks=sub_ranks, backend="gloo")
    gloo_even = dist.new_group(ranks=even_ranks, backend="gloo")
    REP.ok(dist.get_backend(full2) == BACKEND, "new_group backend name", dist.get_backend(full2))

    for count in [0, 5, 1001]:
        what = f"groups interleaved count={count}"

        def interleaved():
            # async ops on three groups in flight together, waited in reverse order
            xs = {name: gen(f"{what}/{name}", RANK, count, torch.float32) for name in ["world", "full2", "sub", "even"]}
            wants = {"world": ref_reduce(xs["world"], "sum", torch.float32, None, gloo),
                     "full2": ref_reduce(xs["full2"], "max", torch.float32, None, gloo)}
            if RANK in sub_ranks:
                wants["sub"] = ref_reduce(xs["sub"], "sum", torch.float32, gloo_sub, gloo_sub)
            if RANK in even_ranks:
                wants["even"] = ref_reduce(xs["even"], "min", torch.float32, gloo_even, gloo_even)
            ts = {k: dev(v) for k, v in xs.items()}
            works = [("world", dist.all_reduce(ts["world"], async_op=True)),
                     ("full2", dist.all_reduce(ts["full2"], op=R.MAX, group=full2, async_op=True))]
            if RANK in sub_ranks:
                works.append(("sub", dist.all_reduce(ts["sub"], group=sub, async_op=True)))
            if RANK in even_ranks:
                works.append(("even", dist.all_reduce(ts["even"], op=R.MIN, group=even, async_op=True)))
            for name, w in reversed(works):
                w.wait()
            for name, _ in works:
                close(f"{what}: {name}", ts[name], wants[name], torch.float32)
        REP.case(what, interleaved)

    what = "subgroup broadcast from its first member (global rank)"

    def sub_bcast():
        if RANK not in sub_ranks:
            return
        x = gen(what, RANK, 9, torch.int64)
        t = dev(x)
        dist.broadcast(t, sub_ranks[0], group=sub)
        same(what, t, gen(what, sub_ranks[0], 9, torch.int64))
    REP.case(what, sub_bcast)

    what = "even-ranks all_gather_into_tensor and reduce_scatter_tensor"

    def even_ops():
        if RANK not in even_ranks:
            return
        n = len(even_ranks)
        me = even_ranks.index(RANK)
        out = torch.empty(n * 6, dtype=torch.float64, device=DEVICE)
        dist.all_gather_into_tensor(out, dev(gen(what, RANK, 6, torch.float64)), group=even)
        same(what + " (gather)", out, torch.cat([gen(what, r, 6, torch.float64) for r in even_ranks]))
        x = gen(what + "rs", RANK, n * 4, torch.int32)
        o = torch.empty(4, dtype=torch.int32, device=DEVICE)
        dist.reduce_scatter_tensor(o, dev(x), group=even)
        want = sum(gen(what + "rs", r, n * 4, torch.int32).long() for r in even_ranks)[me * 4:(me + 1) * 4]
        close(what + " (reduce-scatter)", o, want, torch.int32)
    REP.case(what, even_ops)
    for g in [full2, sub, even]:
        if g is not None and g != dist.GroupMember.NON_GROUP_MEMBER:
            dist.destroy_process_group(g)


def work_cases(gloo):
    what = "async all_reduce: returns at once, is_completed() False until the last rank joins"

    def returns_at_once():
        x = dev(torch.full((4,), float(RANK + 1)))
        dist.barrier(group=gloo)
        if RANK == 0:
            time.sleep(1.0)
        t0 = time.time()
        w = dist.all_reduce(x, async_op=True)
        t_call = time.time() - t0
        early = w.is_completed()
        t_poll = time.time() - t0
        ok = w.wait(timeout=timedelta(seconds=60))
        settle()  # CUDA: wait() does not block the CPU; the device does
        t_wait = time.time() - t0
        if RANK != 0:
            REP.ok(t_call < 0.5, what + ": the call blocked", f"all_reduce(async_op=True) took {t_call:.3f} s")
            REP.ok(t_poll < 0.5, what + ": is_completed() blocked", f"{t_poll:.3f} s")
            REP.ok(not early, what + ": is_completed() True before rank 0 called")
            REP.ok(t_wait > 0.5, what + ": wait() returned before rank 0 called", f"{t_wait:.3f} s")
        REP.ok(ok is not False, what + ": wait(timeout) returned False")
        REP.ok(w.is_completed(), what + ": is_completed() False after wait()")
        close(what, x, torch.full((4,), WORLD * (WORLD + 1) / 2, dtype=torch.float64), torch.float32)
    REP.case(what, returns_at_once)

    what = "get_future(): value and then()"

    def future():
        x = dev(gen(what, RANK, 13, torch.float32))
        want = ref_reduce(gen(what, RANK, 13, torch.float32), "sum", torch.float32, None, gloo)
        w = dist.all_reduce(x, async_op=True)
        fut = w.get_future()
        chained = fut.then(lambda f: f.value()[0] * 2)
        got = chained.wait()
        close(what + " (then)", got, want * 2, torch.float32)
        v = fut.value()
        REP.ok(isinstance(v, list) and len(v) == 1, what + ": future value is not [tensor]", repr(type(v)))
        close(what + " (value)", v[0], want, torch.float32)
        REP.ok(fut.done(), what + ": future not done")
        w2 = dist.all_gather_into_tensor(torch.empty(WORLD * 3, device=DEVICE), dev(torch.ones(3)), async_op=True)
        w2.get_future().wait()
        settle()
        REP.ok(w2.is_completed(), what + ": all_gather work not completed after its future")
    REP.case(what, future)

    what = "barrier waits for the last rank"

    def barrier():
        dist.barrier(group=gloo)
        if RANK == WORLD - 1:
            time.sleep(0.7)
        t0 = time.time()
        dist.barrier()
        settle()
        dt = time.time() - t0
        if RANK != WORLD - 1:
            REP.ok(dt > 0.4, what, f"barrier returned after {dt:.3f} s; the last rank came 0.7 s late")
    REP.case(what, barrier)

    what = "wait(timeout) shorter than the op: raises or returns False; the op completes later"

    def wait_timeout():
        x = dev(torch.full((5,), float(RANK + 1)))
        dist.barrier(group=gloo)
        if RANK == 0:
            time.sleep(1.5)
        w = dist.all_reduce(x, async_op=True)
        if RANK != 0:
            t0 = time.time()
            try:
                ret = w.wait(timeout=timedelta(milliseconds=200))
                # CUDA: wait() orders the caller's stream and returns (as
                # ProcessGroupNCCL's does), so only the CPU-side claim is checked.
                REP.ok(ret is False or DEVICE.type == "cuda",
                       what + ": wait(200 ms) returned before rank 0 called",
                       f"returned {ret!r} after {time.time() - t0:.2f} s")
            except RuntimeError as e:
                dt = time.time() - t0
                REP.ok(dt < 1.2, what + ": wait(200 ms) raised late", f"{dt:.2f} s: {e}")
                REP.note(what, f"raised after {dt:.2f} s: {str(e)[:300]}")
        w.wait()
        settle()
        close(what, x, torch.full((5,), WORLD * (WORLD + 1) / 2, dtype=torch.float64), torch.float32)
    REP.case(what, wait_timeout)

    what = "many async ops in flight, waited in reverse"

    def many():
        xs = [gen(what + str(i), RANK, 3 + i, torch.float32) for i in range(24)]
        wants = [ref_reduce(x, "sum", torch.float32, None, gloo) for x in xs]
        ts = [dev(x) for x in xs]
        ws = [dist.all_reduce(t, async_op=True) for t in ts]
        for w in reversed(ws):
            w.wait()
        for i, (t, w) in enumerate(zip(ts, wants)):
            close(f"{what} #{i}", t, w, torch.float32)
    REP.case(what, many)


def expect_error(what, fn, pattern):
    """fn must raise a RuntimeError whose message matches pattern."""
    try:
        fn()
    except RuntimeError as e:
        msg = str(e)
        REP.ok(re.search(pattern, msg, re.I), what + ": message does not name it",
               f"pattern {pattern!r}; message: {msg[:600]}")
        REP.note(what, msg[:400])
        return
    except Exception as e:  # noqa: BLE001
        REP.ok(False, what + ": raised, but not a RuntimeError", f"{type(e).__name__}: {e}")
        return
    REP.ok(False, what + ": did not raise")


def error_cases(gloo):
    for name in ["BAND", "BOR", "BXOR"]:
        expect_error(f"all_reduce int32 {name} refused",
                     lambda: dist.all_reduce(dev(torch.ones(4, dtype=torch.int32)), op=getattr(R, name)),
                     name)
    bad = [(torch.int16, r"int16|short"), (torch.uint16, r"uint16"), (torch.float8_e4m3fn, r"float8")]
    for dtype, pat in bad:
        expect_error(f"all_reduce {dname(dtype)} refused",
                     lambda: dist.all_reduce(dev(torch.zeros(4, dtype=dtype))), pat)
        expect_error(f"broadcast {dname(dtype)} refused",
                     lambda: dist.broadcast(dev(torch.zeros(4, dtype=dtype)), 0), pat)
    # uint32/uint64 map onto the C API's types: right, or refused naming the dtype.
    for dtype in [torch.uint32, torch.uint64]:
        what = f"all_reduce {dname(dtype)} MAX (right or refused naming the dtype)"
        try:
            t = dev(torch.tensor([RANK, 2**31 + RANK, 7], dtype=torch.int64).to(dtype))
            dist.all_reduce(t, op=R.MAX)
            REP.ok(t.cpu().to(torch.int64).tolist() == [WORLD - 1, 2**31 + WORLD - 1, 7], what, t.cpu().tolist())
            REP.note(what, "supported")
        except RuntimeError as e:
            REP.ok(re.search(dname(dtype), str(e), re.I), what, str(e)[:400])
            REP.note(what, "refused: " + str(e)[:300])
    # the group still works after refusals
    allreduce_case(gloo, torch.float32, "sum", 7, "after-errors")

    what = "non-contiguous input: handled or refused naming contiguity"
    for op_name in ["all_reduce", "broadcast"]:
        base = gen(what + op_name, RANK, 24, torch.float32).view(4, 6)
        t = dev(base).t()  # (6, 4), strides (1, 6)
        if op_name == "all_reduce":
            want = ref_reduce(base, "sum", torch.float32, None, gloo).t()
        else:
            want = gen(what + op_name, 0, 24, torch.float32).view(4, 6).t()
        try:
            dist.all_reduce(t) if op_name == "all_reduce" else dist.broadcast(t, 0)
            close(f"{what}: {op_name} handled", t, want, torch.float32)
            REP.note(what, f"{op_name}: handled")
        except RuntimeError as e:
            REP.ok(re.search("contiguous", str(e), re.I), f"{what}: {op_name} refused without saying why",
                   str(e)[:400])
            REP.note(what, f"{op_name}: refused: {str(e)[:300]}")


# ---------------------------------------------------------------- scenarios
def scenario_ops():
    """The matrix: every op x dtype x reduction against Gloo, odd counts and 0, in place, groups."""
    init_s = init_default(timeout=30)
    gloo = dist.new_group(backend="gloo")
    REP.note("init_process_group seconds", f"{init_s:.3f}")
    REP.ok(dist.get_backend() == BACKEND, "default group backend", dist.get_backend())
    phases = []

    def phase(name):
        phases.append((name, time.time()))

    phase("all_reduce")
    for dtype in DTYPES + COMPLEX + [torch.bool]:
        for red in reds_for(dtype):
            for count in COUNTS:
                REP.case(f"all_reduce {dname(dtype)} {red} {count}", allreduce_case, gloo, dtype, red, count)
        REP.case(f"all_reduce view {dname(dtype)}", allreduce_case, gloo, dtype, reds_for(dtype)[0], 7, "view")
    for red in ["sum", "avg"] + ([] if NCCL_BF16_PREMUL else ["premul_tensor"]):
        REP.case(f"all_reduce async {red}", allreduce_case, gloo, torch.bfloat16, red, 33, "async")
    REP.case("all_reduce large", allreduce_case, gloo, torch.float32, "sum", (1 << 20) + 1)
    REP.case("all_reduce large avg", allreduce_case, gloo, torch.bfloat16, "avg", (1 << 19) + 3)
    REP.case("all_reduce large int64", allreduce_case, gloo, torch.int64, "max", (1 << 17) + 5)

    phase("all_reduce coalesced")
    for dtype in DTYPES:
        for red in reds_for(dtype):
            for how in ["all_reduce_coalesced", "coalescing_manager"]:
                REP.case(f"coalesced {how} {dname(dtype)} {red}", allreduce_coalesced_case, gloo, dtype, red, how)

    phase("reduce")
    i = 0
    for dtype in DTYPES:
        for red in reds_for(dtype):
            for count in [0, 7, 1001]:
                REP.case(f"reduce {dname(dtype)} {red} {count}", reduce_case, gloo, dtype, red, count, i % WORLD)
                i += 1

    phase("reduce_scatter")
    # ProcessGroupNCCL refuses complex reduce-scatters itself (TypeError naming the dtype).
    for dtype in DTYPES + ([] if BACKEND == "nccl" else COMPLEX):
        for red in reds_for(dtype):
            for count in COUNTS:
                REP.case(f"rs tensor {dname(dtype)} {red} {count}", reduce_scatter_case, gloo, dtype, red, count,
                         "tensor")
            for count in [0, 7]:
                REP.case(f"rs list {dname(dtype)} {red} {count}", reduce_scatter_case, gloo, dtype, red, count,
                         "list")
            REP.case(f"rs in-place {dname(dtype)} {red}", reduce_scatter_case, gloo, dtype, red, 5, "in-place")
        REP.case(f"rs 2d {dname(dtype)}", reduce_scatter_case, gloo, dtype, reds_for(dtype)[1], 9, "tensor-2d")
        if dtype in DTYPES:
            for red in reds_for(dtype):
                REP.case(f"rs coalesced {dname(dtype)} {red}", reduce_scatter_coalesced_case, gloo, dtype, red)
    REP.case("rs large", reduce_scatter_case, gloo, torch.float32, "sum", 65537, "tensor")
    if not NCCL_BF16_PREMUL:
        REP.case("rs large premul", reduce_scatter_case, gloo, torch.bfloat16, "premul_scalar", 65537, "tensor")

    phase("broadcast")
    for dtype in MOVE_DTYPES:
        for count in COUNTS:
            for src in sorted({0, WORLD - 1}):
                REP.case(f"broadcast {dname(dtype)} {count} {src}", broadcast_case, gloo, dtype, count, src)
    REP.case("broadcast large", broadcast_case, gloo, torch.float32, (1 << 20) + 1, 1)

    phase("all_gather")
    for dtype in MOVE_DTYPES:
        for count in COUNTS:
            for variant in ["list", "tensor"]:
                REP.case(f"ag {variant} {dname(dtype)} {count}", allgather_case, gloo, dtype, count, variant)
        for variant in ["tensor-2d", "in-place"]:
            REP.case(f"ag {variant} {dname(dtype)}", allgather_case, gloo, dtype, 7, variant)
        REP.case(f"ag coalesced {dname(dtype)}", allgather_coalesced_case, gloo, dtype)
    REP.case("ag large", allgather_case, gloo, torch.float32, 65537, "tensor")
    REP.case("ag list int64 (DDP's check)", allgather_case, gloo, torch.int64, 3, "list")

    phase("all_to_all")
    for dtype in MOVE_DTYPES:
        for count in [0, 1, 7]:
            REP.case(f"a2a equal {dname(dtype)} {count}", alltoall_case, gloo, dtype, count, "equal")
        for salt in [0, 1, 2]:
            REP.case(f"a2a uneven {dname(dtype)} {salt}", alltoall_case, gloo, dtype, salt, "uneven")
        REP.case(f"a2a list {dname(dtype)}", alltoall_case, gloo, dtype, 1, "list")
    REP.case("a2a uneven 2d", alltoall_case, gloo, torch.float32, 2, "uneven-2d")
    REP.case("a2a large", alltoall_case, gloo, torch.float32, 65537, "equal")

    phase("gather/scatter")
    for dtype in [torch.float32, torch.int8, torch.bfloat16, torch.bool, torch.complex128, torch.int64]:
        for count in [0, 7]:
            for root in sorted({0, WORLD - 1}):
                REP.case(f"gather/scatter {dname(dtype)} {count} {root}", gather_scatter_case, gloo, dtype, count,
                         root)

    phase("send/recv")
    p2p_cases()
    phase("groups")
    REP.case("groups", groups_cases, gloo)
    phase("work")
    work_cases(gloo)
    phase("errors")
    REP.case("errors", error_cases, gloo)
    phase("destroy")
    t0 = time.time()
    dist.destroy_process_group()
    REP.note("destroy_process_group seconds", f"{time.time() - t0:.3f}")
    phase("end")
    REP.note("phase seconds", {a[0]: round(b[1] - a[1], 2) for a, b in zip(phases, phases[1:])})
    REP.done()


# ---------------------------------------------------------------- DDP
def ddp_train(pg, steps=20, hook=None, bucket_cap_mb=0.001, device=None, gradient_as_bucket_view=False):
    """A small MLP, SGD; each rank starts from a different init (DDP broadcasts rank 0's) and its
    own data per step; returns the flat parameters after `steps` and the losses."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    device = device or torch.device("cpu")
    torch.manual_seed(1000 + RANK)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32),
                                torch.nn.Tanh(), torch.nn.Linear(32, 4)).to(device)
    ddp = DDP(model, process_group=pg, bucket_cap_mb=bucket_cap_mb,
              gradient_as_bucket_view=gradient_as_bucket_view,
              device_ids=[device.index] if device.type == "cuda" else None)
    if hook is not None:
        ddp.register_comm_hook(pg, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step * 100 + RANK)
        x = torch.randn(8, 16, generator=g).to(device)
        y = torch.randn(8, 4, generator=g).to(device)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    flat = torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])
    return flat, losses


def future_hook(pg, bucket):
    """A user comm hook: average through all_reduce's future (as DDP's docs show)."""
    t = bucket.buffer()
    t.div_(dist.get_world_size(pg))
    fut = dist.all_reduce(t, group=pg, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def ranks_agree(what, flat, gloo):
    """Every rank holds exactly the same parameters (all-reduce results must agree bitwise)."""
    all_ = torch.empty(WORLD * flat.numel(), dtype=flat.dtype)
    dist.all_gather_into_tensor(all_, flat.clone(), group=gloo)
    rows = all_.view(WORLD, -1)
    for r in range(WORLD):
        REP.ok(torch.equal(rows[r], rows[0]), f"{what}: rank {r}'s parameters differ from rank 0's",
               f"max |diff| {(rows[r] - rows[0]).abs().max().item():.3g}")


def scenario_ddp(steps=20):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    init_default()
    gloo = dist.new_group(backend="gloo")
    ours = dist.group.WORLD
    t0 = time.time()
    ref, ref_losses = ddp_train(gloo, steps)
    t_gloo = time.time() - t0
    t0 = time.time()
    got, losses = ddp_train(ours, steps, device=DEVICE)
    t_ours = time.time() - t0
    REP.note("ddp seconds", f"{BACKEND} {t_ours:.2f}, gloo {t_gloo:.2f}")
    what = f"DDP {steps} steps: parameters equal to Gloo's"
    REP.ok(torch.allclose(got, ref, rtol=1e-5, atol=1e-6), what,
           f"max |diff| {(got - ref).abs().max().item():.3g}; losses {losses[-3:]} vs gloo {ref_losses[-3:]}")
    REP.ok(not torch.equal(ref, ddp_train(gloo, 0)[0]), "DDP: training changed the parameters")
    ranks_agree(f"DDP {steps} steps ({BACKEND})", got, gloo)
    ranks_agree(f"DDP {steps} steps (gloo)", ref, gloo)

    got_h, _ = ddp_train(ours, steps, hook=future_hook, device=DEVICE)
    REP.ok(torch.allclose(got_h, ref, rtol=1e-5, atol=1e-6), f"DDP comm hook through the future: parameters equal "
           f"to Gloo's", f"max |diff| {(got_h - ref).abs().max().item():.3g}")
    got_v, _ = ddp_train(ours, steps, hook=default_hooks.allreduce_hook, device=DEVICE,
                         gradient_as_bucket_view=True, bucket_cap_mb=25)
    REP.ok(torch.allclose(got_v, ref, rtol=1e-5, atol=1e-6), "DDP allreduce_hook, one bucket, "
           "gradient_as_bucket_view: parameters equal to Gloo's", f"max |diff| {(got_v - ref).abs().max().item():.3g}")
    ref16, _ = ddp_train(gloo, steps, hook=default_hooks.fp16_compress_hook)
    got16, _ = ddp_train(ours, steps, hook=default_hooks.fp16_compress_hook, device=DEVICE)
    REP.ok(torch.allclose(got16, ref16, rtol=1e-2, atol=1e-3), "DDP fp16_compress_hook: parameters close to "
           "Gloo's", f"max |diff| {(got16 - ref16).abs().max().item():.3g}")
    dist.destroy_process_group()
    REP.done()


def scenario_torchrun():
    """Under torchrun: env:// from its environment, a few ops against Gloo and a short DDP run."""
    REP.note("torchrun env", {k: os.environ.get(k) for k in ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT",
                                                              "TORCHELASTIC_RUN_ID"]})
    init_default()
    gloo = dist.new_group(backend="gloo")
    for dtype in [torch.float32, torch.int64, torch.bfloat16]:
        REP.case(f"torchrun all_reduce {dname(dtype)}", allreduce_case, gloo, dtype, "sum", 1001)
        REP.case(f"torchrun all_gather {dname(dtype)}", allgather_case, gloo, dtype, 7, "tensor")
        REP.case(f"torchrun broadcast {dname(dtype)}", broadcast_case, gloo, dtype, 7, WORLD - 1)
    ref, _ = ddp_train(gloo, 5)
    got, _ = ddp_train(dist.group.WORLD, 5, device=DEVICE)
    REP.ok(torch.allclose(got, ref, rtol=1e-5, atol=1e-6), "torchrun DDP 5 steps: parameters equal to Gloo's",
           f"max |diff| {(got - ref).abs().max().item():.3g}")
    dist.destroy_process_group()
    REP.done()


# ---------------------------------------------------------------- failures
def file_barrier(name, timeout=60):
    """All ranks here before any goes on (no process group needed)."""
    open(os.path.join(OUT, f"{name}.{RANK}"), "w").close()
    t0 = time.time()
    while not all(os.path.exists(os.path.join(OUT, f"{name}.{r}")) for r in range(WORLD)):
        if time.time() - t0 > timeout:
            raise RuntimeError(f"file barrier {name}: not every rank came in {timeout} s")
        time.sleep(0.02)


def wait_for_file(name, timeout):
    t0 = time.time()
    while not os.path.exists(os.path.join(OUT, name)) and time.time() - t0 < timeout:
        time.sleep(0.05)


def fail_loop(timeout_s, count, max_s):
    """all_reduce after all_reduce until one raises; says 'ready' after a few. Returns the record."""
    x = dev(torch.ones(count))
    t_start = time.time()
    i = 0
    while time.time() - t_start < max_s:
        t0 = time.time()
        try:
            w = dist.all_reduce(x, async_op=True)
            w.wait()
            settle()
        except Exception as e:  # noqa: BLE001
            return dict(raised=type(e).__name__, is_runtime_error=isinstance(e, RuntimeError), message=str(e),
                        t_submit=t0, t_raise=time.time(), iterations=i)
        x.fill_(1.0)
        i += 1
        if i == 5:
            REP.rec("ready", pid=os.getpid())
    return dict(raised=None, iterations=i)


def after_failure():
    """After a failure every further operation must raise too, not hang: the time it took."""
    t0 = time.time()
    try:
        dist.all_reduce(dev(torch.ones(3)))
        settle()
        return dict(next_raised=None, next_s=time.time() - t0)
    except Exception as e:  # noqa: BLE001
        return dict(next_raised=type(e).__name__, next_message=str(e)[:400], next_s=time.time() - t0)


def scenario_killed(timeout_s="40"):
    """Every rank loops all-reduces; the harness SIGKILLs the last rank; the others must raise."""
    init_default(timeout=float(timeout_s))
    dist.all_reduce(dev(torch.ones(1)))
    res = fail_loop(float(timeout_s), 1 << 16, 120)
    res.update(after_failure())
    REP.rec("result", **res)
    REP.done()
    os._exit(0)


def scenario_stuck(timeout_s="3"):
    """The last rank stops calling (alive); the others' all_reduce must raise at the group timeout."""
    file_barrier("start")  # so the short timeout does not also cut the rendezvous of slow starters
    init_default(timeout=float(timeout_s))
    for _ in range(3):
        dist.all_reduce(dev(torch.ones(4)))
    REP.rec("ready", pid=os.getpid())
    if RANK == WORLD - 1:
        wait_for_file("release", 60)  # stuck: alive, never calls
        REP.done()
        os._exit(0)
    x = dev(torch.ones(4))
    t0 = time.time()
    res = dict(raised=None)
    try:
        w = dist.all_reduce(x, async_op=True)
        w.wait()
        settle()
    except Exception as e:  # noqa: BLE001
        res = dict(raised=type(e).__name__, is_runtime_error=isinstance(e, RuntimeError), message=str(e))
    res.update(t_submit=t0, t_raise=time.time())
    res.update(after_failure())
    REP.rec("result", **res)
    REP.done()
    os._exit(0)


def scenario_daemon_killed():
    """Every rank loops all-reduces; the harness SIGKILLs the daemon; every rank must raise."""
    init_default(timeout=60)
    dist.all_reduce(dev(torch.ones(1)))
    res = fail_loop(60, 1 << 16, 120)
    res.update(after_failure())
    REP.rec("result", **res)
    REP.done()
    os._exit(0)


def fd_count():
    return len(os.listdir("/proc/self/fd"))


def memfd_maps():
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if "memfd:" in line)


def scenario_reinit(port2):
    """init / use / destroy three times in one process: env://, tcp://, file://."""
    methods = [("env://", {}),
               (f"tcp://127.0.0.1:{port2}", dict(rank=RANK, world_size=WORLD)),
               ("file://" + os.path.join(OUT, "filestore"), dict(rank=RANK, world_size=WORLD))]
    counts = []
    for i, (method, kw) in enumerate(methods * 2):
        what = f"init #{i + 1} ({method.split(':')[0]})"
        t0 = time.time()
        if method.startswith("file://"):
            kw = dict(kw)
            method = method + str(i)
        dist.init_process_group(BACKEND, init_method=method, timeout=timedelta(seconds=60), **kw)
        t_init = time.time() - t0
        x = dev(torch.full((1001,), float(RANK + 1)))
        t0 = time.time()
        dist.all_reduce(x)
        t_first = time.time() - t0
        REP.note(what + " seconds", f"init {t_init:.3f}, first all_reduce {t_first:.3f}")
        close(what + ": all_reduce", x, torch.full((1001,), WORLD * (WORLD + 1) / 2, dtype=torch.float64),
              torch.float32)
        g = dist.new_group(backend=BACKEND)
        y = dev(torch.full((7,), float(RANK)))
        dist.all_reduce(y, op=R.MAX, group=g)
        close(what + ": new_group all_reduce", y, torch.full((7,), float(WORLD - 1), dtype=torch.float64),
              torch.float32)
        dist.destroy_process_group()
        REP.ok(not dist.is_initialized(), what + ": still initialized after destroy_process_group()")
        counts.append((fd_count(), memfd_maps()))
    REP.note("descriptors, memfd mappings after each destroy", counts)
    # the first rounds may leave lasting state (a connection pool); afterwards nothing may grow
    REP.ok(counts[-1][0] <= counts[2][0], "destroy_process_group releases descriptors",
           f"open descriptors after each destroy: {[c[0] for c in counts]}")
    REP.ok(counts[-1][1] <= counts[2][1], "destroy_process_group releases memfd mappings",
           f"memfd mappings after each destroy: {[c[1] for c in counts]}")
    REP.done()


def scenario_missing_daemon():
    """COLLECTIVED_SOCKET names no daemon: init or the first op raises a clear RuntimeError."""
    sock = os.environ["COLLECTIVED_SOCKET"]
    t0 = time.time()
    res = dict(raised=None)
    try:
        init_default(timeout=20, init_method="tcp://127.0.0.1:" + os.environ["MASTER_PORT"], rank=0, world_size=1)
        res["stage"] = "first all_reduce"
        dist.all_reduce(dev(torch.ones(3)))
    except Exception as e:  # noqa: BLE001
        res = dict(raised=type(e).__name__, is_runtime_error=isinstance(e, RuntimeError), message=str(e),
                   stage=res.get("stage", "init_process_group"))
    res.update(seconds=time.time() - t0, socket=sock)
    REP.rec("result", **res)
    REP.done()
    os._exit(0)


SCENARIOS = dict(ops=scenario_ops, ddp=scenario_ddp, torchrun=scenario_torchrun, killed=scenario_killed,
                 stuck=scenario_stuck, daemon_killed=scenario_daemon_killed, reinit=scenario_reinit,
                 missing_daemon=scenario_missing_daemon)

if __name__ == "__main__":
    try:
        SCENARIOS[SCENARIO](*sys.argv[2:])
    except Exception as e:  # noqa: BLE001
        REP.fail(f"scenario {SCENARIO} aborted", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        REP.done(aborted=True)
        sys.stderr.write(traceback.format_exc())
        sys.stderr.flush()
        os._exit(1)
