"""``--prefill auto`` keeps another prefill runtime only where it measured faster on this device
(``runtime/prefill_choice.py``): the runtimes timed on the same rows once, the choice cached and followed on every
later load, a damaged record measured again, a graph OpenVINO cannot run left to ONNX Runtime. Real ONNX Runtime and
OpenVINO sessions on the tiny exported bundle (fp32: no prefill graph; the int4 bundle's: tests/runtime/
test_graph_prefill.py)."""

from __future__ import annotations

import json
import time

import pytest

from specdec_edge.api.engines import open_engines
from specdec_edge.bundle.manifest import read_manifest
from specdec_edge.cli.info import render, summarize
from specdec_edge.runtime import prefill_choice
from specdec_edge.runtime.ort_engine import OrtEngine
from specdec_edge.runtime.ov_prefill import OpenVinoPrefill, prefill_name
from specdec_edge.runtime.prefill_choice import GAIN, OUT, choose_prefill, decide, measure_prefill
from specdec_edge.runtime.threads import CpuThreads

pytest.importorskip("openvino", reason="the openvino package (scripts/install.sh installs it)")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_EDGE_CACHE", str(tmp_path))
    return tmp_path / "prefill"


def load(bundle, lines: list[str]):
    manifest = read_manifest(bundle)
    return open_engines(
        bundle, manifest, provider="cpu", cpu=CpuThreads(threads=2), prefill="auto", progress=lines.append
    )


def records(cache) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(cache.glob("*.json"))]


def test_auto_times_both_runtimes_once_and_keeps_its_choice(tiny_bundle, cache):
    lines: list[str] = []
    engines = load(tiny_bundle, lines)
    [record] = records(cache)
    assert record["seconds"]["onnxruntime"] > 0 and record["seconds"]["openvino"] > 0 and record["rows"] > 0
    assert set(record["speedups"]) == {"openvino"} and record["errors"] == {}  # fp32 graph: no prefill graph
    assert record["runtime"] == decide(record) and record["device"]["provider"].startswith("cpu+openvino-prefill")
    assert any("timing the openvino prefill" in line for line in lines)
    assert prefill_name(engines.target).split()[0] == record["runtime"]
    assert engines.target.length == 0 and engines.target.held == []  # the timed passes left nothing committed
    engines.close()
    summary, costs = summarize(tiny_bundle)  # `info` shows the choice and why
    assert [r["runtime"] for r in summary["prefill"]] == [record["runtime"]]
    line = next(line for line in render(tiny_bundle, summary, costs) if "prefill on" in line)
    where = f"{record['rows']} rows after {record['past']}"
    assert f"{record['runtime']} (against the target graph's speed on {where}: openvino " in line
    again: list[str] = []
    engines = load(tiny_bundle, again)
    assert not any("timing" in line for line in again)  # cached: never timed twice on one device
    assert prefill_name(engines.target).split()[0] == record["runtime"]
    engines.close()


@pytest.mark.parametrize("runtime", ["onnxruntime", "openvino"])
def test_the_cached_choice_decides_every_later_load(tiny_bundle, cache, runtime):
    load(tiny_bundle, []).close()
    [path] = sorted(cache.glob("*.json"))
    record = json.loads(path.read_text())
    path.write_text(json.dumps({**record, "runtime": runtime}))  # as if this device had measured so
    engines = load(tiny_bundle, [])
    assert prefill_name(engines.target).split()[0] == runtime
    # the verdict and the step costs are kept per prefill runtime
    assert ("openvino-prefill" in engines.verdict.device["provider"]) == (runtime == "openvino")
    engines.close()


def test_a_damaged_record_is_measured_again(tiny_bundle, cache):
    load(tiny_bundle, []).close()
    [path] = sorted(cache.glob("*.json"))
    path.write_text('{"format": 6, "runtime": "tvm"')
    lines: list[str] = []
    load(tiny_bundle, lines).close()
    assert any("timing the openvino prefill" in line for line in lines)
    assert records(cache)[0]["runtime"] in ("onnxruntime", "openvino")


