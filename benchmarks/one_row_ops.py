"""Which op's one-row path rounds unlike its several-row path, on this device, in a bundle's own target graph.

Usage:
  python benchmarks/one_row_ops.py BUNDLE [--past 40 256] [--threads 2] [--host-pad]

Every node output of the target graph is made a graph output; one pass of one token and one pass of the same token
plus another after ``past`` slots of a random context run side by side, and the first row (the token's) of every
float tensor that carries the token's data (not shapes, positions or the mask) is compared bit for bit, in graph
order. A node whose inputs all match while its output does not is where a
one-row path differs (the *source*); everything downstream of it differs too. ``--host-pad`` runs the one-row pass
padded to two rows on the host (what ``min_pass_width`` 2 does), as a control: nothing may differ then.

The runtime's verdict (runtime/verdicts.py) decides from the whole pass; this tool says which op to blame. Making
every tensor an output keeps ONNX Runtime from fusing across it, so kernels here may differ slightly from the
optimized graph's (the verdict measures that one).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from specdec_edge.bundle.manifest import read_manifest
from specdec_edge.runtime.base import StepInputs, causal_bias, pad_step, prefill
from specdec_edge.runtime.ort_engine import OrtEngine
from specdec_edge.runtime.threads import CpuThreads, app_session_options


def all_outputs_session(model_path: Path) -> tuple[ort.InferenceSession, list[onnx.NodeProto]]:
    """A session of the graph with every node output also a graph output, and the graph's nodes."""
    model = onnx.load(str(model_path))  # with its weights: the session is made from bytes
    have = {o.name for o in model.graph.output}
    for node in model.graph.node:
        for name in node.output:
            if name and name not in have:
                model.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
    opts = app_session_options()  # shares the process-wide pool the engine made (threads: the pool's)
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return session, list(model.graph.node)


def feeds(step: StepInputs, cache: np.ndarray, graph) -> dict:
    """The graph's inputs for one pass over a copy of ``cache``."""
    out = {
        "input_ids": step.ids,
        "position_ids": step.positions,
        "attention_bias": step.bias,
        "logits_to_keep": np.array([step.keep], np.int64),
    }
    spec = graph.cache
    for layer in range(spec.num_layers):
        for k, kind in enumerate(("key", "value")):
            out[spec.input_name(layer, kind)] = cache[layer, k].copy()
    return out


def first_row(a: np.ndarray, b: np.ndarray, past: int, cache_shape: tuple) -> tuple[np.ndarray, np.ndarray] | None:
    """The token's part of tensor ``a`` (one-row pass) and ``b`` (two-row pass), or None when there is none to
    compare: a cache buffer's slot ``past``; along the one axis where the shapes differ, index 0; where they are
    equal (attention's inputs padded inside the graph to two rows), index 0 of the first axis of size 2; else all."""
    if a.shape == cache_shape[1:] or a.shape == cache_shape:
        return a[..., past, :], b[..., past, :]
    if a.ndim != b.ndim:
        return None
    diff = [i for i in range(a.ndim) if a.shape[i] != b.shape[i]]
    if len(diff) > 1:
        return None
    axis = diff[0] if diff else next((i for i in range(a.ndim) if a.shape[i] == 2), None)
    if axis is None:
        return a, b
    return np.take(a, [0], axis=axis), np.take(b, [0], axis=axis)


def compare(bundle: Path, past: int, threads: int, host_pad: bool) -> None:
    graph = read_manifest(bundle).target.graph
    engine = OrtEngine(bundle / graph.path, graph, cpu=CpuThreads(threads))
    rng = np.random.default_rng(past)
    prefill(engine, rng.integers(0, graph.vocab_size, past))
    session, nodes = all_outputs_session(bundle / graph.path)
    token, other = (int(t) for t in rng.integers(0, graph.vocab_size, 2))
    steps = {}
    for name, ids in (("one", [token]), ("two", [token, other])):
        seq = len(ids)
        steps[name] = StepInputs(
            np.array([ids], np.int64), np.arange(past, past + seq, dtype=np.int64)[None], causal_bias(past, seq), seq
        )
    if host_pad:
        steps["one"] = pad_step(steps["one"], 2, past)
    names = [o.name for o in session.get_outputs()]
    results = {k: dict(zip(names, session.run(None, feeds(s, engine.cache, graph)))) for k, s in steps.items()}
    cache_shape = (1, graph.cache.num_kv_heads, graph.cache.capacity, graph.cache.head_dim)
    same = {i.name: True for i in session.get_inputs()}
    # the token's data: what depends on the ids' values or the cache (not on shapes, positions or the mask, which
    # follow S and differ between the passes by design)
    data = {"input_ids", *(i.name for i in session.get_inputs() if i.name.startswith("past_key_values."))}
    sources, first = [], None
    for node in nodes:
        inputs_same = all(same.get(i, True) for i in node.input if i)
        for out in node.output:
            if node.op_type not in ("Shape", "Size") and any(i in data for i in node.input):
                data.add(out)
            a, b = results["one"].get(out), results["two"].get(out)
            pair = first_row(a, b, past, cache_shape) if out in data and a is not None and a.dtype.kind == "f" else None
            ok = pair is None or (pair[0].shape == pair[1].shape and np.array_equal(pair[0], pair[1]))
            same[out] = ok and inputs_same
            if not ok and first is None:
                first = (node, out, float(np.abs(pair[0].astype(np.float64) - pair[1]).max()))
            if not ok and inputs_same:
                sources.append((node.op_type, node.name, float(np.abs(pair[0].astype(np.float64) - pair[1]).max())))
    logits = first_row(results["one"]["logits"], results["two"]["logits"], past, cache_shape)
    print(
        f"past {past} ({'host-padded' if host_pad else 'one row'}): logits row max |diff| "
        f"{float(np.abs(logits[0] - logits[1]).max()):.3g}"
    )
    if first is None:
        print("  no tensor differs: every op's one-row path rounds as its two-row path here")
        return
    node, out, worst = first
    print(f"  first differing tensor: {out} of {node.op_type} {node.name} (max |diff| {worst:.3g})")
    by_op: dict[str, list] = {}
    for op, name, worst in sources:
        by_op.setdefault(op, []).append((name, worst))
    for op, hits in sorted(by_op.items()):
        print(
            f"  source {op}: {len(hits)} nodes whose inputs match and outputs differ "
            f"(max |diff| {max(w for _, w in hits):.3g}; first {hits[0][0]})"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--past", nargs="+", type=int, default=[40, 256])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--host-pad", action="store_true", help="pad the one-row pass to two rows on the host (control)")
    args = ap.parse_args()
    for past in args.past:
        compare(args.bundle, past, args.threads, args.host_pad)


if __name__ == "__main__":
    main()
