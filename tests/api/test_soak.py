"""A short soak (benchmarks/soak.py, 100 calls from 8 threads on the tiny bundle): no hang, no unexpected
exception, greedy outputs equal to single-thread runs, memory flat. The full run's figures are in
docs/lab/serving.md ("Soak")."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SOAK = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"


def load_soak():
    spec = importlib.util.spec_from_file_location("soak", SOAK)
    module = importlib.util.module_from_spec(spec)
    sys.modules["soak"] = module  # its dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


def test_soak_100_calls_8_threads(tiny_bundle):
    soak = load_soak()
    report = soak.run_soak(
        tiny_bundle, calls=100, threads=8, max_new_tokens=12, prompt_chars=60, deadline_s=60, rss_from=20,
        ort_threads=1, log=lambda *a: None,
    )  # fmt: skip
    assert report["finished"] == 100 and not report["hangs"], report["hangs"]
    assert not report["unexpected_errors"], report["unexpected_errors"]
    assert report["expected_errors"] == report["kinds"]["bad"] == 2
    assert set(report["methods"]) == {"auto", "plain", "draft", "pld", "history", "lookahead"}
    streams = sum(n for kind, n in report["kinds"].items() if kind not in ("generate", "bad"))
    cut = report["kinds"]["dropped"] + report["kinds"]["cancelled"] + report["kinds"]["cancelled-elsewhere"]
    assert cut == streams // 4 and report["cancelled"] >= 1
    assert report["greedy_compared"] >= 50 and not report["greedy_mismatched"], report["greedy_mismatched"]
    assert report["resumes"] >= 1  # slow readers lost the engines to other calls and went on exactly
    assert report["rss_growth"] < 0.05, report["rss_mb"]
    assert report["ok"]