def test_the_rule_and_a_prefiller_that_cannot_run(tiny_bundle, cache, tmp_path):
    assert decide({"speedups": {"openvino": GAIN}}) == "openvino"
    assert (
        decide({"speedups": {"openvino": GAIN - 0.01}}) == "onnxruntime" and decide({"speedups": {}}) == "onnxruntime"
    )
    assert decide({"speedups": {"openvino": 1.2, "fp32": 1.3}}) == "fp32"  # the fastest of those that pay
    assert decide({"speedups": {"openvino": 1.3, "fp32": 1.2}}) == "openvino"
    # the prefill graph (fp32 activations: the prompt's K/V as the fp32 model's) unless it is clearly slower
    assert decide({"speedups": {"openvino": 1.05, "fp32": 0.97}}) == "fp32"
    assert decide({"speedups": {"fp32": 0.95}}) == "fp32" and decide({"speedups": {"fp32": 0.94}}) == "onnxruntime"
    manifest = read_manifest(tiny_bundle)
    graph = manifest.target.graph
    engine = OrtEngine(tiny_bundle / graph.path, graph)
    openvino = OpenVinoPrefill(tiny_bundle / graph.path, graph, threads=2)
    measured = measure_prefill(engine, [openvino], rows=60, rounds=2)
    seconds = measured["seconds"]
    rounding = 1e-3 + 1e-6 / min(seconds.values())  # speedups to 4 digits, seconds to the microsecond
    assert measured["rows"] == measured["past"] == 60 and measured["speedups"]["openvino"] == pytest.approx(
        seconds["onnxruntime"] / seconds["openvino"], rel=rounding
    )
    assert engine.prefiller is None and engine.length == 0  # the measurement leaves the engine as it found it
    broken = tmp_path / "model.onnx"
    broken.write_bytes(b"not an onnx graph")
    lines: list[str] = []
    chosen = choose_prefill(
        tiny_bundle, graph.path, engine, [OpenVinoPrefill(broken, graph, threads=2)], {"name": "this CPU"}, lines.append
    )
    assert chosen is None
    [record] = records(cache)
    assert record["runtime"] == "onnxruntime" and "cannot compile" in record["errors"]["openvino"]
    assert record["speedups"] == {} and "onnxruntime prefills here" in lines[-1] and "openvino failed" in lines[-1]


class SlowOpenVino(OpenVinoPrefill):
    """OpenVINO's real prefill, each pass followed by a wait: a runtime far slower than the target graph here."""

    runs = 0

    def run(self, cache, past, step):
        out = super().run(cache, past, step)
        self.runs += 1
        time.sleep(0.05)
        return out


def test_a_candidate_far_below_its_bar_is_timed_once(tiny_bundle, cache, monkeypatch):
    graph = read_manifest(tiny_bundle).target.graph
    engine = OrtEngine(tiny_bundle / graph.path, graph)
    slow = SlowOpenVino(tiny_bundle / graph.path, graph, threads=2)
    fair = OpenVinoPrefill(tiny_bundle / graph.path, graph, threads=2)
    fair.name = "fair"  # a second candidate whose bar it clears: timed every round
    monkeypatch.setitem(prefill_choice.GAINS, "fair", 0.01)
    fair_runs = []
    run = fair.run
    fair.run = lambda *args: fair_runs.append(1) or run(*args)
    measured = measure_prefill(engine, [slow, fair], rows=60, rounds=3)
    assert measured["speedups"]["openvino"] < OUT * GAIN and decide(measured) == "fair"
    assert slow.runs == 2  # the check's pass and one timed pass
    assert len(fair_runs) == 4  # the check's and three timed


def test_a_candidate_far_behind_another_that_pays_is_timed_once(tiny_bundle, cache, monkeypatch):
    graph = read_manifest(tiny_bundle).target.graph
    engine = OrtEngine(tiny_bundle / graph.path, graph)
    slow = SlowOpenVino(tiny_bundle / graph.path, graph, threads=2)
    fast = OpenVinoPrefill(tiny_bundle / graph.path, graph, threads=2)
    slow.name, fast.name = "slow", "fast"
    for name in ("slow", "fast"):  # both clear their bars: only the other candidate puts the slow one out
        monkeypatch.setitem(prefill_choice.GAINS, name, 1e-6)
    measured = measure_prefill(engine, [slow, fast], rows=60, rounds=3)
    assert measured["speedups"]["slow"] < OUT * measured["speedups"]["fast"] and decide(measured) == "fast"
    assert slow.runs == 2  # the check's pass and one timed pass
    assert engine.length == 0 and engine.prefiller is None
