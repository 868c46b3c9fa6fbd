"""`bench --sessions` (``specdec_edge/bench/sessions.py``) on the tiny bundle: every kind of session, every row, each
turn timed and compared with plain's; JSON, Markdown and PNG written."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from specdec_edge.bench.sessions import KINDS, MODES, build_sessions
from specdec_edge.cli import main


@pytest.fixture(scope="module")
def roomy_bundle(tmp_path_factory, tiny_llama_dir):
    """The tiny target with room for a five-turn conversation (its tokenizer spends a token per few bytes)."""
    from specdec_edge.export.exporter import export_bundle

    return export_bundle(
        str(tiny_llama_dir), tmp_path_factory.mktemp("bundles") / "roomy", capacity=512, progress=False
    )


def prompts(tmp_path):
    """A small Spec-Bench style file with what every kind of session is built from."""
    rows = [
        {"question_id": 1, "category": "writing", "turns": ["Write a short poem.", "Now make it rhyme."]},
        {"question_id": 2, "category": "coding", "turns": ["Write add(a, b) in Python.", "Now subtract."]},
        {"question_id": 3, "category": "summarization", "turns": ["Summarize: The fox ran. The dog slept."]},
        {"question_id": 4, "category": "rag", "turns": ["Fox facts.\nFoxes run.\nDogs sleep.\nWhy do foxes run?"]},
    ]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_sessions_are_built_from_spec_bench(tmp_path):
    sessions = build_sessions(prompts(tmp_path), n=1)
    assert [s.kind for s in sessions] == list(KINDS)
    document, code, agent = sessions[1], sessions[2], sessions[3]
    assert len(document.turns) == 5 and "The fox ran." in document.turns[0] and document.conversation
    assert len(code.turns) == 5 and code.turns[0] == "Write add(a, b) in Python."
    # every agent request repeats the earlier tool output and adds more
    assert not agent.conversation and all(a.split("\n\nStep")[0] in b for a, b in zip(agent.turns, agent.turns[1:]))
    shipped = build_sessions(n=2)  # the packaged Spec-Bench copy
    assert sorted({s.kind for s in shipped}) == sorted(KINDS) and len(shipped) == 8


def test_bench_sessions_on_the_tiny_bundle(roomy_bundle, tmp_path):
    out, md, png = tmp_path / "s.json", tmp_path / "s.md", tmp_path / "s.png"
    args = ["bench", str(roomy_bundle), "--sessions", "--prompts", str(prompts(tmp_path)), "--max-new-tokens", "6"]
    res = CliRunner().invoke(main, [*args, "--threads", "1", "--json", str(out), "--md", str(md), "--plot", str(png)])
    assert res.exit_code == 0, res.output
    report = json.loads(out.read_text())
    rows = report["meta"]["rows"]
    assert rows[0] == "plain none" and "auto none" in rows
    assert report["meta"]["modes"] == ["none", "reuse", "reuse+history"]  # every row runs: none is skipped
    assert set(rows) == {"plain none", "plain reuse", "auto none", "auto reuse", "auto reuse+history"}
    assert set(report["meta"]["modes"]) <= set(MODES)
    assert {s["kind"] for s in report["sessions"]} == set(KINDS) and not report["skipped_sessions"]
    for row in rows:
        for session in report["sessions"]:
            r = report["results"][row][session["name"]]
            assert len(r["turns"]) == session["turns"]
            assert r["identical_turns"] == session["turns"], (row, session["name"])  # every turn equals plain's
            for t in r["turns"]:
                assert 0 < t["first_s"] <= t["wall_s"] and t["new_tokens"] >= 1
                # the prompt's tokens before the pending one, which the first pass computes (Stats' counts)
                assert t["prefilled_tokens"] + t["reused_tokens"] == t["prompt_tokens"] - 1
            reused = [t["reused_tokens"] for t in r["turns"]]
            if MODES[row.split(" ")[1]][0]:  # a reusing row keeps what its own turn before left, from turn 2 on
                assert all(n > 0 for n in reused[1:]), (row, session["name"], reused)
            else:
                assert reused == [0] * len(reused), (row, session["name"])
            assert abs(r["total_s"] - sum(t["wall_s"] for t in r["turns"])) < 1e-9
    document = report["results"]["plain none"]["document-3"]["turns"]
    assert document[-1]["prompt_tokens"] > document[0]["prompt_tokens"]  # the conversation grows
    summary = report["summary"]["auto none"]["document"]
    assert summary["turns"] == 5 and summary["speedup_vs_auto"] == 1.0
    table = md.read_text()
    assert table in res.output and "| document (1) | auto none |" in table and "Per turn" in table
    start, end = report["meta"]["load_average_start_end"]  # the machine and its load, beside the figures
    assert f"load average {start:.2f} at start, {end:.2f} at end" in table.splitlines()[1]
    assert report["meta"]["machine"]["cpus"] >= 1 and report["meta"]["machine"]["cpu"] in table
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_sessions_applies_k_and_method_options(roomy_bundle, tmp_path):
    """-k and -o reach every method's pipeline (they were ignored under --sessions), and a report without auto
    has no speedup over it rather than a KeyError."""
    out = tmp_path / "s.json"
    args = ["bench", str(roomy_bundle), "--sessions", "--prompts", str(prompts(tmp_path)), "--max-new-tokens", "4"]
    args += ["--threads", "1", "--methods", "plain,pld", "--json", str(out)]
    res = CliRunner().invoke(main, [*args, "-k", "3", "-o", "pld.max_ngram=2"])
    assert res.exit_code == 0, res.output
    report = json.loads(out.read_text())
    assert report["meta"]["k"] == {"pld": 3}  # pld's own default is 4
    assert report["meta"]["method_options"] == {"pld": {"max_ngram": 2}}
    assert report["summary"]["pld none"]["document"]["speedup_vs_auto"] is None
    bad = CliRunner().invoke(main, [*args, "-o", "pld.no_such_option=1"])
    assert bad.exit_code != 0 and "no_such_option" in bad.output


def test_sessions_replay_given_requests(roomy_bundle, tmp_path):
    """A report's requests, given to another run, are what every row of that run sends (the same prompts on
    another bundle or runtime); the conversation turns carry the first run's answers, not the second's."""
    from specdec_edge.api.pipeline import Pipeline
    from specdec_edge.bench.sessions import run_sessions

    sessions = [s for s in build_sessions(prompts(tmp_path), n=1) if s.kind in ("spec-bench", "agent")]
    with Pipeline.load(roomy_bundle, method="plain", threads=1, history=False) as pipe:
        kw = dict(modes=["none"], max_new_tokens=3, progress=False)
        first = run_sessions(pipe, ["plain"], sessions, **kw)
        assert [m["role"] for m in first["requests"][sessions[0].name][1]] == ["user", "assistant", "user"]
        edited = json.loads(json.dumps(first["requests"]))
        edited[sessions[0].name][1][1]["content"] = "An answer plain did not write."
        again = run_sessions(pipe, ["plain"], sessions, requests=edited, **kw)
    assert again["requests"] == edited
    turns = again["results"]["plain none"][sessions[0].name]["turns"]
    before = first["results"]["plain none"][sessions[0].name]["turns"]
    assert turns[0]["prompt_tokens"] == before[0]["prompt_tokens"]
    assert turns[1]["prompt_tokens"] != before[1]["prompt_tokens"]  # the edited answer was sent
