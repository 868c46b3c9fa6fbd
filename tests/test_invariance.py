"""Batch invariance is measured at export, recorded in the manifest and honoured by the runtime."""

from __future__ import annotations

import shutil
from dataclasses import replace

import numpy as np
import onnx
import pytest

from specdec_edge import Pipeline, SpecdecError
from specdec_edge.bundle import read_manifest
from specdec_edge.export.invariance import check_batch_invariance
from specdec_edge.runtime.ort_engine import OrtEngine
from specdec_edge.speculative.loop import prefill


def test_fp32_bundle_is_measured_invariant_from_two_rows(tiny_bundle):
    graph = read_manifest(tiny_bundle).target.graph
    verdict = read_manifest(tiny_bundle).target.validation["batch_invariance"]
    assert graph.batch_invariant and verdict["multi_row_matches"] and verdict["rows_compared"] >= 20
    # A single row goes through other kernels than two or more (last-bit differences), so passes are padded.
    assert (graph.min_pass_width, verdict["single_row_matches"]) == (2, False)
    assert 0 < verdict["single_row_max_abs_diff"] < 1e-4


def test_the_runtime_pads_single_rows_to_the_measured_width(tiny_bundle):
    graph = read_manifest(tiny_bundle).target.graph
    padded = OrtEngine(tiny_bundle / graph.path, graph, threads=1)
    raw = OrtEngine(tiny_bundle / graph.path, replace(graph, min_pass_width=1), threads=1)
    assert padded.capacity == raw.capacity - 1  # a free slot for the padding row at the end of the cache
    context = [5, 9, 17, 33, 2, 8]
    for engine in (padded, raw):
        prefill(engine, context)
    alone = padded.run([41]).logits.copy()
    assert alone.shape == (1, graph.vocab_size)
    chain = raw.run([41, 7, 7]).logits.copy()
    np.testing.assert_array_equal(alone[0], chain[0])  # bit for bit: what makes speculation exact
    assert not np.array_equal(raw.run([41]).logits[0], chain[0])  # and what the padding fixes


def test_per_tensor_activation_quantization_is_caught(tiny_bundle, tmp_path):
    """ONNX Runtime's dynamic quantization scales activations per tensor: every row depends on the others."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    graph = read_manifest(tiny_bundle).target.graph
    src = tmp_path / "fp32"
    shutil.copytree(tiny_bundle / "target", src)
    quantize_dynamic(
        str(src / "model.onnx"),
        str(tmp_path / "dyn.onnx"),
        weight_type=QuantType.QInt8,
        op_types_to_quantize=["MatMul"],
        extra_options={"MatMulConstBOnly": True, "DefaultTensorType": onnx.TensorProto.FLOAT},
    )
    verdict = check_batch_invariance(tmp_path / "dyn.onnx", graph)
    assert not verdict["batch_invariant"] and not verdict["multi_row_matches"]


def test_a_bundle_that_failed_the_check_refuses_speculation(tiny_bundle):
    plain = Pipeline.load(tiny_bundle, method="plain", threads=1)
    failed = replace(plain.target.graph, batch_invariant=False)
    plain.target.graph = failed
    try:
        with pytest.raises(SpecdecError, match="failed the batch-invariance check.*Re-export.*allow_inexact"):
            plain.with_method("pld")
        assert plain.with_method("pld", allow_inexact=True).generate("the quick", max_new_tokens=4).token_ids
    finally:
        plain.target.graph = replace(failed, batch_invariant=True)


def test_tree_rows_are_compared_with_their_branches(tiny_bundle):
    verdict = read_manifest(tiny_bundle).target.validation["batch_invariance"]
    # fp32: fused attention rounds a tree row a little differently from the same branch run as a chain.
    assert "tree_rows_match" in verdict and verdict["tree_max_abs_diff"] < 1e-3


def test_quantized_targets_take_chains_and_refuse_branching_trees(tiny_bundle):
    plain = Pipeline.load(tiny_bundle, method="plain", threads=1)
    graph = plain.target.graph
    plain.target.graph = replace(graph, dtype="int4", tree_invariant=False)
    try:
        assert plain.with_method("pld").proposer.branches is False
        with pytest.raises(SpecdecError, match="proposes token trees.*only chain-shaped proposals.*topk=1"):
            plain.with_method("lookahead")
        assert plain.with_method("lookahead", allow_inexact=True).proposer.branches
    finally:
        plain.target.graph = graph


def test_eagle_as_a_chain_is_allowed_where_trees_are_not(heads_bundle):
    plain = Pipeline.load(heads_bundle, method="plain", threads=1)
    graph = plain.target.graph
    plain.target.graph = replace(graph, dtype="gguf", tree_invariant=False)
    try:
        with pytest.raises(SpecdecError, match="proposes token trees"):
            plain.with_method("pld-eagle")  # the bundle's recorded topk 3
        chain = plain.with_method("pld-eagle", topk=1, nodes=4, depth=4)
        assert not chain.proposer.branches
        proposal = chain.proposer.second  # EAGLE proposes one branch: every node's parent is the node before
        ids = chain.encode("the quick brown fox jumps")
        from specdec_edge.speculative.loop import prefill as fill

        fill(chain.engine, ids[:-1])
        proposal.prefill(ids, None, None)
        tree = proposal.propose(ids, 4)
        assert tree.parents.tolist() == list(range(-1, len(tree.tokens) - 1))
    finally:
        plain.target.graph = graph


def test_gpu_engines_pad_instead_so_the_cpu_verdict_does_not_refuse_them(tiny_bundle):
    from specdec_edge.runtime.ort_gpu_engine import OrtGpuEngine

    manifest = read_manifest(tiny_bundle)
    graph = replace(manifest.target.graph, batch_invariant=False)  # e.g. a portable fp16 graph on the CPU
    engine = OrtGpuEngine(tiny_bundle / graph.path, graph, provider="cpu", device="cpu", threads=1, pad_to=8)
    ref = Pipeline.load(tiny_bundle, method="plain", threads=1)
    pipe = Pipeline(ref.tokenizer, engine, None, "pld", 4)  # not refused: every pass runs 8 rows wide
    assert pipe.generate("the quick brown fox", max_new_tokens=12).token_ids
