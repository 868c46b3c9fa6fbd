"""fp16 graphs keep the residual stream in fp32. Gemma 3's stream outgrows fp16's 65,504 (Gemma-3-270M: at the
``<bos>`` token of real text, up to 1.0e5): an fp16 stream turned inf, the next norm NaN, and GroupQueryAttention's
probabilities x values spread the NaN to every row of the pass (docs/lab/exactness.md, "Gemma-3 fp16"). A tiny
Gemma 3 with a loud stream must give finite logits close to its fp32 graph's, at both flavours. (With an fp16
stream the ort flavour fails here; the portable one passed on an AMD EPYC even so, not traced: ONNX Runtime runs
many fp16 ops in fp32 on x86 CPUs, through Casts it inserts.)"""

from __future__ import annotations

import numpy as np
import pytest

from specdec_edge.bundle.schema import CacheSpec, GraphSpec
from specdec_edge.export.graph import build_decoder, save
from specdec_edge.export.sources import load_model
from specdec_edge.runtime.ort_engine import OrtEngine
from specdec_edge.runtime.threads import CpuThreads
from specdec_edge.speculative.loop import prefill

CAPACITY = 64
# Gemma's norms scale by (1 + weight): every post-sublayer norm then adds values of RMS ~1.5e4 to the stream,
# each within fp16's range, their sum past it.
LOUD = 1.5e4


@pytest.fixture(scope="module")
def loud_gemma(base_gemma_dir):
    cfg = load_model(str(base_gemma_dir), capacity=CAPACITY).decoder
    weights = dict(cfg.weights)
    for name in weights:
        if name.endswith(("post_attention_layernorm.weight", "post_feedforward_layernorm.weight")):
            weights[name] = np.full_like(weights[name], LOUD - 1)
    return type(cfg)(**{**cfg.__dict__, "weights": weights})


def engine(cfg, flavour: str, dtype: str, folder, feature_layers=()) -> OrtEngine:
    path = folder / f"{flavour}-{dtype}-{len(feature_layers)}" / "model.onnx"
    path.parent.mkdir()
    model = build_decoder(
        cfg, flavour=flavour, dtype=dtype, capacity=CAPACITY, hidden_states=True, feature_layers=feature_layers
    )
    save(model, path)
    cache_dtype = "float16" if dtype == "fp16" else "float32"
    cache = CacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, CAPACITY, cache_dtype)
    spec = GraphSpec("model.onnx", flavour, dtype, cfg.vocab_size, cfg.hidden_size, cache, True, tuple(feature_layers))
    return OrtEngine(path, spec, cpu=CpuThreads(1))


@pytest.mark.parametrize("flavour", ["ort", "portable"])
def test_an_fp16_graph_survives_a_stream_past_fp16s_range(loud_gemma, tmp_path, flavour):
    context, pending = [5, 9, 17, 33, 2, 8, 41, 12, 7, 30], [7, 3, 11, 60]
    out = {}
    for dtype in ("fp32", "fp16"):
        eng = engine(loud_gemma, flavour, dtype, tmp_path)
        prefill(eng, context)
        step = eng.run(pending)
        out[dtype] = (step.logits.copy(), step.hidden_states.copy())
    logits32, _ = out["fp32"]
    logits16, hidden16 = out["fp16"]
    assert np.isfinite(logits16).all() and np.isfinite(hidden16).all()
    assert np.abs(logits16 - logits32).max() < 0.02 * np.abs(logits32).max()
    assert (logits16.argmax(-1) == logits32.argmax(-1)).all()
    # the stream does leave fp16's range, already entering the last layer (else this model would test nothing)
    last = loud_gemma.num_layers - 1
    features = engine(loud_gemma, flavour, "fp32", tmp_path, (last,)).run(context + pending).layer_features
    assert np.abs(features).max() > float(np.finfo(np.float16).max)
