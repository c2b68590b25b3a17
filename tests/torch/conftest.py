"""Harness of the torch.distributed backend tests: a real collectived, real rank processes.

Environment:
  COLLECTIVED_BIN       the daemon (default: build/bin/collectived of this checkout)
  PYTHONPATH            must reach collectived_torch (build/python); ctest sets it
  TT_BACKEND            backend under test (collectived); "gloo" runs the harness with Gloo
                        standing in, where the backend is not built (the daemon-specific checks skip);
                        "nccl" with TT_DEVICE=cuda and LD_PRELOAD=.../libnccl.so.2 runs torch's own
                        NCCL backend over collectived's libnccl (issue L; scripts/nccl-torch-check)
  TT_DEVICE             cpu (default) or cuda (ranks share GPU 0 when there is one GPU)

Every rank process has a hard timeout twice over: faulthandler inside it (stacks in its log,
then exit) and a SIGKILL from here. Logs and records of a failed test are printed with it and
stay under pytest's tmp_path.
"""
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[1]
WORKER = HERE / "worker.py"
BACKEND = os.environ.get("TT_BACKEND", "collectived")
NODE_NAME = "torchtest-node"


def collectived_bin():
    return pathlib.Path(os.environ.get("COLLECTIVED_BIN") or REPO / "build" / "bin" / "collectived")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(path, n=60):
    try:
        lines = pathlib.Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return f"({path}: none)"
    return "\n".join(lines[-n:])


class Daemon:
    """collectived in the foreground on a private socket; ready when the socket exists."""

    def __init__(self, directory, sets=()):
        self.dir = pathlib.Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.socket = self.dir / "cd.sock"
        self.log = self.dir / "daemon.log"
        self.proc = None
        binary = collectived_bin()
        if not binary.exists():
            if BACKEND == "collectived":
                pytest.fail(f"{binary} does not exist: build it (scripts/build) or set COLLECTIVED_BIN")
            return  # Gloo standing in: no daemon needed
        args = [str(binary), "--set", f"client.socket={self.socket}", "--set", "client.socket_mode=0666",
                "--set", f"node.name={NODE_NAME}", "--set", "log.level=info"]
        for s in sets:
            args += ["--set", s]
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log)
        t0 = time.time()
        while not self.socket.exists():
            if self.proc.poll() is not None or time.time() - t0 > 15:
                self.kill()
                pytest.fail(f"collectived did not come up (socket {self.socket}):\n{tail(self.log)}")
            time.sleep(0.02)

    @property
    def pid(self):
        return self.proc.pid if self.proc else None

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def kill(self, sig=signal.SIGKILL):
        if self.alive():
            self.proc.send_signal(sig)

    def stop(self):
        if not self.alive():
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return "killed after SIGTERM did not stop it in 15 s"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("daemon"))
    yield d
    d.stop()


@pytest.fixture
def fresh_daemon(tmp_path):
    """A daemon of the test's own (for tests that kill it or leave broken communicators)."""
    d = Daemon(tmp_path / "daemon")
    yield d
    d.stop()


def worker_env(rank, world, port, socket_path, out, hard_timeout, extra=None):
    env = dict(os.environ)
    pp = [str(REPO / "build" / "python")]
    if env.get("PYTHONPATH"):
        pp.insert(0, env["PYTHONPATH"])
    env.update(
        PYTHONPATH=os.pathsep.join(pp), COLLECTIVED_SOCKET=str(socket_path), MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world), TT_OUT=str(out), TT_BACKEND=BACKEND, TT_HARD_TIMEOUT=str(hard_timeout),
        OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1", PYTHONUNBUFFERED="1", GLOO_SOCKET_IFNAME="lo",
        PYTHONWARNINGS="ignore")
    env.update(extra or {})
    return env


