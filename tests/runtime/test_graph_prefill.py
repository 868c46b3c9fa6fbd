"""The prefill graph (``export/prefill_graph.py``, ``runtime/graph_prefill.py``): written at export beside a target
graph with 4-bit layers, the same weights read from the same file with fp32 activations; it writes the cache as the
target graph would (to rounding), deterministically; every call prefills alike, so speculation stays exact; ``auto``
times it with the other candidates; clear errors. Real ONNX Runtime sessions on a tiny int4 bundle."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
from onnx import helper

from specdec_edge import SpecdecError
from specdec_edge.api.engines import open_engines
from specdec_edge.bundle.manifest import graph_paths, read_manifest
from specdec_edge.cli.info import render, summarize
from specdec_edge.runtime.base import prefill
from specdec_edge.runtime.graph_prefill import MIN_ROWS, GraphPrefill
from specdec_edge.runtime.ort_engine import OrtEngine
from specdec_edge.runtime.ov_prefill import prefill_name
from specdec_edge.runtime.prefill_choice import open_prefillers
from specdec_edge.runtime.threads import CpuThreads
from specdec_edge.runtime.verdicts import device_verdict, measure, to_verdict
from tests.runtime.prefill_checks import check_prefill_is_deterministic, speculate_under_prefill

CPU = CpuThreads(threads=2)


def tokens(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(3, 300, size=n).tolist()


def target(bundle, with_prefill_graph: bool) -> OrtEngine:
    graph = read_manifest(bundle).target.graph
    engine = OrtEngine(bundle / graph.path, graph, cpu=CPU)
    if with_prefill_graph:
        engine.prefiller = GraphPrefill(bundle / graph.prefill_path, graph, CPU)
    return engine


def levels(path) -> list[tuple[int, int]]:
    model = onnx.load(str(path), load_external_data=False)
    found = []
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            a = {x.name: helper.get_attribute_value(x) for x in node.attribute}
            found.append((a["bits"], a["accuracy_level"]))
    return found


def test_export_writes_the_prefill_graph_beside_a_4bit_target(int4_bundle, tiny_bundle):
    manifest = read_manifest(int4_bundle)
    graph = manifest.target.graph
    assert graph.prefill_path == "target/prefill.onnx" and graph.prefill_path in manifest.files
    assert graph.prefill_path in graph_paths(manifest)  # its external data is checked like the target's
    main, pre = levels(int4_bundle / graph.path), levels(int4_bundle / graph.prefill_path)
    assert len(main) == len(pre) > 0 and {level for bits, level in main if bits == 4} == {4}
    assert {level for bits, level in pre if bits == 4} == {1}  # fp32 activations in the 4-bit layers
    assert [level for bits, level in main if bits != 4] == [level for bits, level in pre if bits != 4]
    model = onnx.load(str(int4_bundle / graph.prefill_path), load_external_data=False)
    locations = {e.value for t in model.graph.initializer for e in t.external_data if e.key == "location"}
    assert locations == {"model.onnx.data"}  # the target's weights, not a second copy
    assert not (int4_bundle / "target" / "prefill.onnx.data").exists()
    assert read_manifest(tiny_bundle).target.graph.prefill_path == ""  # fp32: no 4-bit layers, nothing to gain
    for bundle, shown in ((int4_bundle, True), (tiny_bundle, False)):  # `info` says whether a bundle has one
        summary, costs = summarize(bundle)
        assert any("a prefill graph with fp32 activations" in line for line in render(bundle, summary, costs)) == shown


def test_the_prefill_graph_writes_the_cache_the_target_graph_would(int4_bundle):
    ids = tokens(150)
    plain, graph_engine = target(int4_bundle, False), target(int4_bundle, True)
    for engine in (plain, graph_engine):
        prefill(engine, ids[:100])
        prefill(engine, ids, kept=100)  # a second part after a kept prefix reads the cache it wrote
    assert graph_engine.prefiller.session is not None and graph_engine.prefiller.checked
    assert graph_engine.length == plain.length == 150 and graph_engine.held == plain.held == ids
    a, b = graph_engine.cache[..., :150, :], plain.cache[..., :150, :]
    assert not np.array_equal(a, b)  # another rounding: int8 activations there, fp32 here
    assert np.linalg.norm(a - b) / np.linalg.norm(b) < 0.1
    assert not graph_engine.cache[..., 150:, :].any()  # nothing written past the prefilled slots
    out = [e.run([7]).logits for e in (plain, graph_engine)]
    assert out[0].argmax() == out[1].argmax()


def test_the_prefill_graph_is_deterministic_and_leaves_short_prefills_alone(int4_bundle):
    check_prefill_is_deterministic(target(int4_bundle, True))
    ids = tokens(200, seed=1)
    short, reference = target(int4_bundle, True), target(int4_bundle, False)
    for e in (short, reference):
        prefill(e, ids[: MIN_ROWS - 1])
    assert short.prefiller.session is None  # never needed: not even loaded
    assert np.array_equal(short.cache[..., : MIN_ROWS - 1, :], reference.cache[..., : MIN_ROWS - 1, :])


@pytest.mark.parametrize("method", ["pld", "auto"])
def test_speculation_is_exact_with_the_prefill_graph(int4_bundle, method):
    spec = speculate_under_prefill(int4_bundle, method, "fp32")
    assert prefill_name(spec.engines.target).startswith("fp32 (the bundle's prefill graph")
    assert spec.engines.target.prefiller.session is not None  # the long prompts went through it


def test_prefill_fp32_errors(int4_bundle, tiny_bundle):
    graph = read_manifest(tiny_bundle).target.graph
    with pytest.raises(SpecdecError, match="needs the bundle's prefill graph.*re-export.*--prefill onnxruntime"):
        open_prefillers("fp32", "cpu", tiny_bundle, graph, CPU)
    int4 = read_manifest(int4_bundle).target.graph
    with pytest.raises(SpecdecError, match="prefill 'fp32' runs on the CPU.*--prefill onnxruntime"):
        open_prefillers("fp32", "cuda", int4_bundle, int4, CPU)
    assert open_prefillers("onnxruntime", "cpu", int4_bundle, int4, CPU) == []
    [chosen] = open_prefillers("fp32", "cpu", int4_bundle, int4, CPU)
    assert isinstance(chosen, GraphPrefill) and chosen.required and chosen.session is not None
    missing = GraphPrefill(int4_bundle / "target" / "gone.onnx", int4, CPU)
    with pytest.raises(SpecdecError, match="prefill graph .*gone.onnx is missing"):
        missing.compile()


def test_auto_times_the_prefill_graph_and_keeps_its_choice(int4_bundle, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_EDGE_CACHE", str(tmp_path))
    manifest = read_manifest(int4_bundle)
    lines: list[str] = []
    engines = open_engines(int4_bundle, manifest, provider="cpu", cpu=CPU, prefill="auto", progress=lines.append)
    [path] = sorted((tmp_path / "prefill").glob("*.json"))
    record = json.loads(path.read_text())
    assert "fp32" in record["speedups"] and record["seconds"]["fp32"] > 0 and record["errors"] == {}
    assert "+fp32-prefill" in record["device"]["provider"]  # the candidates are part of what was measured on
    assert any("timing the" in line and "fp32 prefill" in line for line in lines)
    assert prefill_name(engines.target).split()[0] == record["runtime"]
    engines.close()
    path.write_text(json.dumps({**record, "runtime": "fp32"}))  # as if this device had measured so
    again: list[str] = []
    engines = open_engines(int4_bundle, manifest, provider="cpu", cpu=CPU, prefill="auto", progress=again.append)
    assert not any("timing" in line for line in again)  # cached: never timed twice on one device
    assert isinstance(engines.target.prefiller, GraphPrefill)
    assert "fp32-prefill" in engines.verdict.device["provider"]  # verdicts and costs kept apart
    engines.close()


def count_runs(obj, name: str) -> list:
    """Count the calls of ``obj.name`` (the real call still runs)."""
    calls, real = [], getattr(obj, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    setattr(obj, name, counted)
    return calls


def test_the_checked_first_pass_is_the_prefill_pass(int4_bundle):
    """The check's pass of the prefill graph is the one prefill asked for: not run a second time, and its K/V and
    logits are those of a prefiller checked beforehand."""
    ids = tokens(100, seed=2)
    fresh, checked = target(int4_bundle, True), target(int4_bundle, True)
    checked.prefiller.compile()
    checked.prefiller.checked = True
    runs = count_runs(fresh.prefiller, "run")
    target_runs = count_runs(fresh.session, "run_with_iobinding")
    out = fresh.prefill_run(ids, logits_to_keep=1).logits.copy()
    assert fresh.prefiller.checked and len(runs) == 1 and len(target_runs) == 1  # one pass each: the check's
    want = checked.prefill_run(ids, logits_to_keep=1).logits
    assert np.array_equal(out, want)
    assert np.array_equal(fresh.cache, checked.cache)


def test_a_cached_choice_of_the_prefill_graph_is_not_checked_again(int4_bundle, tmp_path, monkeypatch):
    """Its check passed when `auto` chose it on this device; what it computes is fixed by the bundle's bytes, ONNX
    Runtime and the CPU, so a later load prefills without running the target graph on the same rows first."""
    monkeypatch.setenv("SPECDEC_EDGE_CACHE", str(tmp_path))
    manifest = read_manifest(int4_bundle)
    open_engines(int4_bundle, manifest, provider="cpu", cpu=CPU, prefill="auto").close()
    [path] = sorted((tmp_path / "prefill").glob("*.json"))
    path.write_text(json.dumps({**json.loads(path.read_text()), "runtime": "fp32"}))  # as if measured so here
    engines = open_engines(int4_bundle, manifest, provider="cpu", cpu=CPU, prefill="auto")
    engine = engines.target
    assert isinstance(engine.prefiller, GraphPrefill) and engine.prefiller.checked
    target_runs = count_runs(engine.session, "run_with_iobinding")
    prefill(engine, tokens(100, seed=3))
    assert target_runs == [] and engine.length == 100  # the prefill graph alone wrote the prompt's K/V
    engines.close()
    pinned = open_engines(int4_bundle, manifest, provider="cpu", cpu=CPU, prefill="fp32")
    assert not pinned.target.prefiller.checked  # no measurement behind a pinned one: its first pass is checked
    pinned.close()


def test_a_vouched_prefill_graph_that_cannot_load_leaves_the_target_graph_prefilling(int4_bundle, tmp_path):
    """Skipping the check must not skip the fallback: under `auto`, a prefill graph that fails to load at its first
    pass is dropped before it writes anything, as an unchecked one is."""
    bundle = tmp_path / "bundle"
    shutil.copytree(int4_bundle, bundle)
    engine, reference = target(bundle, True), target(bundle, False)
    engine.prefiller.checked = True  # as a cached choice leaves it
    (bundle / read_manifest(bundle).target.graph.prefill_path).unlink()  # gone after the load
    ids = tokens(100, seed=4)
    prefill(engine, ids)
    prefill(reference, ids)
    assert engine.prefiller is None and np.array_equal(engine.cache, reference.cache)


def test_a_prefill_runtimes_verdict_measures_only_the_reuse_check(int4_bundle, tmp_path, monkeypatch):
    """Where this device's verdict with the target graph prefilling is known (export recorded it, or it is cached), the
    verdict with the prefill graph keeps its decode-side checks and measures the reuse check again, and it says so.
    What it keeps is what a whole measurement with the prefill graph finds; a device whose base verdict is unknown is
    measured whole."""
    monkeypatch.setenv("SPECDEC_EDGE_CACHE", str(tmp_path))
    graph = read_manifest(int4_bundle).target.graph
    base_device = {**graph.verdict.device, "threads": "2"}
    base = device_verdict(int4_bundle, graph.verdict, graph.path, target(int4_bundle, False), base_device)
    assert "decode_checks_from" not in base.details  # measured whole: the export recorded other threads
    engine = target(int4_bundle, True)
    device = {**base_device, "provider": base_device["provider"] + engine.prefiller.setting}
    lines = []
    derived = device_verdict(int4_bundle, graph.verdict, graph.path, engine, device, progress=lines.append)
    assert "a reused cache matches a fresh prefill" in lines[0] and "cached in" in lines[1]
    assert derived.device == device and derived.details["decode_checks_from"] == base_device["provider"]
    assert engine.min_width == derived.min_pass_width and engine.length == 0
    whole = to_verdict(measure(target(int4_bundle, True)), device)
    keys = ("boundaries", "bad_residues", "single_row_matches", "reuse_matches_prefill")
    assert [getattr(whole, f) for f in ("batch_invariant", "min_pass_width", "tree_invariant", "max_width")] == [
        getattr(derived, f) for f in ("batch_invariant", "min_pass_width", "tree_invariant", "max_width")
    ]
    assert {k: whole.details[k] for k in keys} == {k: derived.details[k] for k in keys}
    assert not derived.details["reuse_matches_prefill"]  # fp32 activations in prefill, int8 in decode passes
    lines.clear()  # cached: nothing measured on the next load
    assert device_verdict(int4_bundle, graph.verdict, graph.path, target(int4_bundle, True), device) == derived
    shown = "\n".join(render(int4_bundle, *summarize(int4_bundle)))  # `info` says how it was measured
    assert f"its decode checks are the {base_device['provider']} setting's" in shown
    # the export's own record is a base too, with nothing cached
    monkeypatch.setenv("SPECDEC_EDGE_CACHE", str(tmp_path / "empty"))
    from_record = device_verdict(int4_bundle, base, graph.path, target(int4_bundle, True), device)
    assert from_record.details["decode_checks_from"] == base_device["provider"]
    # unknown base (other threads): measured whole
    other = {**device, "threads": "1"}
    measured = device_verdict(int4_bundle, graph.verdict, graph.path, target(int4_bundle, True), other)
    assert "decode_checks_from" not in measured.details
