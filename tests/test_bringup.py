"""One-command bring-up: `make up | bench | down`, scripts/runpod_up.sh, the Docker entrypoint.

`make up` here serves the tiny model on CPU on a free port, with its log, pid file and data in a
temp dir, so it never meets a developer's own `make up`; `make down` runs whatever happens.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from server_fixtures import free_port

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = ("MODEL", "DEVICES", "HOST", "PORT", "API_KEY", "GPTOSS_MAX_API_KEY", "LOGS", "PIDFILE", "SERVE_ARGS")
MAKE_STATE = ("MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKEOVERRIDES")
RUNPOD = ("RUNPOD_POD_ID", "RUNPOD_PUBLIC_IP", "RUNPOD_TCP_PORT_8000", "REQUIRE_GPU", "HF_TOKEN")


def clean_env(**extra: str | Path) -> dict[str, str]:
    """This environment less anything that would steer make or the scripts from outside the test."""
    env = {k: v for k, v in os.environ.items() if k not in SETTINGS + MAKE_STATE + RUNPOD}
    env.update({k: str(v) for k, v in extra.items()})
    return env


def make(*args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    cmd = ["make", "--no-print-directory", "-C", str(ROOT), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL)


def port_free(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def curl(*args: str) -> tuple[int, str]:
    """(HTTP status, body) of one curl call."""
    out = subprocess.run(["curl", "-sS", "--max-time", "300", "-w", "\n%{http_code}", *args],
                         capture_output=True, text=True, timeout=330, check=True).stdout  # fmt: skip
    body, _, code = out.rpartition("\n")
    return int(code), body


def output(proc: subprocess.CompletedProcess[str]) -> str:
    return proc.stdout + proc.stderr


@pytest.mark.slow
def test_make_up_serves_then_make_down_stops_it(tmp_path):
    port, key = free_port(), "bringup-test-key-7f3a"
    logs = tmp_path / "logs"
    settings = [f"PORT={port}", f"LOGS={logs}", "HOST=127.0.0.1", "MODEL=auto", "DEVICES=cpu", f"API_KEY={key}",
                "UP_TIMEOUT=1500", "SERVE_ARGS=--max-batch-size 1 --max-length 2048"]  # fmt: skip
    env = clean_env(GPTOSS_MAX_DATA=tmp_path / "data")
    base = f"http://127.0.0.1:{port}"
    pid = None
    t0 = time.monotonic()
    try:
        up = make("up", *settings, env=env, timeout=1800)
        log = (logs / "server.log").read_text(errors="replace") if (logs / "server.log").exists() else ""
        assert up.returncode == 0, output(up) + log[-4000:]
        print(f"make up: {time.monotonic() - t0:.0f} s")
        pid = int((logs / "server.pid").read_text().split()[0])
        assert f"gptoss-max is up: {base}" in up.stdout and "curl -s" in up.stdout
        assert key not in output(up)

        code, body = curl(f"{base}/health")
        assert code == 200 and json.loads(body)["status"] == "ok"
        model = json.loads(body)["model"]
        request = json.dumps({"model": model, "input": "Say hi", "max_output_tokens": 8})
        responses = [f"{base}/v1/responses", "-H", "content-type: application/json", "-d", request]
        assert curl(*responses)[0] == 401
        code, body = curl(*responses, "-H", f"Authorization: Bearer {key}")
        assert code == 200, body
        resp = json.loads(body)
        assert resp["object"] == "response" and resp["status"] in ("completed", "incomplete")
        assert 1 <= resp["usage"]["output_tokens"] <= 8

        again = make("up", *settings, env=env)
        assert again.returncode == 0 and f"already running (pid {pid}" in again.stdout, output(again)
        runpod = subprocess.run([str(ROOT / "scripts" / "runpod_up.sh")], capture_output=True, text=True, timeout=600,
                                env={**env, **dict(s.split("=", 1) for s in settings), "REQUIRE_GPU": "0"})  # fmt: skip
        assert runpod.returncode == 0, output(runpod)
        assert f"already running (pid {pid}" in runpod.stdout and f"on the pod:   {base}" in runpod.stdout
        assert key not in output(runpod)
        bench = make("bench", *settings, "BENCH_N=2", "BENCH_TOKENS=8", env=env, timeout=600)
        assert bench.returncode == 0, output(bench)
        assert json.loads(bench.stdout[bench.stdout.index("{") :])["output_tokens"] == 16
        assert make("status", *settings, env=env).returncode == 0
    finally:
        down = make("down", *settings, env=env, timeout=300)
    assert down.returncode == 0 and "stopped" in down.stdout, output(down)
    assert pid is not None and not alive(pid) and not group_alive(pid)
    assert port_free(port)
    assert not (logs / "server.pid").exists()
    assert key not in (logs / "server.log").read_text(errors="replace")
    assert "nothing to stop" in make("down", *settings, env=env).stdout


def test_make_down_leaves_a_process_that_is_not_the_server_alone(tmp_path):
    pidfile = tmp_path / "server.pid"
    sleeper = subprocess.Popen(["sleep", "120"])
    try:
        pidfile.write_text(f"{sleeper.pid}\nhttp://127.0.0.1:1\n")
        down = make("down", f"PIDFILE={pidfile}", env=clean_env())
        assert down.returncode == 0, output(down)
        assert "no longer runs gptoss-max serve" in down.stdout
        assert sleeper.poll() is None
        assert not pidfile.exists()
    finally:
        sleeper.send_signal(signal.SIGKILL)
        sleeper.wait()
    assert "nothing to stop" in make("down", f"PIDFILE={pidfile}", env=clean_env()).stdout


def test_make_up_refuses_a_port_in_use(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        up = make("up", f"PORT={port}", f"LOGS={tmp_path}", "HOST=127.0.0.1", env=clean_env())
    assert up.returncode != 0
    assert f"port {port} is in use" in up.stderr
    assert not (tmp_path / "server.pid").exists()


def fake_nvidia_smi(tmp_path: Path, script: str) -> dict[str, str]:
    """An environment whose PATH starts with a stand-in nvidia-smi running `script`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\n{script}\n")
    smi.chmod(0o755)
    return clean_env(PATH=f"{bin_dir}:{os.environ['PATH']}")