class Job:
    """`world` rank processes of worker.py SCENARIO; records in out/rankR.jsonl, logs in out/rankR.log."""

    def __init__(self, scenario, world, daemon, out, timeout=180, args=(), env=None):
        self.scenario, self.world, self.daemon, self.out, self.timeout = scenario, world, daemon, out, timeout
        self.out.mkdir(parents=True, exist_ok=True)
        self.t0 = time.time()
        port = free_port()
        self.procs = []
        for r in range(world):
            log = open(self.out / f"rank{r}.log", "w")
            e = worker_env(r, world, port, daemon.socket, out, max(timeout - 10, 10), env)
            self.procs.append(subprocess.Popen([sys.executable, str(WORKER), scenario, *map(str, args)], env=e,
                                               stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT))
            log.close()

    def records(self, rank):
        p = self.out / f"rank{rank}.jsonl"
        if not p.exists():
            return []
        recs = []
        for line in p.read_text().splitlines():
            try:
                recs.append(json.loads(line))
            except ValueError:
                pass  # a line cut by a kill
        return recs

    def find(self, rank, kind):
        return [r for r in self.records(rank) if r["kind"] == kind]

    def wait_for(self, kind, ranks, timeout):
        """Until every rank in `ranks` wrote a record of `kind`; False on timeout or when one exited."""
        t0 = time.time()
        while time.time() - t0 < timeout:
            if all(self.find(r, kind) for r in ranks):
                return True
            if any(self.procs[r].poll() is not None for r in ranks):
                return all(self.find(r, kind) for r in ranks)
            time.sleep(0.05)
        return False

    def wait(self, ranks=None):
        """Waits (hard deadline: the job's timeout from its start) and returns the exit codes."""
        ranks = range(self.world) if ranks is None else ranks
        for r in ranks:
            left = self.timeout - (time.time() - self.t0)
            try:
                self.procs[r].wait(max(left, 0.1))
            except subprocess.TimeoutExpired:
                self.kill_all()
                pytest.fail(f"{self.scenario}: rank {r} still running after {self.timeout} s (killed)\n"
                            + self.logs())
        return [self.procs[r].returncode for r in ranks]

    def kill_all(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()

    def logs(self, n=40):
        parts = []
        for r in range(self.world):
            parts.append(f"--- rank {r} log (last {n} lines) ---\n{tail(self.out / f'rank{r}.log', n)}")
        if self.daemon is not None and getattr(self.daemon, "log", None):
            parts.append(f"--- daemon log ---\n{tail(self.daemon.log, n)}")
        return "\n".join(parts)

    def failures(self):
        out = []
        for r in range(self.world):
            for rec in self.find(r, "fail"):
                out.append(f"rank {r}: {rec['what']}: {rec['detail']}")
        return out

    def assert_clean(self, max_shown=40):
        """Every rank exited 0 after its 'done' record, with no failed check."""
        codes = self.wait()
        fails = self.failures()
        problems = []
        for r, c in enumerate(codes):
            if c != 0:
                problems.append(f"rank {r} exited with {c}")
            if not self.find(r, "done"):
                problems.append(f"rank {r} never finished")
        if fails or problems:
            shown = "\n".join(fails[:max_shown])
            more = f"\n... and {len(fails) - max_shown} more" if len(fails) > max_shown else ""
            pytest.fail(f"{self.scenario} on {self.world} ranks: {len(fails)} failed checks; "
                        f"{'; '.join(problems)}\n{shown}{more}\n{self.logs(25)}")
        return [self.find(r, "done")[0] for r in range(self.world)]

    def notes(self):
        return [(r, n["what"], n["detail"]) for r in range(self.world) for n in self.find(r, "note")]

    def __del__(self):
        try:
            self.kill_all()
        except Exception:  # noqa: BLE001
            pass


@pytest.fixture
def launch(tmp_path):
    jobs = []

    def _launch(scenario, world, daemon, timeout=180, args=(), env=None, name=None):
        job = Job(scenario, world, daemon, tmp_path / (name or f"{scenario}-{world}"), timeout, args, env)
        jobs.append(job)
        return job
    yield _launch
    for j in jobs:
        j.kill_all()


needs_collectived = pytest.mark.skipif(BACKEND != "collectived",
                                       reason=f"the daemon's own behaviour (TT_BACKEND is {BACKEND})")


def daemon_ok(daemon):
    """The daemon survived what the test did to it (a crash is a failure of its own)."""
    if daemon.proc is not None and not daemon.alive():
        pytest.fail(f"collectived exited with {daemon.proc.returncode} during the test:\n{tail(daemon.log)}")
