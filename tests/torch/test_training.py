"""FSDP2 in bf16 over the backend against a single-process reference, abort and a new group
afterwards, and (CUDA) a collective overlapping a long kernel on the compute stream
(train_worker.py)."""
import os
import subprocess
import sys

import pytest
import torch

from conftest import HERE, daemon_ok, free_port, needs_collectived, worker_env

DEVICE = os.environ.get("TT_DEVICE", "cpu")


def run(scenario, world, daemon, out, timeout=240):
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = []
    for r in range(world):
        log = open(out / f"rank{r}.log", "w")
        procs.append(subprocess.Popen([sys.executable, str(HERE / "train_worker.py"), scenario],
                                      env=worker_env(r, world, port, daemon.socket, out, timeout - 10),
                                      stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT))
        log.close()
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"{scenario}: a rank ran past {timeout} s")
    problems, notes = [], []
    for r in range(world):
        lines = (out / f"rank{r}.jsonl").read_text().splitlines() if (out / f"rank{r}.jsonl").exists() else []
        import json
        recs = [json.loads(line) for line in lines]
        problems += [f"rank {r}: {x['what']}: {x['detail']}" for x in recs if x["kind"] == "fail"]
        notes += [f"rank {r}: {x['what']}: {x['detail']}" for x in recs if x["kind"] == "note"]
        if codes[r] != 0 or not any(x["kind"] == "done" for x in recs):
            problems.append(f"rank {r} exited {codes[r]}:\n" + (out / f"rank{r}.log").read_text()[-3000:])
    print("\n".join(notes))
    assert not problems, "\n".join(problems[:20])


@needs_collectived
@pytest.mark.parametrize("world", [2, 3])
def test_fsdp2_bf16_matches_reference(daemon, tmp_path, world):
    run("fsdp", world, daemon, tmp_path / f"fsdp{world}")
    daemon_ok(daemon)


@needs_collectived
@pytest.mark.skipif(DEVICE != "cuda" or not torch.cuda.is_available(), reason="CUDA tensors only")
def test_collective_overlaps_compute(daemon, tmp_path):
    run("overlap", 2, daemon, tmp_path / "overlap")
    daemon_ok(daemon)


@needs_collectived
def test_abort_then_new_group(daemon, tmp_path):
    run("abort", 2, daemon, tmp_path / "abort", timeout=120)
    daemon_ok(daemon)
