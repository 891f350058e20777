"""`ray job submit` against a cluster started with `ray start --head`, exactly as a user would."""

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.ray]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_cluster(session_id: int, markers: list[str]) -> None:
    """Stop only this cluster's processes (`ray stop` would stop every cluster on the machine).

    `ray start` ran in its own process session, so its daemons share that session id; the markers catch
    any process that left it.
    """
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or int(pid) == os.getpid():
                continue
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdline = f.read()
                if os.getsid(int(pid)) == session_id or any(m.encode() in cmdline for m in markers):
                    os.kill(int(pid), sig)
            except (OSError, ProcessLookupError):
                pass
        time.sleep(1.0)


def test_ray_job_submit_trains_tiny(tmp_path):
    temp_dir = tempfile.mkdtemp(prefix="erjob-", dir="/tmp")
    bin_dir = os.path.dirname(sys.executable)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    env.pop("RAY_ADDRESS", None)
    gcs_port, dash_port, agent_port, client_port = (_free_port() for _ in range(4))
    start = subprocess.Popen(
        [os.path.join(bin_dir, "ray"), "start", "--head", f"--port={gcs_port}", "--num-cpus=2",
         "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash_port}",
         f"--dashboard-agent-listen-port={agent_port}", f"--ray-client-server-port={client_port}",
         f"--temp-dir={temp_dir}", "--disable-usage-stats"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        start_out, _ = start.communicate(timeout=120)
        assert start.returncode == 0, start_out
        deadline = time.monotonic() + 90
        while True:  # the job agent comes up a few seconds after `ray start` returns
            submit = _submit(bin_dir, dash_port, tmp_path, env)
            if "No available agent" not in submit.stdout + submit.stderr or time.monotonic() > deadline:
                break
            time.sleep(3)
        out = submit.stdout + submit.stderr
        assert submit.returncode == 0, out
        assert "succeeded" in out, out
        assert "run finished: 5 steps" in out, out
        assert os.path.exists(tmp_path / "runs" / "tiny" / "metrics.parquet")
    finally:
        _kill_cluster(start.pid, [temp_dir, f":{gcs_port}"])


def _submit(bin_dir, dash_port, tmp_path, env):
    return subprocess.run(
            [os.path.join(bin_dir, "ray"), "job", "submit", "--address", f"http://127.0.0.1:{dash_port}",
             "--working-dir", REPO, "--", "python", "jobs/train.py", "--config", "jobs/configs/tiny.yaml",
             "--set", "train.steps=5", "--set", f"output_dir={tmp_path}/runs"],
            # `ray start` turns on token authentication; the CLI sends ~/.ray/auth_token in this mode
            env={**env, "RAY_AUTH_MODE": "token"}, capture_output=True, text=True, timeout=300, cwd=REPO,
        )


def test_the_job_entrypoints_help_says_how_it_takes_the_config():
    """`python jobs/train.py --help` is what a user submitting a job reads: it prints `elixir-ray
    train`'s help, which names the config as a positional, so it first says --config PATH works."""
    proc = subprocess.run([sys.executable, "jobs/train.py", "--help"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("jobs/train.py: the entrypoint for `ray job submit`. The config is --config PATH")
    assert "usage: elixir-ray train" in proc.stdout and "--set KEY=VALUE" in proc.stdout


def test_the_job_entrypoint_takes_the_config_once_either_way():
    import importlib.util

    spec = importlib.util.spec_from_file_location("jobs_train", os.path.join(REPO, "jobs", "train.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # its __main__ block does not run
    train_argv = module.train_argv
    assert train_argv(["--config", "tiny", "--set", "train.steps=1", "--resume", "ckpt", "--quiet"]) == [
        "train", "tiny", "--set", "train.steps=1", "--resume", "ckpt", "--quiet"]
    assert train_argv(["--config=tiny"]) == train_argv(["tiny"]) == ["train", "tiny"]
    with pytest.raises(ValueError, match=r"the config is given 2 times \(tiny, jobs/configs/tiny.yaml\): give it once"):
        train_argv(["--config", "tiny", "jobs/configs/tiny.yaml"])
    proc = subprocess.run([sys.executable, "jobs/train.py", "--config", "tiny", "tiny"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("jobs/train.py: error: the config is given 2 times")
