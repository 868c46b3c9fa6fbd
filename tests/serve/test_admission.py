"""A request is tokenized once and its length checked once, on either path: the server admits it before it queues
it (``Server.admit`` -> ``Pipeline.admit``) and the worker runs the admitted request as it is; a call of the Python
API admits its text itself. Counted through the bundle's real tokenizer (a subclass that counts its encodes), with
the app in this process (Starlette's test client) and its real worker thread.
"""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from specdec_edge import Pipeline
from specdec_edge.api.pipeline import TooLong
from specdec_edge.bundle.manifest import read_manifest
from specdec_edge.errors import SpecdecError
from specdec_edge.serve.app import create_app
from specdec_edge.tokenizer import Tokenizer

TEXT = "The quick brown fox"


class CountingTokenizer(Tokenizer):
    """The bundle's tokenizer, counting the texts it encodes."""

    encodes = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.encodes += 1
        return super().encode(text, add_special_tokens)


@pytest.fixture(scope="module")
def plain(tiny_bundle):
    return Pipeline.load(tiny_bundle, method="plain", threads=1)


@pytest.fixture()
def counted(plain, tiny_bundle):
    """A plain pipeline over ``plain``'s engines whose tokenizer counts (``pipe.tokenizer.encodes``)."""
    tokenizer = CountingTokenizer.from_bundle(tiny_bundle, read_manifest(tiny_bundle).tokenizer)
    return Pipeline(tokenizer, plain.engines, "plain")


def generations(app) -> float:
    """Generations the server's worker ran (every finish reason)."""
    families = app.state.server.metrics.client(0).generations.collect()
    return sum(s.value for f in families for s in f.samples if s.name.endswith("_total"))


def test_a_call_tokenizes_and_checks_its_prompt_once(counted, plain):
    tok, capacity = counted.tokenizer, counted.engines.capacity
    expected = plain.generate(TEXT, max_new_tokens=6, reuse=False).token_ids
    assert counted.generate(TEXT, max_new_tokens=6, reuse=False).token_ids == expected and tok.encodes == 1
    "".join(counted.stream([{"role": "user", "content": TEXT}], max_new_tokens=3))
    assert tok.encodes == 2  # chat messages: the template's text, encoded once
    admitted = counted.admit(TEXT, 6, stop=["never there"])
    assert tok.encodes == 3 and admitted.ids == tuple(plain.encode(TEXT)) and admitted.stops == ("never there",)
    assert counted.generate(admitted, reuse=False).token_ids == expected and tok.encodes == 3  # run as it is
    assert counted.admit(TEXT, None).max_new_tokens == capacity - len(admitted.ids)  # as many as fit
    with pytest.raises(SpecdecError, match="brings its own max_new_tokens and stop"):
        counted.generate(admitted, max_new_tokens=3)
    tok.encodes = 0
    with pytest.raises(TooLong) as refused:  # refused once, in the words it always had
        counted.generate("fox " * 300, max_new_tokens=10)
    n = refused.value.prompt_tokens
    assert tok.encodes == 1 and n == len(plain.encode("fox " * 300)) and n + 10 > capacity
    assert str(refused.value) == (
        f"the prompt has {n} tokens and max_new_tokens is 10: {n + 10} exceeds the KV cache capacity of {capacity} "
        "tokens; shorten the prompt (or the chat history), lower max_new_tokens, or re-export the bundle with a "
        "larger --capacity."
    )


def test_the_server_admits_a_request_once_and_the_worker_runs_it_as_it_is(counted, plain):
    tok, capacity = counted.tokenizer, counted.engines.capacity
    prompt_tokens = len(plain.encode(TEXT))
    body = {"model": "tiny", "prompt": TEXT, "max_tokens": 6, "temperature": 0}
    expected = plain.generate(TEXT, max_new_tokens=6, reuse=False)
    app = create_app(counted, model="tiny")
    with TestClient(app) as client:
        tok.encodes = 0
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected.text
        assert r.json()["usage"]["prompt_tokens"] == prompt_tokens and tok.encodes == 1  # the worker did not encode
        r = client.post("/v1/completions", json={**body, "max_tokens": None})  # OpenAI's default length: 16
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 16 and tok.encodes == 2
        ran = generations(app)
        # each fits, not both: refused at admission, in the server's words, never queued
        r = client.post("/v1/completions", json={**body, "max_tokens": capacity - 2})
        assert r.status_code == 400 and tok.encodes == 3 and generations(app) == ran
        assert r.json()["error"] == {
            "message": f"the prompt takes {prompt_tokens} tokens, plus max_tokens={capacity - 2}: more than the "
            f"{capacity} tokens this model holds in all (its KV cache). Shorten the prompt or lower max_tokens.",
            "type": "invalid_request_error",
            "param": "prompt",
            "code": None,
        }
        messages = [{"role": "user", "content": "fox " * 300}]
        n = len(plain.encode(messages))
        r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": messages})
        assert r.status_code == 400 and tok.encodes == 4 and generations(app) == ran
        assert r.json()["error"]["param"] == "messages" and r.json()["error"]["message"] == (
            f"the messages take {n} tokens: more than the {capacity} tokens this model holds in all (its KV cache). "
            "Shorten the messages."
        )


def test_the_server_reuses_as_its_pipeline_is_loaded(tiny_bundle):
    """``LoadSettings.reuse`` (serve --reuse/--no-reuse) is what the worker's calls do."""
    body = {"model": "tiny", "prompt": TEXT + " jumps over the lazy dog", "max_tokens": 2, "temperature": 0}
    for reuse in (True, False):
        with Pipeline.load(tiny_bundle, method="plain", threads=1, reuse=reuse) as pipe:
            with TestClient(create_app(pipe, model="tiny")) as client:
                client.post("/v1/completions", json=body)
                stats = client.post("/v1/completions", json=body).json()["specdec_edge"]
        assert (stats["reused_prompt_tokens"] > 0) is reuse, stats
