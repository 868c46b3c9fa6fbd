"""A `specdec-edge serve` process in a subprocess, and the bundles the serve tests start it with."""

from __future__ import annotations

import contextlib
import json
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from tests.tiny_models import make_model

ROOT = Path(__file__).resolve().parents[2]
KEY = "test-key-123"
LONG = 16000  # new tokens the long bundle can give: over 10 s of generation here, far beyond --timeout 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """A `specdec-edge serve` process and how to reach it."""

    def __init__(self, bundle: Path, log: Path, *args: str, files: tuple[int, int] | None = None):
        """``files``: the (soft, hard) limit of open files the server starts with."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = bundle.name
        self.log = log
        command = [sys.executable, "-c", "from specdec_edge.cli import main; main()", "serve", str(bundle)]
        command += ["--port", str(self.port), "--threads", "1", *args]
        with open(log, "w") as out:
            limit = (lambda: resource.setrlimit(resource.RLIMIT_NOFILE, files)) if files else None
            self.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, preexec_fn=limit)
        self.http = httpx.Client(base_url=self.url, timeout=60)  # one client: each new one costs ~0.1 s here
        deadline = time.monotonic() + 120
        while True:
            assert self.proc.poll() is None, f"the server exited:\n{log.read_text()}"
            with contextlib.suppress(httpx.TransportError):
                if self.http.get("/health", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, f"the server did not come up:\n{log.read_text()}"
            time.sleep(0.2)

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0, **kw)

    def post(self, path: str, body=None, *, content=None, key: str | None = KEY, **kw) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
        if body is not None:
            content = json.dumps(body)
        return self.http.post(path, content=content, headers=headers, **kw)

    def metrics(self) -> dict[str, float]:
        text = self.http.get("/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
        return out

    def queue(self) -> int:
        return self.http.get("/health").json()["queue"]

    def wait_idle(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while self.queue() > 0:
            assert time.monotonic() < deadline, "the server did not get idle"
            time.sleep(0.02)

    def stop(self) -> None:
        self.http.close()
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def long_base_bundle(tmp_path_factory) -> Path:
    """A tiny base model without a chat template, with room for LONG new tokens."""
    from specdec_edge.export.exporter import export_bundle

    model = make_model(tmp_path_factory.mktemp("models") / "long-base", layers=2, seed=0, max_position_embeddings=16384)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    out = tmp_path_factory.mktemp("bundles") / "long-base"
    return export_bundle(str(model), out, capacity=16384, progress=False)


def slow_server(long_bundle: Path, tmp_path_factory):
    """The long bundle, plain decoding, one waiting request at most, a 3-second timeout (a generator fixture body)."""
    log = tmp_path_factory.mktemp("serve") / "slow.log"
    server = Served(Path(long_bundle), log, "--method", "plain", "--max-queue", "1", "--timeout", "3", "--api-key", KEY)
    yield server
    server.stop()
