"""`bench` end to end on the tiny bundles: report files, greedy exactness, skips and user errors."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from specdec_edge.bench.spec_bench import KEYS, OVERALL, load_prompts
from specdec_edge.cli import main
from specdec_edge.errors import SpecdecError
from tests.unit.test_light_runtime import heavy_modules, run_clean

PROMPTS = [
    {"question_id": 1, "category": "copy", "turns": ["The quick brown fox jumps over the lazy dog."]},
    {"question_id": 2, "category": "chat", "turns": ["hello", "Summarize the following article."]},
    {"question_id": 3, "category": "chat", "turns": ["def add(a, b):"]},
]


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return path


def bench_args(bundle, prompts_file, *extra):
    return [
        "bench",
        bundle,
        "--prompts",
        prompts_file,
        "--n-per-category",
        "1",
        "--max-new-tokens",
        "16",
        "--threads",
        "1",
        *extra,
    ]


def test_bench_writes_reports_and_is_exact(tiny_bundle, prompts_file, tmp_path):
    out = {ext: tmp_path / f"bench.{ext}" for ext in ("json", "md", "png")}
    res = invoke(
        *bench_args(
            tiny_bundle,
            prompts_file,
            "--methods",
            "plain,pld,draft,lookahead",
            "-k",
            "3",
            "--json",
            out["json"],
            "--md",
            out["md"],
            "--plot",
            out["png"],
        )
    )
    assert res.exit_code == 0, res.output
    report = json.loads(out["json"].read_text())
    assert set(report["results"]) == {"plain", "pld", "draft", "lookahead"}
    meta = report["meta"]
    assert meta["k"] == 3 and meta["threads"] == 1 and meta["max_new_tokens"] == 16 and meta["dtype"] == "fp32"
    assert meta["prompts_per_category"] == {"copy": 1, "chat": 1} and "onnxruntime" in meta["versions"]
    for method, rows in report["results"].items():
        assert list(rows) == ["copy", "chat", OVERALL]
        for row in rows.values():
            assert tuple(row) == KEYS
            assert row["identical_output_rate"] == 1.0, method  # greedy speculative == plain greedy
            assert row["tokens_per_s"] > 0 and row["decode_tokens_per_s"] >= row["tokens_per_s"]
        if method == "plain":
            assert rows[OVERALL]["acceptance_rate"] is None and rows[OVERALL]["mean_accepted_tokens"] == 1.0
    assert report["results"]["draft"][OVERALL]["acceptance_rate"] is not None
    assert report["divergences"] == [] and report["skipped_methods"] == {}
    table = out["md"].read_text()
    assert "| chat | draft |" in table and table in res.stdout
    assert out["png"].read_bytes()[:4] == b"\x89PNG"


def test_bench_reuse_keeps_the_first_turn_for_the_second(tiny_bundle, prompts_file, tmp_path):
    out = tmp_path / "reuse.json"
    args = bench_args(tiny_bundle, prompts_file, "--methods", "pld,draft", "--categories", "chat", "--json", out)
    res = invoke(*args, "--reuse", "--md", tmp_path / "reuse.md")
    assert res.exit_code == 0, res.output
    report = json.loads(out.read_text())
    assert report["meta"]["reuse"] is True and report["divergences"] == []
    for method, rows in report["results"].items():
        row = rows[OVERALL]
        assert row["identical_output_rate"] == 1.0 and row["reused_tokens"] > 0, method  # turn 2 of prompt 2
    assert "reused / prefilled tokens" in (tmp_path / "reuse.md").read_text()
    res = invoke(*args)  # without --reuse every call prefills its whole prompt
    assert res.exit_code == 0, res.output
    assert all(rows[OVERALL]["reused_tokens"] == 0 for rows in json.loads(out.read_text())["results"].values())


def test_method_without_requirements_is_skipped(tiny_llama_dir, tiny_bundle, prompts_file, tmp_path):
    from specdec_edge.export.exporter import export_bundle

    no_draft = export_bundle(str(tiny_llama_dir), tmp_path / "no-draft", capacity=256, progress=False)
    res = invoke(
        *bench_args(
            no_draft, prompts_file, "--methods", "pld,draft", "--categories", "copy", "--json", tmp_path / "b.json"
        )
    )
    assert res.exit_code == 0, res.output
    assert "Skipped method draft" in res.stderr and "no draft model" in res.stderr
    report = json.loads((tmp_path / "b.json").read_text())
    assert set(report["results"]) == {"plain", "pld"} and "draft" in report["skipped_methods"]


def test_user_errors(tiny_bundle, prompts_file):
    res = invoke(*bench_args(tiny_bundle, prompts_file, "--methods", "plain,jacobi"))
    assert res.exit_code == 2 and "unknown method 'jacobi'" in res.output and "Traceback" not in res.output
    res = invoke(*bench_args(tiny_bundle, prompts_file, "--categories", "poetry"))
    assert res.exit_code == 2 and "unknown category poetry" in res.output


def test_packaged_prompts():
    prompts = load_prompts(n_per_category=2)
    assert len(prompts) == 26 and len({p.category for p in prompts}) == 13
    assert {len(p.turns) for p in prompts} == {1, 2}
    with pytest.raises(SpecdecError, match="does not exist"):
        load_prompts("/nonexistent.jsonl")


def test_bench_command_without_heavy_imports(tiny_bundle, prompts_file):
    res = run_clean(f"""
        import sys
        sys.argv = ["specdec-edge", *{[str(a) for a in bench_args(tiny_bundle, prompts_file, "--methods", "pld")]!r}]
        from specdec_edge.cli import main
        try:
            main()
        except SystemExit as e:
            assert not e.code, e.code
    """)
    assert res.returncode == 0, res.stderr
    assert heavy_modules(res) == "[]"


def test_bench_shows_auto_choices_and_step_costs(tiny_bundle, prompts_file, tmp_path):
    out = tmp_path / "auto.json"
    md = tmp_path / "auto.md"
    res = invoke(*bench_args(tiny_bundle, prompts_file, "--methods", "plain,auto", "--json", out, "--md", md))
    assert res.exit_code == 0, res.output
    report = json.loads(out.read_text())
    assert report["meta"]["k"] == {"auto": 10}
    by = report["results"]["auto"][OVERALL]["by_proposer"]
    # a merged tree is named by its parts ("pld+draft")
    assert by and {part for name in by for part in name.split("+")} <= {"plain", "pld", "draft", "lookahead"}
    assert sum(p["steps"] for p in by.values()) * report["results"]["auto"][OVERALL]["mean_accepted_tokens"] > 0
    for p in by.values():
        assert sum(p["widths"].values()) == p["steps"]
    costs = report["meta"]["step_costs"]
    assert costs["widths"][0] == 1 and len(costs["seconds"][0]) == len(costs["widths"])
    table = md.read_text()
    assert "Step costs measured on this device" in table and "relative cost by width" in table
    assert report["results"]["auto"][OVERALL]["identical_output_rate"] == 1.0


def test_bench_adds_an_open_text_row_over_those_categories(tiny_bundle):
    from specdec_edge import Pipeline
    from specdec_edge.bench.spec_bench import OPEN_TEXT, BenchPrompt, run_bench, to_markdown

    pipe = Pipeline.load(tiny_bundle, method="plain", threads=1)
    prompts = [
        BenchPrompt(1, "writing", ["write about the quick brown fox"]),
        BenchPrompt(2, "roleplay", ["you are a fox; tell me about your day"]),
        BenchPrompt(3, "rag", ["the fox jumps. the fox jumps. what does the fox do?"]),
    ]
    report = run_bench(pipe, ["plain", "pld"], prompts, max_new_tokens=8, progress=False)
    for rows in report["results"].values():
        assert list(rows) == ["writing", "roleplay", "rag", OPEN_TEXT, OVERALL]
        together = rows["writing"]["prefilled_tokens"] + rows["roleplay"]["prefilled_tokens"]
        assert rows[OPEN_TEXT]["prefilled_tokens"] == together < rows[OVERALL]["prefilled_tokens"]
    assert report["meta"]["prompts_per_category"] == {"writing": 1, "roleplay": 1, "rag": 1}
    assert f"| {OPEN_TEXT} | pld |" in to_markdown(report)
    alone = run_bench(pipe, ["plain"], prompts[1:], max_new_tokens=8, progress=False)  # one such category: no row
    assert list(alone["results"]["plain"]) == ["roleplay", "rag", OVERALL]


def test_bench_report_names_its_machine_and_load(tiny_bundle):
    import os

    from specdec_edge import Pipeline
    from specdec_edge.bench.spec_bench import BenchPrompt, run_bench, to_markdown
    from specdec_edge.runtime.device import cpu_features, cpu_name

    pipe = Pipeline.load(tiny_bundle, method="plain", threads=1)
    report = run_bench(pipe, ["plain"], [BenchPrompt(1, "qa", ["what is a fox?"])], max_new_tokens=4, progress=False)
    meta = report["meta"]
    assert meta["machine"] == {
        "cpu": cpu_name(),
        "isa": cpu_features(),
        "cpus": os.cpu_count(),
        "arch": os.uname().machine,
    }
    start, end = meta["load_average_start_end"]
    assert isinstance(start, float) and isinstance(end, float) and start >= 0 and end >= 0
    header = to_markdown(report).splitlines()[3]
    assert (
        header.startswith(f"Machine: {cpu_name()} (")
        and f"load average {start:.2f} at start, {end:.2f} at end" in header
    )
    del meta["machine"]  # a report written before machines were recorded still renders, without the line
    assert "Machine:" not in to_markdown(report)
