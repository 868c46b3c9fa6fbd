"""The samples run against the tiny bundle: the console ones in a subprocess, the Tk window under Xvfb."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

SAMPLES = Path(__file__).resolve().parents[2] / "samples"


def run_sample(*args, env=None, timeout=60):
    return subprocess.run(
        [sys.executable, *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env, cwd=SAMPLES.parent
    )


def test_stream_sample(tiny_bundle):
    res = run_sample(SAMPLES / "stream.py", tiny_bundle, "Hello there")
    assert res.returncode == 0, res.stderr
    assert "tokens per target pass" in res.stdout


def test_multi_turn_sample(tiny_bundle):
    res = run_sample(SAMPLES / "multi_turn.py", tiny_bundle, 12)
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("assistant:") == 3


def free_display() -> int:
    for n in range(90, 140):
        if not Path(f"/tmp/.X{n}-lock").exists() and not Path(f"/tmp/.X11-unix/X{n}").exists():
            return n
    pytest.skip("no free X display number")


@pytest.fixture
def xvfb_display():
    if shutil.which("Xvfb") is None:
        pytest.skip("Xvfb is not installed (apt-get install xvfb)")
    display = f":{free_display()}"
    proc = subprocess.Popen(
        ["Xvfb", display, "-screen", "0", "800x600x24", "-nolisten", "tcp"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while not Path(f"/tmp/.X11-unix/X{display[1:]}").exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.skip(f"Xvfb did not start on {display}")
            time.sleep(0.05)
        yield display
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_chat_window_streams_and_stops(tiny_bundle, xvfb_display):
    code = (
        "import sys; sys.path.insert(0, 'samples'); from chat_window import run_once; "
        f"r = run_once({str(tiny_bundle)!r}, 'hello', max_new_tokens=200); "
        "print('FINISH', r.finish_reason, r.stats.new_tokens, len(r.text))"
    )
    res = run_sample("-c", code, env={**os.environ, "DISPLAY": xvfb_display})
    assert res.returncode == 0, res.stderr
    finish, new_tokens, chars = res.stdout.split("FINISH ")[1].split()
    assert finish == "cancelled" and 0 < int(new_tokens) < 200 and int(chars) > 0


def test_openai_client_sample(tiny_bundle, tmp_path):
    from tests.serve.test_serve import KEY, Served

    server = Served(Path(tiny_bundle), tmp_path / "server.log", "--api-key", KEY)
    try:
        res = run_sample(SAMPLES / "openai_client.py", server.url + "/v1", KEY)
    finally:
        server.stop()
    assert res.returncode == 0, res.stderr
    assert "per target pass, method auto]" in res.stdout and res.stdout.rstrip().endswith("]")
