"""One model over several processes (moejax.distributed, ``moejax launch``): 2 processes ×
4 CPU host devices, gloo collectives, against 1 process × 8 devices; the launcher's pieces;
the options' refusals. A killed process ending the run is test_job_hardening's
``test_a_killed_process_gets_no_fake_error_results``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moejax.distributed import (COLLECTIVE_TIMEOUT_FLAG, DistributedOptions, agree, fetch_global,
                                initialize, with_collective_timeout)
from serving.launch import process_commands, supervise

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "tests" / "multi_process_job.py"


def child_env() -> dict[str, str]:
    """The environment of a child process: this test process's, without its host-device
    count (8 here; each child of a 2-process run must ask for 4). Its other XLA flags
    (conftest's fast compiles) are kept."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(flag for flag in env.get("XLA_FLAGS", "").split()
                                if not flag.startswith("--xla_force_host_platform_device_count"))
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def moejax(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "serving.cli", *args], cwd=REPO,
                          env=child_env(), capture_output=True, text=True, timeout=timeout)


def without_timings(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for row in rows:
        row.pop("timings", None)
    return rows


# ------------------------------------------------------------------ 2 x 4 == 1 x 8
@pytest.mark.slow
def test_two_processes_of_four_devices_equal_one_of_eight(tmp_path):
    """async_ep and sync_ep scoring and sync_ep generation over 2 × 4 devices equal the
    same calls in this process over 8 devices, result for result."""
    from tests.multi_process_job import run

    out = tmp_path / "job.json"
    done = moejax("launch", "--processes", "2", "--", sys.executable, str(JOB), str(out),
                  "--devices", "8")
    assert done.returncode == 0, done.stderr[-3000:]
    multi = json.loads(out.read_text())
    single = json.loads(json.dumps(run(8, None)))
    assert set(multi) == {"async_ep", "sync_ep", "generate"}
    for key in ("async_ep", "sync_ep", "generate"):
        assert multi[key] == single[key], key
    assert all(r["error"] is None for r in multi["async_ep"])


@pytest.mark.slow
def test_moejax_score_over_two_processes_writes_one_output(tmp_path):
    """``moejax launch -- moejax score``: process 0 writes the results, equal to one
    process over 8 devices; a bad line still gets its error result."""
    requests = tmp_path / "in.jsonl"
    lines = [json.dumps({"id": i, "prompt": f"x = {i} + {i}\nprint(x)",
                         "candidates": [" yes", " no"]}) for i in range(6)]
    lines.insert(3, "{not json")
    requests.write_text("\n".join(lines) + "\n")
    multi, single = tmp_path / "multi.jsonl", tmp_path / "single.jsonl"
    done = moejax("launch", "--processes", "2", "--", "moejax", "score", str(requests),
                  "-o", str(multi), "--backend", "async_ep", "--devices", "8", "--no-progress")
    assert done.returncode == 0, done.stderr[-3000:]
    # one summary, process 0's: process 1 (which wrote nowhere) speaks in its own log only
    assert "/dev/null" not in done.stderr and done.stderr.count("requests (") == 1
    one = moejax("score", str(requests), "-o", str(single), "--backend", "async_ep",
                 "--devices", "8", "--no-progress")
    assert one.returncode == 0, one.stderr[-3000:]
    rows = without_timings(multi)
    assert rows == without_timings(single)
    assert len(rows) == 7 and rows[3]["error"] is not None
    assert sum(r["error"] is None for r in rows) == 6


def test_collectives_time_out_before_the_heartbeat():
    """A collective stuck on a dead peer must fail before JAX's heartbeat aborts the
    process: half the heartbeat, at least 10 s, and a timeout the user set is kept."""
    flags = "--xla_force_host_platform_device_count=4"
    assert with_collective_timeout(flags, 60) == f"{flags} {COLLECTIVE_TIMEOUT_FLAG}=30"
    assert with_collective_timeout("", 12) == f"{COLLECTIVE_TIMEOUT_FLAG}=10"
    mine = f"{COLLECTIVE_TIMEOUT_FLAG}=99"
    assert with_collective_timeout(mine, 60) == mine


def test_single_device_backends_are_refused_over_processes(tmp_path):
    """resident cannot span processes: both processes stop with the reason, quickly."""
    requests = tmp_path / "in.jsonl"
    requests.write_text(json.dumps({"prompt": "hi", "candidates": [" a", " b"]}) + "\n")
    done = moejax("launch", "--processes", "2", "--grace-seconds", "60", "--", "moejax",
                  "score", str(requests), "-o", str(tmp_path / "o.jsonl"), "--backend",
                  "resident", "--devices", "2", "--no-progress")
    assert done.returncode == 2
    assert "backend 'resident' runs on one device and cannot span the 2 processes" \
        in done.stderr


# ------------------------------------------------------------------ launcher pieces
def test_process_commands_add_the_flags():
    commands = process_commands(["moejax", "score", "in.jsonl"], 3, "127.0.0.1:1234")
    assert len(commands) == 3
    for index, command in enumerate(commands):
        assert command[:3] == [sys.executable, "-m", "serving.cli"]
        assert command[3:] == ["score", "in.jsonl", "--coordinator", "127.0.0.1:1234",
                               "--num-processes", "3", "--process-id", str(index)]
    other = process_commands(["python", "job.py"], 1, "h:1")
    assert other[0][:2] == ["python", "job.py"]


@pytest.mark.parametrize("command, message", [
    ([], "no command"),
    (["moejax", "score", "--process-id", "0"], "must not set --process-id"),
    (["moejax", "score", "--coordinator=h:1"], "must not set --coordinator"),
])
def test_process_commands_refuse(command, message):
    with pytest.raises(ValueError, match=message):
        process_commands(command, 2, "127.0.0.1:1")


def test_supervise_stops_the_rest_after_a_failure():
    """One child fails: its status is returned and a child that would run on is
    terminated after the grace period."""
    fail = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    start = time.monotonic()
    assert supervise([fail, sleeper], grace_seconds=0.5) == 3
    assert time.monotonic() - start < 30
    assert sleeper.poll() is not None
    ok = [subprocess.Popen([sys.executable, "-c", "pass"]) for _ in range(2)]
    assert supervise(ok, grace_seconds=1) == 0


# ------------------------------------------------------------------ options and helpers
@pytest.mark.parametrize("kwargs, message", [
    (dict(coordinator="h:1", num_processes=2), "--process-id missing"),
    (dict(auto=True, num_processes=2), "not both"),
    (dict(coordinator="nohost", num_processes=2, process_id=0), "HOST:PORT"),
    (dict(coordinator="h:1", num_processes=2, process_id=2), r"in \[0, 2\)"),
    (dict(coordinator="h:1", num_processes=0, process_id=0), ">= 1"),
])
def test_distributed_options_refuse(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DistributedOptions(**kwargs)


def test_single_process_helpers_are_identities():
    import jax.numpy as jnp
    import numpy as np

    assert not DistributedOptions().enabled
    assert not DistributedOptions(coordinator="h:1", num_processes=1, process_id=0).enabled
    assert initialize(DistributedOptions()) is False
    assert agree({"theta": 1.5}) == {"theta": 1.5}
    x = jnp.arange(6.0)
    assert fetch_global(x) is x
    np.testing.assert_array_equal(fetch_global(np.ones(2)), np.ones(2))


def test_devices_must_split_over_processes():
    from serving.cli import build_parser
    from serving.cli.distributed import host_devices_per_process

    args = build_parser().parse_args(["score", "x.jsonl", "--devices", "6",
                                      "--num-processes", "4"])
    with pytest.raises(ValueError, match="multiple of --num-processes"):
        host_devices_per_process(args)
    args = build_parser().parse_args(["score", "x.jsonl", "--devices", "8",
                                      "--num-processes", "2"])
    assert host_devices_per_process(args) == 4


@pytest.mark.slow
def test_serve_over_two_processes(tmp_path):
    """``moejax launch -- moejax serve``: process 0 serves, process 1 follows its runs; the
    scores equal one process's (to float rounding: the server batches differently); a
    SIGTERM to the launcher stops both cleanly."""
    import numpy as np

    from serving import Scorer
    from serving.grpc.client import Client

    launcher = subprocess.Popen(
        [sys.executable, "-m", "serving.cli", "launch", "--processes", "2", "--log-dir",
         str(tmp_path), "--", "moejax", "serve", "--backend", "async_ep", "--devices", "8",
         "--port", "0"],
        cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        port = int(launcher.stdout.readline())
        requests = [{"id": i, "prompt": f"total = {i} * 3", "candidates": [" yes", " no"]}
                    for i in range(5)]
        with Client(f"127.0.0.1:{port}") as client:
            deadline = time.monotonic() + 180
            while client.health(timeout=5) != "SERVING":
                assert time.monotonic() < deadline, "the server never became healthy"
                time.sleep(0.5)
            info = client.info()
            served = client.score(requests, timeout=120)
        assert info["devices"] == 8 and info["backend"] == "async_ep"
        assert info["generation"] is False
        local = Scorer("demo", backend="async_ep", devices=8).score(requests, progress=False)
        for got, want in zip(served, local):
            assert got.error is None and got.label == want.label
            np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=1e-5, atol=1e-6)
    finally:
        launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=120)
    follower_log = (tmp_path / "process-1.log").read_text()
    assert launcher.returncode == 0, err[-3000:] + "\nprocess 1:\n" + follower_log[-3000:]
    assert "batches for process 0" in follower_log
    # The follower heard the SIGTERM and waited for process 0's stop; JAX's preemption
    # service (whose SIGTERM handler could hold its exit past the shutdown barrier) is off.
    assert "SIGTERM: stopping when process 0 says so" in follower_log
    assert "preemption_notifier" not in follower_log, follower_log[-3000:]
