"""Failures are answers: a killed rank, a stuck rank, a killed daemon, re-initialisation in the
same process, a missing daemon (worker.py's failure scenarios)."""
import os
import re
import signal
import time
import types

import pytest

from conftest import BACKEND, NODE_NAME, daemon_ok, free_port, needs_collectived


def named(message, rank, pid):
    """What the message lacks of: the rank, its node, its pid."""
    missing = []
    if BACKEND == "gloo":
        return missing  # Gloo standing in names nobody
    if not re.search(rf"rank\D{{0,3}}{rank}\b", message, re.I):
        missing.append(f"rank {rank}")
    if NODE_NAME not in message:
        missing.append(f"node {NODE_NAME}")
    if not re.search(rf"\b{pid}\b", message):
        missing.append(f"pid {pid}")
    return missing


# CUDA tensors: wait() blocks only in blocking-wait mode (as TORCH_NCCL_BLOCKING_WAIT makes
# ProcessGroupNCCL's); without it the failure is raised by the group's next operation.
# (TT_BACKEND=nccl: torch's own NCCL backend over collectived's libnccl.so.2, LD_PRELOAD.)
FAILURE_ENV = ({"COLLECTIVED_TORCH_BLOCKING_WAIT": "1", "TORCH_NCCL_BLOCKING_WAIT": "1"}
               if os.environ.get("TT_DEVICE") == "cuda" else None)


def result_of(job, rank):
    recs = job.find(rank, "result")
    return recs[0] if recs else None


def test_killed_rank(fresh_daemon, launch):
    """SIGKILL of the last of 3 ranks in a loop of all-reduces: the others' wait() raise a
    RuntimeError naming it (rank, node, pid) at once, well inside the group timeout (40 s)."""
    job = launch("killed", 3, fresh_daemon, timeout=150, args=[40], env=FAILURE_ENV)
    assert job.wait_for("ready", range(3), 100), "ranks never got going\n" + job.logs()
    victim = job.procs[2].pid
    time.sleep(0.3)
    t_kill = time.time()
    os.kill(victim, signal.SIGKILL)
    job.wait([0, 1])
    problems = []
    for r in [0, 1]:
        res = result_of(job, r)
        if res is None:
            problems.append(f"rank {r}: no result")
            continue
        if not res.get("raised"):
            problems.append(f"rank {r}: nothing raised in {res.get('iterations')} iterations after the kill")
            continue
        dt = res["t_raise"] - t_kill
        msg = res["message"]
        if not res["is_runtime_error"]:
            problems.append(f"rank {r}: raised {res['raised']}, not a RuntimeError")
        if dt > 15:
            problems.append(f"rank {r}: raised {dt:.1f} s after the kill (want < 15 s: a dead rank is seen at once)")
        miss = named(msg, 2, victim)
        if miss:
            problems.append(f"rank {r}: the message does not name {', '.join(miss)}")
        if res.get("next_raised") is None or res.get("next_s", 99) > 15:
            problems.append(f"rank {r}: the next all_reduce after the failure: raised {res.get('next_raised')} "
                            f"after {res.get('next_s', 0):.1f} s")
        print(f"rank {r}: raised {dt:.2f} s after the kill: {msg[:300]!r}; next op: {res.get('next_raised')} "
              f"in {res.get('next_s', 0):.2f} s: {res.get('next_message', '')[:200]!r}")
    assert not problems, "\n".join(problems) + "\n" + "\n".join(
        f"rank {r} message: {(result_of(job, r) or {}).get('message', '')[:600]}" for r in [0, 1]) + "\n" + job.logs()
    daemon_ok(fresh_daemon)


