"""Every op x dtype x reduction through the backend against Gloo in the same run (worker.py
scenario_ops), on 2, 3 and 4 ranks; and the same backend under torchrun."""
import os
import subprocess
import sys

import pytest

from conftest import BACKEND, WORKER, daemon_ok, free_port, tail, worker_env


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ops_against_gloo(world, daemon, launch):
    job = launch("ops", world, daemon, timeout=280)
    done = job.assert_clean()
    daemon_ok(daemon)
    for r, what, detail in job.notes():
        if r == 0:
            print(f"rank 0: {what}: {detail}")
    print(f"{world} ranks: {done[0]['checks']} checks on rank 0 in {done[0]['elapsed']:.1f} s")


def test_torchrun(daemon, tmp_path):
    """python -m torch.distributed.run --standalone --nproc_per_node=2: env:// as torchrun sets it."""
    out = tmp_path / "torchrun"
    out.mkdir()
    env = worker_env(0, 2, free_port(), daemon.socket, out, 150)
    for k in ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]:
        env.pop(k)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max_restarts=0",
           "--log-dir", str(out / "logs"), "--redirects", "3", str(WORKER), "torchrun"]
    with open(out / "torchrun.log", "w") as log:
        try:
            rc = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                timeout=170).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout (170 s)"
    logs = [str(p) for p in sorted((out / "logs").rglob("*.log"))] if (out / "logs").exists() else []
    detail = tail(out / "torchrun.log", 30) + "".join(f"\n--- {p} ---\n{tail(p, 30)}" for p in logs)
    import json
    recs = []
    for r in range(2):
        p = out / f"rank{r}.jsonl"
        recs.append([json.loads(line) for line in p.read_text().splitlines()] if p.exists() else [])
    fails = [f"rank {r}: {x['what']}: {x['detail']}" for r in range(2) for x in recs[r] if x["kind"] == "fail"]
    finished = [any(x["kind"] == "done" for x in recs[r]) for r in range(2)]
    assert rc == 0 and all(finished) and not fails, (
        f"torchrun exit {rc}, finished {finished}\n" + "\n".join(fails[:30]) + "\n" + detail)
    daemon_ok(daemon)
