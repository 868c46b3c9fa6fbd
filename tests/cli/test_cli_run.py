"""`chat` and `generate` driven through click's CliRunner."""

from __future__ import annotations

import json

from click.testing import CliRunner

from specdec_edge.api import streaming
from specdec_edge.cli import main


def invoke(*args, input=None):
    return CliRunner().invoke(main, [str(a) for a in args], input=input)


def test_generate_json(tiny_bundle):
    res = invoke(
        "generate", tiny_bundle, "--prompt", "The quick brown fox", "--max-new-tokens", "12", "--json", "--threads", "1"
    )
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)  # progress lines of a first run on this device go to stderr
    assert set(out) == {"text", "token_ids", "stats", "finish_reason"}
    assert out["finish_reason"] in ("eos", "length") and out["stats"]["proposed"] > 0
    plain = json.loads(
        invoke(
            "generate",
            tiny_bundle,
            "--prompt",
            "The quick brown fox",
            "--max-new-tokens",
            "12",
            "--json",
            "--method",
            "plain",
        ).stdout
    )
    assert plain["token_ids"] == out["token_ids"] and plain["stats"]["proposed"] == 0


def test_generate_text_and_sampling_options(tiny_bundle):
    args = [
        "generate",
        tiny_bundle,
        "--prompt",
        "hello",
        "--max-new-tokens",
        "8",
        "--temperature",
        "0.8",
        "--top-k",
        "20",
        "--top-p",
        "0.9",
        "--seed",
        "3",
        "-k",
        "2",
        "--chat-template",
    ]
    a, b = invoke(*args), invoke(*args)
    assert a.exit_code == 0 and a.stdout == b.stdout and "tokens per target pass" in a.stderr


def test_user_errors_are_one_line(tiny_bundle, tmp_path):
    res = invoke("generate", tiny_bundle, "--prompt", "fox " * 300)
    assert res.exit_code == 2 and "KV cache capacity" in res.output and "Traceback" not in res.output
    res = invoke("generate", tmp_path, "--prompt", "x")
    assert res.exit_code == 2 and "not a specdec-edge bundle" in res.output


def test_chat_session(tiny_bundle):
    res = invoke(
        "chat",
        tiny_bundle,
        "--max-new-tokens",
        "10",
        "--system",
        "Be brief.",
        input="hello\n/stats\n/reset\nagain\n/exit\n",
    )
    assert res.exit_code == 0, res.output
    assert '"tokens_per_pass"' in res.output and "(conversation reset)" in res.output
    assert res.output.count("tokens per target pass") == 2


def test_chat_reuses_the_conversation_between_turns(tiny_bundle):
    turns = "hello\nand again\n/stats\n/exit\n"
    res = invoke("chat", tiny_bundle, "--max-new-tokens", "6", input=turns)
    assert res.exit_code == 0, res.output
    assert res.output.count("prompt tokens reused") == 1  # the second turn's line, not the first's
    assert '"reused_tokens": 0' not in res.output  # /stats: the last answer's
    res = invoke("chat", tiny_bundle, "--max-new-tokens", "6", "--no-reuse", input=turns)
    assert res.exit_code == 0, res.output
    assert "prompt tokens reused" not in res.output and '"reused_tokens": 0' in res.output


def test_chat_ends_on_eof_and_reports_overflow(tiny_bundle):
    res = invoke("chat", tiny_bundle, "--max-new-tokens", "200", input="hello\n" * 3)
    assert res.exit_code == 0, res.output
    assert "KV cache capacity" in res.output and "/reset" in res.output


def test_ctrl_c_stops_the_answer_not_the_chat(tiny_bundle, monkeypatch):
    feed = streaming.StopFilter.feed
    calls = []

    def interrupted(self, text):
        calls.append(text)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return feed(self, text)

    monkeypatch.setattr(streaming.StopFilter, "feed", interrupted)
    res = invoke("chat", tiny_bundle, "--max-new-tokens", "20", input="hello\nagain\n/exit\n")
    assert res.exit_code == 0, res.output
    assert "[stopped]" in res.output and res.output.count("tokens per target pass") == 2


def test_help_has_examples():
    for command in ("chat", "generate"):
        res = invoke(command, "--help")
        assert res.exit_code == 0 and "Examples:" in res.output and "--temperature" in res.output
