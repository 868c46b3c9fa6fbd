"""Prefill through OpenVINO (``runtime/ov_prefill.py``): the same cache as ONNX Runtime's to float rounding, every
call prefilled alike so speculation stays exact, short prefills left to ONNX Runtime, clear errors, and a graph
OpenVINO cannot compile left to ONNX Runtime under ``auto``. Real OpenVINO and ONNX Runtime sessions on the tiny
exported bundles."""

from __future__ import annotations

import importlib.metadata
import sys

import numpy as np
import pytest

from specdec_edge import Pipeline, SpecdecError
from specdec_edge.api.engines import WARM_ROWS, open_engines
from specdec_edge.bundle.manifest import read_manifest
from specdec_edge.runtime.base import prefill
from specdec_edge.runtime.ort_engine import OrtEngine
from specdec_edge.runtime.ov_prefill import MIN_ROWS, OpenVinoPrefill, check_against, open_prefill, prefill_name
from specdec_edge.runtime.threads import CpuThreads
from tests.runtime.prefill_checks import LONG, check_prefill_is_deterministic, speculate_under_prefill

pytest.importorskip("openvino", reason="the openvino package (scripts/install.sh installs it)")


def tokens(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(3, 300, size=n).tolist()


def target(bundle, prefiller: bool) -> OrtEngine:
    manifest = read_manifest(bundle)
    engine = OrtEngine(bundle / manifest.target.graph.path, manifest.target.graph)
    if prefiller:
        engine.prefiller = OpenVinoPrefill(bundle / manifest.target.graph.path, manifest.target.graph, threads=2)
    return engine


def test_openvino_prefill_writes_the_cache_onnx_runtime_would(tiny_bundle):
    ids = tokens(150)
    ort_engine, ov_engine = target(tiny_bundle, False), target(tiny_bundle, True)
    for engine in (ort_engine, ov_engine):
        prefill(engine, ids[:100])
        prefill(engine, ids, kept=100)  # a second part after a kept prefix: OpenVINO reads the cache it wrote
    assert ov_engine.prefiller.compiled is not None
    assert ov_engine.length == ort_engine.length == 150 and ov_engine.held == ort_engine.held == ids
    np.testing.assert_allclose(ov_engine.cache[..., :150, :], ort_engine.cache[..., :150, :], atol=2e-4, rtol=1e-4)
    assert not ov_engine.cache[..., 150:, :].any()  # nothing written past the prefilled slots
    out = [e.run([7]).logits for e in (ort_engine, ov_engine)]  # the next decode pass reads what prefill wrote
    np.testing.assert_allclose(out[1], out[0], atol=2e-4, rtol=1e-4)


def test_warm_up_readies_the_prefill_runtime_and_leaves_the_caches_empty(tiny_bundle):
    """``Pipeline.warm_up`` (``serve`` calls it before it listens): the prefill runtime compiled and its first pass
    checked before any prompt, nothing left in the caches, and every call's output as without it."""
    cold = Pipeline.load(tiny_bundle, method="pld", prefill="openvino")  # the first load measures (prefilling)
    warm = Pipeline.load(tiny_bundle, method="pld", prefill="openvino")  # this one finds its verdict cached
    prefiller = warm.engines.target.prefiller
    assert not prefiller.checked
    assert warm.warm_up() > 0
    assert prefiller.checked and prefiller.compiled is not None
    assert warm.engines.target.length == 0 and warm.engines.target.held == []
    assert warm.warm_up() == 0  # once
    for pipe in (warm, cold):
        pipe.out = [pipe.generate(LONG, max_new_tokens=16, reuse=False).token_ids for _ in range(2)]
    assert warm.out == cold.out and warm.out[0] == warm.out[1]
    assert Pipeline.load(tiny_bundle, method="pld", prefill="onnxruntime").warm_up() == 0  # nothing to ready


def test_a_warm_up_after_a_call_starts_from_an_empty_cache(tiny_bundle):
    """``chat`` warms up in a thread, which may get the engines only after the first message was answered: the
    warm-up's rows then start at slot 0, not after the conversation (which overflowed the cache here, and the error
    was swallowed), the conversation goes to the prompt cache, and the next turn is answered as without it."""
    pipe = Pipeline.load(tiny_bundle, method="pld", prefill="openvino")
    fresh = Pipeline.load(tiny_bundle, method="pld", prefill="openvino")
    messages = [{"role": "user", "content": LONG}]
    first = pipe.generate(messages, max_new_tokens=16)
    target = pipe.engines.target
    assert target.length + min(WARM_ROWS, target.capacity - 1) > target.capacity - 1  # the warm-up won't fit after it
    assert pipe.warm_up() > 0
    assert target.length == 0 and target.held == []
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And then?"}]
    assert pipe.generate(messages, max_new_tokens=8).token_ids == fresh.generate(messages, max_new_tokens=8).token_ids


def test_chat_warms_up_while_the_first_line_is_typed(tiny_bundle, monkeypatch):
    """``chat`` readies the prefill runtime in a thread at start (``cli/run.py warming_up``); a long first message
    sent at once waits for it and is answered as a fresh pipeline answers it."""
    from click.testing import CliRunner

    from specdec_edge.api.engines import Engines
    from specdec_edge.cli import main

    warmed, errors, real = [], [], Engines.warm_up

    def warm_up(self):  # the real warm-up, its seconds and any error recorded (chat's thread swallows its errors)
        try:
            warmed.append(real(self))
        except Exception as e:
            errors.append(repr(e))
            raise
        return warmed[-1]

    monkeypatch.setattr(Engines, "warm_up", warm_up)
    line = " ".join(LONG.split())  # one typed line
    args = ["chat", str(tiny_bundle), "--method", "pld", "--prefill", "openvino", "--max-new-tokens", "12"]
    res = CliRunner().invoke(main, args, input=f"{line}\n/exit\n")
    assert res.exit_code == 0, res.output
    assert len(warmed) == 1 and warmed[0] > 0, (warmed, errors, res.output)
    want = Pipeline.load(tiny_bundle, method="pld", prefill="openvino")
    messages = [{"role": "user", "content": line}]
    assert len(want.encode(messages)) > 64  # long enough to prefill through OpenVINO
    assert want.generate(messages, max_new_tokens=12).text in res.output


def test_openvino_prefill_is_deterministic(tiny_bundle):
    check_prefill_is_deterministic(target(tiny_bundle, True))


def test_prefills_shorter_than_min_rows_stay_in_onnx_runtime(tiny_bundle):
    ov_engine, ort_engine = target(tiny_bundle, True), target(tiny_bundle, False)
    ids = tokens(MIN_ROWS - 1)
    for engine in (ov_engine, ort_engine):
        prefill(engine, ids)
    assert ov_engine.prefiller.compiled is None  # never needed: not even compiled
    assert np.array_equal(ov_engine.cache[..., : len(ids), :], ort_engine.cache[..., : len(ids), :])


@pytest.mark.parametrize("method", ["draft", "pld", "auto"])
def test_speculation_is_exact_with_openvino_prefill(tiny_bundle, method):
    spec = speculate_under_prefill(tiny_bundle, method, "openvino")
    assert prefill_name(spec.engines.target).startswith("openvino")
    assert spec.engines.target.prefiller.compiled is not None  # the long prompts went through OpenVINO


def test_heads_read_the_features_openvino_prefilled(heads_bundle):
    plain = Pipeline.load(heads_bundle, method="plain", prefill="openvino")
    eagle = Pipeline.load(heads_bundle, method="eagle", prefill="openvino")
    a = plain.generate(LONG, max_new_tokens=24, reuse=False)
    b = eagle.generate(LONG, max_new_tokens=24, reuse=False)
    assert a.token_ids == b.token_ids
    # the features of the prompt's slots are OpenVINO's hidden states, close to ONNX Runtime's
    tap = eagle.decoder.engine
    n = len(eagle.encode(LONG)) - 1
    ort_engine = target(heads_bundle, False)
    hidden = ort_engine.run(eagle.encode(LONG)[:-1]).hidden_states
    np.testing.assert_allclose(tap.features[:n], hidden[:n], atol=2e-4, rtol=1e-4)


def test_auto_leaves_a_graph_openvino_cannot_compile_to_onnx_runtime(tiny_bundle, tmp_path):
    engine = target(tiny_bundle, False)
    broken = tmp_path / "model.onnx"
    broken.write_bytes(b"not an onnx graph")
    engine.prefiller = OpenVinoPrefill(broken, engine.graph, threads=2)
    with pytest.raises(SpecdecError, match="OpenVINO cannot compile model.onnx.*--prefill onnxruntime"):
        OpenVinoPrefill(broken, engine.graph).compile()
    ids = tokens(120)
    prefill(engine, ids)  # the first pass that needs it drops it, before writing anything
    assert engine.prefiller is None and engine.length == 120
    reference = target(tiny_bundle, False)
    prefill(reference, ids)
    assert np.array_equal(engine.cache[..., :120, :], reference.cache[..., :120, :])


def test_prefill_choices_and_their_errors(tiny_bundle, monkeypatch):
    manifest = read_manifest(tiny_bundle)
    graph, path = manifest.target.graph, tiny_bundle / manifest.target.graph.path
    assert open_prefill("onnxruntime", "cpu", path, graph, 2) is None
    assert open_prefill("auto", "cuda", path, graph, 2) is None
    assert isinstance(open_prefill("auto", "cpu", path, graph, 2), OpenVinoPrefill)
    with pytest.raises(SpecdecError, match="unknown prefill runtime 'tvm'"):
        open_prefill("tvm", "cpu", path, graph, 2)
    with pytest.raises(SpecdecError, match="runs on the CPU.*--prefill onnxruntime"):
        open_prefill("openvino", "cuda", path, graph, 2)
    monkeypatch.setitem(sys.modules, "openvino", None)  # as if it were not installed

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    monkeypatch.setattr("importlib.metadata.version", not_installed)
    assert open_prefill("auto", "cpu", path, graph, 2) is None
    with pytest.raises(SpecdecError, match=r"needs the openvino package.*specdec-edge\[openvino\]"):
        open_prefill("openvino", "cpu", path, graph, 2)


def test_the_verdict_and_costs_of_another_prefill_are_kept_apart(tiny_bundle):
    manifest = read_manifest(tiny_bundle)
    cpu = CpuThreads(threads=2)
    ov = open_engines(tiny_bundle, manifest, provider="cpu", cpu=cpu, prefill="openvino")
    ort = open_engines(tiny_bundle, manifest, provider="cpu", cpu=cpu, prefill="onnxruntime")
    assert prefill_name(ov.target).startswith("openvino") and prefill_name(ort.target) == "onnxruntime"
    assert ov.verdict.device != ort.verdict.device  # measured and cached per prefill runtime
    ov.close()
    ort.close()


def test_a_prefiller_that_computes_another_function_is_refused(tiny_bundle):
    """The check of the first pass: K/V off by more than rounding (OpenVINO's compiled-model cache gave such
    K/V for the gguf graph) are refused under "openvino", dropped under "auto"."""
    ids = tokens(100)
    with pytest.raises(SpecdecError, match="disagrees with ONNX Runtime's.*--prefill onnxruntime"):
        check_against(np.ones((2, 2, 1, 2, 4, 8)) * 1.3, np.ones((2, 2, 1, 2, 4, 8)))
    check_against(np.ones((2, 2, 1, 2, 4, 8)) * 1.07, np.ones((2, 2, 1, 2, 4, 8)))  # the gguf bundle's rounding passes
    for required in (True, False):
        engine = target(tiny_bundle, True)
        engine.prefiller.required = required
        engine.prefiller.compile()
        real = engine.prefiller.run

        def skewed(cache, past, step, real=real):  # a wrong function: every K/V it writes scaled by 1.5
            out = real(cache, past, step)
            cache[..., past : past + step.ids.shape[1], :] *= 1.5
            return out

        engine.prefiller.run = skewed
        if required:
            with pytest.raises(SpecdecError, match="disagrees with ONNX Runtime's"):
                prefill(engine, ids)
        else:
            prefill(engine, ids)
            assert engine.prefiller is None
            reference = target(tiny_bundle, False)
            prefill(reference, ids)
            assert np.array_equal(engine.cache[..., :100, :], reference.cache[..., :100, :])
