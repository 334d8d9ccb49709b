"""rft_serving.supervise with real processes: what a restart and a stop leave behind, and
what its log shows of the engine's command line."""

from __future__ import annotations

import sys
from pathlib import Path

import psutil

from rft_serving.supervise import Supervisor, redacted
from tests.conftest import wait_for

# A leader that leaves a helper behind in its process group (as vLLM's API server can
# leave its EngineCore) and exits at once.
LEAVES_A_HELPER = ("import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', "
                   "'import time; time.sleep(300)']); open(sys.argv[1], 'w').write(str(p.pid))")


def test_a_restart_also_ends_the_helpers_of_an_engine_that_already_exited(tmp_path: Path):
    pid_file = tmp_path / "helper.pid"
    sup = Supervisor([sys.executable, "-c", LEAVES_A_HELPER, str(pid_file)], stop_timeout=5)
    sup.start()
    try:
        wait_for(lambda: pid_file.exists() and pid_file.read_text() and sup.proc.poll() is not None, 30,
                 "the leader to exit, its helper left running")
        helper = psutil.Process(int(pid_file.read_text()))
        assert helper.is_running()
        pid_file.unlink()
        sup.restart("the engine died")
        wait_for(lambda: not helper.is_running() or helper.status() == psutil.STATUS_ZOMBIE, 10,
                 "the old engine's helper to be killed")
        assert sup.restarts == 1
    finally:
        sup._stopping = True
        sup._stop_group()


def test_no_restart_once_the_pod_is_stopping(tmp_path: Path):
    sup = Supervisor([sys.executable, "-c", "import time; time.sleep(300)"], stop_timeout=5)
    sup.start()
    sup.terminate()
    assert wait_for(lambda: sup.proc.poll() is not None, 30, "the engine to stop")
    first = sup.proc.pid
    status = sup.restart("a probe failed just as the pod was deleted")
    assert sup.restarts == 0 and status["pid"] == first and sup.proc.poll() is not None


def test_credentials_on_the_engines_command_line_are_not_logged():
    command = ["python3", "-m", "vllm.entrypoints.openai.api_server", "--api-key", "s3cr3t",
               "--hf-token=hf_abc", "--tokenizer", "/w/initial", "--max-num-batched-tokens", "512",
               "--client_secret", "x"]
    shown = redacted(command)
    assert "s3cr3t" not in shown and "--hf-token=hf_abc" not in shown and "x" not in shown
    assert shown[shown.index("--api-key") + 1] == "<redacted>" and "--hf-token=<redacted>" in shown
    # Flags that only look alike keep their values.
    assert shown[shown.index("--tokenizer") + 1] == "/w/initial"
    assert shown[shown.index("--max-num-batched-tokens") + 1] == "512"
