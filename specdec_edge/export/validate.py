"""Check an exported graph against the PyTorch model it came from.

Runs the graph through the real runtime engine (in-place cache, IOBinding) and compares
logits with PyTorch on the full sequence: one token after a non-empty cache (S=1), five
tokens after it (S=5), and a small token tree verified in one pass, node by node against
PyTorch run along that node's branch. A graph with feature layers also has its ``layer_features``
of the S=5 pass compared with PyTorch's hidden states entering those layers.
"""

from __future__ import annotations

import numpy as np

from specdec_edge.bundle.schema import GraphSpec
from specdec_edge.errors import ExportError
from specdec_edge.runtime.ort_engine import OrtEngine
from specdec_edge.runtime.tree import path_to, tree_inputs

# Max |onnx - torch| relative to max |torch logit|, per weight precision.
TOLERANCE = {"fp32": 1e-3, "fp16": 3e-2, "int8": 0.35, "int4": 0.5, "gguf": 0.35}
TREE_PARENTS = [-1, -1, 0, 0, 1, 2, 4]  # two roots, depth up to 3


def _torch_logits(model, ids) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(ids)[None], dtype=torch.long)).logits[0].float().numpy()


def _compare_features(got: np.ndarray, graph: GraphSpec, torch_model, ids, start: int) -> dict:
    """Worst error of ``got`` [S, n*H] (the rows from ``start`` on) vs PyTorch's hidden states entering the
    graph's feature layers (``hidden_states[k]``: after k layers), relative to their largest value."""
    import torch

    with torch.no_grad():
        out = torch_model(torch.as_tensor(np.asarray(ids)[None], dtype=torch.long), output_hidden_states=True)
    want = np.concatenate([out.hidden_states[k][0, start:].float().numpy() for k in graph.feature_layers], -1)
    err = float(np.abs(got - want).max() / max(float(np.abs(want).max()), 1e-6))
    return {"layer_features_max_rel_err": err, "feature_layers": list(graph.feature_layers)}


def validate_graph(model_path, graph: GraphSpec, torch_model, *, prefix_len: int = 9, seed: int = 0) -> dict:
    """Return the error report; raise ExportError if any error exceeds the tolerance."""
    rng = np.random.default_rng(seed)
    vocab = graph.vocab_size
    engine = OrtEngine(model_path, graph)
    prefix = rng.integers(0, vocab, prefix_len)
    new = rng.integers(0, vocab, 5)
    ref = _torch_logits(torch_model, np.concatenate([prefix, new]))
    scale = float(np.abs(ref).max())
    errors, top1 = {}, []

    def compare(name, got, want):
        errors[name] = float(np.abs(got - want).max())
        top1.extend((got.argmax(-1) == want.argmax(-1)).tolist())

    compare("prefill_last_max_abs_err", engine.run(prefix, logits_to_keep=1).logits, ref[prefix_len - 1 : prefix_len])
    engine.commit(prefix_len)
    compare("s1_max_abs_err", engine.run(new[:1]).logits, ref[prefix_len : prefix_len + 1])
    s5 = engine.run(new)
    compare("s5_max_abs_err", s5.logits, ref[prefix_len:])
    features = {}
    if graph.feature_layers:
        features = _compare_features(s5.layer_features, graph, torch_model, np.concatenate([prefix, new]), prefix_len)

    tree_tokens = rng.integers(0, vocab, len(TREE_PARENTS))
    positions, bias = tree_inputs(TREE_PARENTS, prefix_len)
    got = engine.run(tree_tokens, positions, bias).logits
    want = np.stack(
        [
            _torch_logits(torch_model, np.concatenate([prefix, tree_tokens[path_to(TREE_PARENTS, i)]]))[-1]
            for i in range(len(TREE_PARENTS))
        ]
    )
    compare("tree_max_abs_err", got, want)

    tol = TOLERANCE[graph.dtype]
    worst = max(errors.values()) / max(scale, 1e-6)
    report = {
        **errors,
        "logit_scale": scale,
        "max_rel_err": worst,
        "tolerance": tol,
        "top1_agreement": float(np.mean(top1)),
        "tree_parents": TREE_PARENTS,
        **features,
    }
    worst_features = features.get("layer_features_max_rel_err", 0.0)
    if not np.isfinite(worst_features) or worst_features > tol:
        raise ExportError(
            f"validation failed for {graph.path}: its layer_features differ from PyTorch's hidden states by "
            f"{worst_features:.3g} (relative) > tolerance {tol}; no bundle was written. Try --dtype fp32."
        )
    if not np.isfinite(worst) or worst > tol:
        raise ExportError(
            f"validation failed for {graph.path}: ONNX Runtime differs from PyTorch by {worst:.3g} "
            f"(relative to the largest logit) > tolerance {tol} ({errors}); no bundle was written. "
            "Try --dtype fp32 or report the model."
        )
    return report
