"""DDP over the backend: 20 steps of a small model give Gloo's parameters (same seeds, same data),
also with comm hooks that go through the work's future (worker.py scenario_ddp)."""
from conftest import daemon_ok


def test_ddp_matches_gloo(daemon, launch):
    job = launch("ddp", 3, daemon, timeout=200)
    job.assert_clean()
    daemon_ok(daemon)
    for r, what, detail in job.notes():
        if r == 0:
            print(f"rank 0: {what}: {detail}")
