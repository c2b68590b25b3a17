#!/usr/bin/env python3
"""One rank of the training and overlap scenarios: `python train_worker.py SCENARIO`.

Same environment and records as worker.py (TT_OUT, TT_DEVICE, TT_HARD_TIMEOUT,
rankR.jsonl with "fail", "note" and a last "done"). Scenarios:
  fsdp     FSDP2 (fully_shard) in bf16 (parameters and reduction), 20 SGD steps: every
           rank's full parameters match a single-process fp32 reference trained on all
           ranks' data, within bf16 tolerance. Gradients reduce with AVG, and with
           PREMUL_SUM once set_gradient_divide_factor is set.
  abort    rank 0 aborts every group (_abort_process_group) while rank 1 waits in an
           all_reduce: rank 1's wait() raises naming rank 0; both ranks then destroy what is
           left and make a new group, whose all_reduce is right.
  overlap  CUDA only: an all_reduce issued before a long kernel on the compute stream
           completes while that kernel still runs (communication overlaps computation).
"""
import faulthandler
import json
import os
import sys
import time
import traceback

SCENARIO = sys.argv[1]
faulthandler.dump_traceback_later(float(os.environ.get("TT_HARD_TIMEOUT", "240")), exit=True)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import collectived_torch  # noqa: F401,E402

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
DEVICE = torch.device(os.environ.get("TT_DEVICE", "cpu"))
if DEVICE.type == "cuda":
    DEVICE = torch.device("cuda", int(os.environ.get("LOCAL_RANK", RANK)) % torch.cuda.device_count())
    torch.cuda.set_device(DEVICE)
torch.set_num_threads(1)
OUT = open(os.path.join(os.environ["TT_OUT"], f"rank{RANK}.jsonl"), "a", buffering=1)
CHECKS = [0]


def rec(kind, **kw):
    OUT.write(json.dumps({"kind": kind, **kw}) + "\n")


def ok(cond, what, detail=""):
    CHECKS[0] += 1
    if not cond:
        rec("fail", what=what, detail=str(detail))


def model_fn():
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                               torch.nn.ReLU(), torch.nn.Linear(64, 8))


def batches(step):
    """Every rank's batch of `step`, the same on every rank (rank r takes slice r)."""
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(WORLD, 16, 32, generator=g), torch.randn(WORLD, 16, 8, generator=g)


def fsdp():
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    steps, lr = 20, 0.05
    ref = model_fn().to(DEVICE)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr)
    for divide in (None, float(WORLD) * 2):
        model = model_fn().to(DEVICE)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        if divide is not None:
            if not hasattr(model, "set_gradient_divide_factor"):
                rec("note", what="fsdp", detail="no set_gradient_divide_factor in this torch")
                continue
            # Per parameter group: every module that fully_shard wrapped.
            for m in model.modules():
                if hasattr(m, "set_gradient_divide_factor"):
                    m.set_gradient_divide_factor(divide)  # PREMUL_SUM(1/divide)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        reference = model_fn().to(DEVICE)
        reference_opt = torch.optim.SGD(reference.parameters(), lr=lr)
        scale = 1.0 if divide is None else WORLD / divide
        for step in range(steps):
            x, y = batches(step)
            loss = torch.nn.functional.mse_loss(model(x[RANK].to(DEVICE)).float(), y[RANK].to(DEVICE))
            opt.zero_grad()
            loss.backward()
            opt.step()
            # The reference: the mean of the ranks' losses on all data in fp32,
            # scaled as the divide factor scales the gradient.
            rl = sum(torch.nn.functional.mse_loss(reference(x[r].to(DEVICE)), y[r].to(DEVICE))
                     for r in range(WORLD)) / WORLD * scale
            reference_opt.zero_grad()
            rl.backward()
            reference_opt.step()
        worst = 0.0
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            full = p.full_tensor().float()
            err = ((full - q.detach().float()).abs() / (q.detach().float().abs() + 1e-2)).max().item()
            worst = max(worst, err)
            ok(err < 0.05, f"fsdp divide={divide} {name}", f"relative error {err:.4f}")
        rec("note", what=f"fsdp bf16 divide={divide}", detail=f"worst relative error {worst:.4f}")
        del model, opt
    del ref, ref_opt


def overlap():
    assert DEVICE.type == "cuda", "overlap needs CUDA tensors"
    x = torch.ones(1 << 20, device=DEVICE)
    dist.all_reduce(x)  # set-up (registration, first-use paths) out of the measurement
    torch.cuda.synchronize()
    # About 0.5 s of one spinning kernel on the compute stream.
    cycles = int(torch.cuda.get_device_properties(DEVICE).clock_rate * 1000 * 0.5)
    seen = 0
    for _ in range(3):
        work = dist.all_reduce(x, async_op=True)
        torch.cuda._sleep(cycles)  # queued after the collective on the caller's stream
        t0 = time.time()
        while not work.is_completed() and time.time() - t0 < 5:
            time.sleep(0.001)
        busy = not torch.cuda.current_stream().query()
        done = work.is_completed()
        rec("note", what="overlap", detail=f"work done {done} after {time.time() - t0:.3f} s, "
            f"compute stream still busy {busy}")
        seen += done and busy
        torch.cuda.synchronize()
    ok(seen >= 2, "overlap", f"the all_reduce finished during the compute kernel in {seen} of 3 tries")
    ok(torch.allclose(x, torch.full_like(x, float(WORLD ** 4))), "overlap result", x[:4].tolist())


def abort():
    from torch.distributed import distributed_c10d as c10d
    x = torch.ones(4, device=DEVICE)
    dist.all_reduce(x)  # the group works
    dist.barrier()
    if RANK == 0:
        time.sleep(1.0)  # rank 1 is waiting by now
        c10d._abort_process_group()
    else:
        w = dist.all_reduce(x, async_op=True)
        t0 = time.time()
        try:
            w.wait()
            if DEVICE.type == "cuda":
                dist.all_reduce(x)  # CUDA: the failure is raised by the next operation
            ok(False, "abort", "the all_reduce pending at the abort did not raise")
        except RuntimeError as e:
            ok("rank 0" in str(e) and "abort" in str(e).lower(), "abort message", str(e)[:400])
            ok(time.time() - t0 < 10, "abort", f"raised after {time.time() - t0:.1f} s")
            rec("note", what="abort", detail=f"raised after {time.time() - t0:.2f} s: {str(e)[:300]}")
        dist.destroy_process_group()
    # A new group in the same processes (a new store on a new port: the old one is gone).
    os.environ["MASTER_PORT"] = str(int(os.environ["MASTER_PORT"]) + 1)
    dist.init_process_group("collectived")
    y = torch.full((4,), float(RANK + 1), device=DEVICE)
    dist.all_reduce(y)
    ok(torch.equal(y.cpu(), torch.full((4,), float(WORLD * (WORLD + 1) // 2))), "after abort", y.tolist())


def main():
    dist.init_process_group("collectived")
    try:
        {"fsdp": fsdp, "overlap": overlap, "abort": abort}[SCENARIO]()
    except Exception:  # noqa: BLE001
        rec("fail", what=SCENARIO, detail=traceback.format_exc())
    dist.destroy_process_group()
    rec("done", checks=CHECKS[0])


main()
