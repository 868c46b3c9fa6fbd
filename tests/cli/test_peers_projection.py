"""benchmarks/peers_chart.py and benchmarks/projection.py: the parts that run without a peer or a large model -- the
chart of a peers report, the projection's random gguf-style graph built by our exporter, its depth extrapolation
and the speedup it derives from a bench report's acceptance."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from benchmarks import projection
from benchmarks.peers_chart import groups, plot_peers
from benchmarks.projection import Shape, acceptance, full_depth, our_engine, pass_cost, speedup


def entry(runtime, method, tps, identical="–", prefix=None):
    e = {"runtime": runtime, "method": method, "tokens_per_s": tps, "identical": identical}
    if prefix is not None:
        e["common_prefix_with_fp32"] = prefix
    return e


def test_peers_chart_groups_plain_with_its_speculation_and_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    table = [
        entry("specdec-edge gguf", "plain", 23.7, prefix=21.7),
        entry("specdec-edge gguf", "auto k=4", 30.2, "26 of 26", 21.7),
        entry("llama.cpp (llama-cpp-python 0.3.36) Q4_1", "plain", 25.0, prefix=5.0),
        entry("llama.cpp (llama-cpp-python 0.3.36) Q4_1", "prompt lookup 10", 20.0, "3 of 26", 4.0),
        entry("transformers PyTorch fp32", "plain", 3.6, prefix=128.0),  # the reference: plain only
    ]
    rows = groups(table)
    assert [(name, spec is not None) for name, _, spec in rows] == [
        ("specdec-edge gguf", True),
        ("llama.cpp (llama-cpp-python 0.3.36) Q4_1", True),
        ("transformers PyTorch fp32", False),
    ]
    out = tmp_path / "peers.png"
    plot_peers({"meta": {"prompts": [1] * 26, "max_new_tokens": 128, "threads": 2}, "table": table}, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_projection_graph_is_our_gguf_graph_and_runs(tmp_path):
    shape = Shape(hidden=128, layers=8, heads=4, kv_heads=2, intermediate=256, vocab=512, rope_theta=1e4)
    engine = our_engine(shape, 2, 64, tmp_path / "ours", threads=1)
    engine.run(np.arange(20), logits_to_keep=1)
    engine.commit(20)
    out = engine.run(np.array([3, 4, 5]))
    assert out.logits.shape == (3, 512) and np.isfinite(out.logits).all()
    assert np.abs(out.logits).max() > 0  # random blocks, not zeros


def test_depth_is_extrapolated_linearly_from_two_depths():
    measured = {2: {256: {1: 12.0, 2: 14.0}}, 4: {256: {1: 20.0, 2: 24.0}}}  # 4 and 5 ms per layer
    assert full_depth(measured, 16) == {256: {1: 4.0 + 16 * 4.0, 2: 4.0 + 16 * 5.0}}


def test_depth_is_not_projected_from_noise():
    """A deeper graph measured no slower (or a negative fixed part) projects nothing, rather than a negative pass."""
    import math

    measured = {2: {256: {1: 12.0, 2: 14.0}}, 4: {256: {1: 11.0, 2: 40.0}}}  # width 2: fixed part -12 ms
    out = full_depth(measured, 16)[256]
    assert math.isnan(out[1]) and math.isnan(out[2])


def test_pass_cost_pads_interpolates_and_extrapolates(monkeypatch):
    costs = {1: 9.0, 2: 10.0, 3: 11.0, 5: 15.0, 8: 24.0}
    assert pass_cost(costs, 1) == 9.0  # one row, where the device's verdict runs one-row passes (the default)
    assert pass_cost(costs, 4) == 13.0
    assert pass_cost(costs, 11) == 33.0  # the slope of 5 -> 8
    monkeypatch.setattr(projection, "PLAIN_WIDTH", 2)  # --plain-width 2: a device that pads one-row passes
    assert pass_cost(costs, 1) == 10.0


def test_speedup_from_a_bench_reports_acceptance(monkeypatch):
    report = {
        "results": {
            "plain": {"overall": {"by_proposer": {}}},
            "auto": {
                "overall": {
                    "by_proposer": {
                        "pld": {"steps": 10, "accepted": 20, "widths": {"4": 10}},  # 10 passes of 5 rows
                        "plain": {"steps": 5, "accepted": 0, "widths": {"0": 5}},  # 5 one-row steps
                    }
                }
            },
        }
    }
    got = acceptance(report)
    assert got == {"auto": (35, Counter({5: 10, 1: 5}))}
    costs = {1: 9.0, 2: 10.0, 5: 15.0, 8: 24.0}
    # plain: 35 tokens x 9 ms; auto: 10 x 15 + 5 x 9 ms
    assert speedup(costs, *got["auto"]) == pytest.approx(35 * 9 / 195)
    monkeypatch.setattr(projection, "PLAIN_WIDTH", 2)  # one-row passes padded: plain 35 x 10; auto 150 + 5 x 10
    assert speedup(costs, *got["auto"]) == pytest.approx(350 / 200)