def runpod_check(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    cmd = [str(ROOT / "scripts" / "runpod_up.sh"), "--check"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, stdin=subprocess.DEVNULL)


NO_DRIVER = "echo 'NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver.'; exit 9"


def test_runpod_check_needs_a_gpu_unless_told_otherwise(tmp_path):
    env = fake_nvidia_smi(tmp_path, NO_DRIVER)
    strict = runpod_check(env)
    assert strict.returncode == 1, output(strict)
    assert "FAIL  nvidia-smi failed: NVIDIA-SMI has failed" in strict.stdout
    assert "nothing installed or started" in strict.stdout

    relaxed = runpod_check({**env, "REQUIRE_GPU": "0"})
    assert relaxed.returncode == 0, output(relaxed)
    assert "going on without a GPU" in relaxed.stdout
    assert "MODEL=auto -> a tiny random gpt-oss" in relaxed.stdout
    assert "Plan: make install-serve" in relaxed.stdout
    assert "make up MODEL=auto DEVICES=auto HOST=0.0.0.0 PORT=8000" in relaxed.stdout


def test_runpod_check_on_a_gpu_pod_prints_the_plan_and_endpoints(tmp_path):
    rows = "echo '0, NVIDIA H100 80GB HBM3, 81559, 535.104.05'; echo '1, NVIDIA H100 80GB HBM3, 81559, 535.104.05'"
    env = fake_nvidia_smi(tmp_path, rows)
    env.update(RUNPOD_POD_ID="abc123xyz", RUNPOD_PUBLIC_IP="203.0.113.7", RUNPOD_TCP_PORT_8000="40123")
    env["HF_TOKEN"] = "hf_SecretToken123"
    check = runpod_check(env)
    assert check.returncode == 0, output(check)
    out = check.stdout
    assert "GPU 0: NVIDIA H100 80GB HBM3, 81559 MiB, driver 535.104.05" in out and "GPU 1:" in out
    assert "driver 535 is older than 550" in out
    assert "MODEL=auto -> openai/gpt-oss-20b" in out
    assert "HF_TOKEN is set" in out and "hf_SecretToken123" not in out
    assert "no API_KEY: anyone who can reach port 8000" in out
    assert "https://abc123xyz-8000.proxy.runpod.net" in out and "http://203.0.113.7:40123" in out

    keyed = runpod_check({**env, "API_KEY": "secret-value", "MODEL": "openai/gpt-oss-120b", "PORT": "9000"})
    assert keyed.returncode == 0, output(keyed)
    assert "API_KEY is set" in keyed.stdout and "secret-value" not in keyed.stdout
    assert "MODEL=openai/gpt-oss-120b -> openai/gpt-oss-120b" in keyed.stdout
    assert "wants a GPU" not in keyed.stdout
    assert "https://abc123xyz-9000.proxy.runpod.net" in keyed.stdout


def test_runpod_check_warns_of_a_small_gpu(tmp_path):
    check = runpod_check(fake_nvidia_smi(tmp_path, "echo '0, Tesla T4, 15360, 570.86.15'"))
    assert check.returncode == 0, output(check)
    assert "openai/gpt-oss-20b wants a GPU with ~16 GB or more" in check.stdout
    assert "older than" not in check.stdout


def test_docker_entrypoint_maps_the_environment_to_serve_flags(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "gptoss-max"
    fake.write_text('#!/bin/sh\necho "key=${GPTOSS_MAX_API_KEY:-}"\nfor a in "$@"; do echo "$a"; done\n')
    fake.chmod(0o755)
    env = clean_env(PATH=f"{bin_dir}:{os.environ['PATH']}")
    entry = [str(ROOT / "scripts" / "docker_entrypoint.sh")]

    default = subprocess.run(entry, capture_output=True, text=True, env=env, check=True).stdout.split("\n")
    assert default[:-1] == ["key=", "serve", "--model", "auto", "--devices", "auto", "--host", "0.0.0.0",
                            "--port", "8000"]  # fmt: skip

    env.update(MODEL="openai/gpt-oss-120b", DEVICES="gpu:0,1", PORT="9000", API_KEY="k1", ENABLE_BENCH="1")
    custom = subprocess.run([*entry, "--max-batch-size", "4"], capture_output=True, text=True, env=env, check=True)
    assert custom.stdout.split("\n")[:-1] == [
        "key=k1", "serve", "--model", "openai/gpt-oss-120b", "--devices", "gpu:0,1", "--host", "0.0.0.0",
        "--port", "9000", "--max-batch-size", "4", "--enable-bench",
    ]  # fmt: skip


def test_dockerfile_and_scripts_lint_clean():
    lint = make("lint-ops", env=clean_env(), timeout=600)
    assert lint.returncode == 0, output(lint)
