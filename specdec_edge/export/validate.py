"""Check an exported graph against the PyTorch model it came from.

Runs the graph through the real runtime engine (in-place cache, IOBinding) and compares
logits with PyTorch on the full sequence: one token after a non-empty cache (S=1), five
tokens after it (S=5), and a small token tree verified in one pass, node by node against
PyTorch run along that node's branch.
"""

from __future__ import annotations

import numpy as np

from specdec_edge.bundle import GraphSpec
from specdec_edge.errors import ExportError
from specdec_edge.runtime.ort_engine import OrtEngine
from specdec_edge.speculative.tree import path_to, tree_inputs

# Max |onnx - torch| relative to max |torch logit|, per weight precision.
TOLERANCE = {"fp32": 1e-3, "fp16": 3e-2, "int8": 0.35, "int4": 0.5, "gguf": 0.35}
TREE_PARENTS = [-1, -1, 0, 0, 1, 2, 4]  # two roots, depth up to 3


def _torch_logits(model, ids) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(ids)[None], dtype=torch.long)).logits[0].float().numpy()


def validate_graph(model_path, graph: GraphSpec, torch_model, *, prefix_len: int = 9, seed: int = 0) -> dict:
    """Return the error report; raise ExportError if any error exceeds the tolerance."""
    rng = np.random.default_rng(seed)
    vocab = graph.vocab_size
    engine = OrtEngine(model_path, graph, threads=None)
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
    compare("s5_max_abs_err", engine.run(new).logits, ref[prefix_len:])

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
    }
    if not np.isfinite(worst) or worst > tol:
        raise ExportError(
            f"validation failed for {graph.path}: ONNX Runtime differs from PyTorch by {worst:.3g} "
            f"(relative to the largest logit) > tolerance {tol} ({errors}); no bundle was written. "
            "Try --dtype fp32 or report the model."
        )
    return report
