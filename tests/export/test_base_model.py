"""Base models (no chat template) in every command: a tiny random Gemma 3 base model through export -> bench -> chat,
and chat templates supplied with --chat-template FILE at export, chat and generate."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from specdec_edge.api.pipeline import Pipeline
from specdec_edge.bundle.manifest import read_manifest
from specdec_edge.cli import main
from specdec_edge.errors import SpecdecError
from specdec_edge.tokenizer import plain_text, read_chat_template
from tests.tiny_models import CHAT_TEMPLATE

PROMPTS = [
    {"question_id": 1, "category": "copy", "turns": ["The quick brown fox jumps over the lazy dog. The quick brown"]},
    {"question_id": 2, "category": "chat", "turns": ["hello", "Summarize the following article."]},
]


def invoke(*args, input=None):
    return CliRunner().invoke(main, [str(a) for a in args], input=input)


@pytest.fixture
def template_file(tmp_path):
    path = tmp_path / "chat.jinja"
    path.write_text(CHAT_TEMPLATE)
    return path


def test_plain_text_joins_turns_as_paragraphs():
    messages = [
        {"role": "system", "content": "Notes."},
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": " A1"},
        {"role": "user", "content": "Q2"},
    ]
    assert plain_text(messages) == "Notes.\n\nQ1 A1\n\nQ2"
    with pytest.raises(SpecdecError, match="non-empty list"):
        plain_text([])


def test_the_bundle_says_it_has_no_chat_template(base_gemma_bundle):
    m = read_manifest(base_gemma_bundle)
    assert m.tokenizer.chat_template is None and m.target.architecture == "gemma3"
    res = invoke("info", base_gemma_bundle)
    assert res.exit_code == 0 and "chat template: no" in res.output
    pipe = Pipeline.load(base_gemma_bundle, method="plain", threads=1)
    with pytest.raises(SpecdecError, match="no chat template.*--chat-template FILE"):
        pipe.generate([{"role": "user", "content": "hi"}], max_new_tokens=2)


def test_bench_joins_the_turns_into_plain_text_and_says_so(base_gemma_bundle, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    report = tmp_path / "bench.json"
    res = invoke(
        "bench",
        base_gemma_bundle,
        "--prompts",
        prompts,
        "--n-per-category",
        "1",
        "--max-new-tokens",
        "12",
        "--threads",
        "1",
        "--methods",
        "plain,pld,lookahead",
        "--json",
        report,
    )
    assert res.exit_code == 0, res.output
    assert "Prompts: plain text: no chat template (base model)" in res.stdout
    data = json.loads(report.read_text())
    assert data["meta"]["prompt_format"].startswith("plain text")
    assert not data["skipped_prompts"] and not data["divergences"]
    overall = data["results"]["pld"]["overall"]
    assert overall["identical_output_rate"] == 1.0 and overall["mean_accepted_tokens"] >= 1.0
    assert data["meta"]["prompts_per_category"] == {"copy": 1, "chat": 1}


def test_chat_is_a_completion_repl(base_gemma_bundle):
    pipe = Pipeline.load(base_gemma_bundle, method="plain", threads=1)
    first = pipe.generate("The quick brown", max_new_tokens=8)
    res = invoke(
        "chat", base_gemma_bundle, "--method", "plain", "--max-new-tokens", "8", input="The quick brown\nfox\n/exit\n"
    )
    assert res.exit_code == 0, res.output
    assert "no chat template (a base model): completion mode" in res.output
    assert first.text in res.output  # the model continued the typed text itself
    # the second line was added to the text so far (as a new paragraph) and that whole text was continued
    expected = pipe.generate(f"The quick brown{first.text}\n\nfox", max_new_tokens=8).text
    assert expected in res.output.split(first.text, 1)[1]
    assert res.output.count("tokens per target pass") == 2


def test_a_chat_template_file_at_chat_and_generate(base_gemma_bundle, template_file):
    res = invoke("chat", base_gemma_bundle, "--max-new-tokens", "6", "--chat-template", template_file, input="hi\n")
    assert res.exit_code == 0, res.output
    assert "completion mode" not in res.output and res.output.count("tokens per target pass") == 1

    args = ["generate", base_gemma_bundle, "--prompt", "hi", "--max-new-tokens", "6", "--method", "plain", "--json"]
    res = invoke(*args, "--chat-template", template_file)
    assert res.exit_code == 0, res.output
    pipe = Pipeline.load(base_gemma_bundle, method="plain", threads=1, chat_template=CHAT_TEMPLATE)
    want = pipe.generate([{"role": "user", "content": "hi"}], max_new_tokens=6)
    assert json.loads(res.stdout)["token_ids"] == want.token_ids

    res = invoke(*args, "--chat-template")  # the bundle's own template: a base model has none
    assert res.exit_code == 2 and "no chat template" in res.output and "Traceback" not in res.output


def test_export_stores_a_chat_template_file(base_gemma_dir, template_file, tmp_path):
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    assert read_chat_template(config) == CHAT_TEMPLATE
    out = tmp_path / "with-template"
    res = invoke(
        "export", "--target", base_gemma_dir, "--out", out, "--capacity", "256", "--chat-template", template_file
    )
    assert res.exit_code == 0, res.output
    assert read_manifest(out).tokenizer.chat_template == CHAT_TEMPLATE
    res = invoke("chat", out, "--max-new-tokens", "4", input="hi\n")
    assert res.exit_code == 0 and "completion mode" not in res.output


@pytest.mark.parametrize(
    "text,error",
    [
        ("{% for m in messages %}", "fix the template"),
        ("Hello there", None),  # renders, but not the messages: caught below
        ("{{ raise_exception('no user turns') }}", "no user turns"),
    ],
)
def test_bad_chat_template_files_are_one_line_errors(base_gemma_dir, tmp_path, text, error):
    bad = tmp_path / "bad.jinja"
    bad.write_text(text)
    res = invoke("export", "--target", base_gemma_dir, "--out", tmp_path / "x", "--chat-template", bad)
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert (error or "does not write the messages") in res.output
    assert not (tmp_path / "x").exists()
    res = invoke("export", "--target", base_gemma_dir, "--out", tmp_path / "y", "--chat-template", tmp_path / "nope")
    assert res.exit_code == 2 and "cannot read the chat template file" in res.output
