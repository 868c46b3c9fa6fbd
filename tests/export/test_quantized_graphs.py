"""Quantized weights in the decoder graph: a GGUF's own blocks (Q4_0, Q4_1, Q8_0) run as MatMulNBits give the
model those blocks stand for, batch invariant; --dtype gguf refuses non-GGUF sources."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from specdec_edge.bundle.manifest import read_manifest
from specdec_edge.errors import ExportError
from specdec_edge.export.exporter import export_bundle
from specdec_edge.export.gguf_blocks import blocks_from_raw
from specdec_edge.export.graph import build_decoder, save
from specdec_edge.export.sources import load_model
from specdec_edge.runtime.ort_engine import OrtEngine
from specdec_edge.runtime.threads import CpuThreads
from specdec_edge.runtime.verdicts import measure
from specdec_edge.speculative.loop import prefill


def linear_names(cfg) -> list[str]:
    return [n for n, w in cfg.weights.items() if w.ndim == 2 and "embed" not in n and "lm_head" not in n]


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_in_the_graph_match_their_dequantized_weights(tiny_llama_dir, tiny_bundle, tmp_path, qtype):
    kind = GGMLQuantizationType[qtype]
    loaded = load_model(str(tiny_llama_dir), capacity=256)
    cfg = loaded.decoder
    spec = read_manifest(tiny_bundle).target.graph
    blocks = {n: blocks_from_raw(quants.quantize(cfg.weights[n], kind), qtype, n) for n in linear_names(cfg)}
    for name, q in blocks.items():  # the graph's reference: fp32 weights equal to what the blocks stand for
        np.testing.assert_array_equal(q.dequantize(), quants.dequantize(quants.quantize(cfg.weights[name], kind), kind))
    ref_cfg = type(cfg)(
        **{**cfg.__dict__, "weights": {**cfg.weights, **{n: q.dequantize() for n, q in blocks.items()}}}
    )
    kept_cfg = type(cfg)(**{**cfg.__dict__, "quantized": blocks})
    paths = {}
    for name, c in (("ref", ref_cfg), ("kept", kept_cfg)):
        paths[name] = tmp_path / name / "model.onnx"
        paths[name].parent.mkdir()
        save(build_decoder(c, flavour="ort", dtype="fp32", capacity=256, hidden_states=False), paths[name])
    verdict = measure(OrtEngine(paths["kept"], spec, cpu=CpuThreads(1)))
    assert verdict["batch_invariant"] and verdict["min_pass_width"] == (1 if verdict["single_row_matches"] else 2)
    engines = {name: OrtEngine(path, spec, cpu=CpuThreads(1)) for name, path in paths.items()}
    context = [5, 9, 17, 33, 2, 8, 41, 12]
    logits = {}
    for name, engine in engines.items():
        prefill(engine, context)
        logits[name] = engine.run([7, 3, 11]).logits.copy()
    scale = np.abs(logits["ref"]).max()
    # MatMulNBits computes with int8 activations (accuracy level 4), like llama.cpp's quantized dot products.
    assert np.abs(logits["kept"] - logits["ref"]).max() < 0.05 * scale
    assert (logits["kept"].argmax(-1) == logits["ref"].argmax(-1)).mean() >= 2 / 3


def test_dtype_gguf_needs_a_gguf_source(tiny_llama_dir, tmp_path):
    with pytest.raises(ExportError, match="--dtype gguf keeps a GGUF file's quantized weights"):
        export_bundle(str(tiny_llama_dir), tmp_path / "x", dtype="gguf", progress=False)