def test_stuck_rank(fresh_daemon, launch):
    """The last of 3 ranks stays alive and stops calling; timeout=timedelta(seconds=3): the
    others' wait() raise a RuntimeError naming it at 3 s (+ margin), not before."""
    job = launch("stuck", 3, fresh_daemon, timeout=120, args=[3], env=FAILURE_ENV)
    stuck_pid = job.procs[2].pid
    try:
        assert job.wait_for("ready", range(3), 90), "ranks never got going\n" + job.logs()
        job.wait([0, 1])
    finally:
        (job.out / "release").touch()
    job.wait([2])
    problems = []
    for r in [0, 1]:
        res = result_of(job, r)
        if res is None:
            problems.append(f"rank {r}: no result")
            continue
        dt = res["t_raise"] - res["t_submit"]
        if not res.get("raised"):
            problems.append(f"rank {r}: all_reduce with a stuck peer returned after {dt:.1f} s without error")
            continue
        if not res["is_runtime_error"]:
            problems.append(f"rank {r}: raised {res['raised']}, not a RuntimeError")
        if not 2.5 <= dt <= 3 + 5:
            problems.append(f"rank {r}: raised after {dt:.2f} s; the group timeout is 3 s")
        miss = named(res["message"], 2, stuck_pid)
        if miss:
            problems.append(f"rank {r}: the message does not name {', '.join(miss)}")
        if res.get("next_raised") is None or res.get("next_s", 99) > 3 + 5:
            problems.append(f"rank {r}: the next all_reduce: raised {res.get('next_raised')} after "
                            f"{res.get('next_s', 0):.1f} s")
        print(f"rank {r}: raised after {dt:.2f} s: {res['message'][:300]!r}; next op: {res.get('next_raised')} in "
              f"{res.get('next_s', 0):.2f} s")
    assert not problems, "\n".join(problems) + "\n" + "\n".join(
        f"rank {r} message: {(result_of(job, r) or {}).get('message', '')[:600]}" for r in [0, 1]) + "\n" + job.logs()
    daemon_ok(fresh_daemon)


@needs_collectived
def test_daemon_killed(fresh_daemon, launch):
    """SIGKILL of the daemon while 2 ranks loop all-reduces: every rank raises, none hangs."""
    job = launch("daemon_killed", 2, fresh_daemon, timeout=150)
    assert job.wait_for("ready", range(2), 100), "ranks never got going\n" + job.logs()
    time.sleep(0.3)
    t_kill = time.time()
    fresh_daemon.kill(signal.SIGKILL)
    job.wait()
    problems = []
    for r in [0, 1]:
        res = result_of(job, r)
        if res is None:
            problems.append(f"rank {r}: no result")
            continue
        if not res.get("raised"):
            problems.append(f"rank {r}: nothing raised in {res.get('iterations')} iterations after the kill")
            continue
        dt = res["t_raise"] - t_kill
        if not res["is_runtime_error"]:
            problems.append(f"rank {r}: raised {res['raised']}, not a RuntimeError")
        if dt > 20:
            problems.append(f"rank {r}: raised {dt:.1f} s after the daemon died (want < 20 s)")
        if res.get("next_raised") is None or res.get("next_s", 99) > 15:
            problems.append(f"rank {r}: the next all_reduce: raised {res.get('next_raised')} after "
                            f"{res.get('next_s', 0):.1f} s")
        print(f"rank {r}: raised {dt:.2f} s after the kill: {res['message'][:300]!r}; next: "
              f"{res.get('next_message', '')[:200]!r}")
    assert not problems, "\n".join(problems) + "\n" + job.logs()


def test_reinit_after_destroy(daemon, launch):
    """destroy_process_group(), then init again in the same process, six times: env://, tcp://,
    file://; nothing leaks (descriptors, memfd mappings)."""
    job = launch("reinit", 2, daemon, timeout=180, args=[free_port()])
    job.assert_clean()
    daemon_ok(daemon)
    for r, what, detail in job.notes():
        if r == 0:
            print(f"rank 0: {what}: {detail}")


@needs_collectived
def test_missing_daemon(launch, tmp_path):
    """COLLECTIVED_SOCKET names nothing: a RuntimeError that says what was tried and the fix."""
    sock = tmp_path / "no-daemon-here" / "cd.sock"
    job = launch("missing_daemon", 1, types.SimpleNamespace(socket=sock, log=None), timeout=60)
    job.wait()
    res = result_of(job, 0)
    assert res is not None, job.logs()
    problems = []
    if not res.get("raised"):
        problems.append("no error: init_process_group and an all_reduce worked without a daemon")
    else:
        msg = res["message"]
        if not res["is_runtime_error"]:
            problems.append(f"raised {res['raised']}, not a RuntimeError")
        if str(sock) not in msg:
            problems.append(f"the message does not name the socket tried ({sock})")
        if "COLLECTIVED_SOCKET" not in msg:
            problems.append("the message does not name COLLECTIVED_SOCKET (the fix)")
        if res["seconds"] > 15:
            problems.append(f"took {res['seconds']:.1f} s to fail")
        print(f"raised at {res.get('stage')} after {res['seconds']:.2f} s: {msg!r}")
    assert not problems, "\n".join(problems) + f"\nmessage: {res.get('message')!r}\n" + job.logs()
