"""Exactness: the verdict measured on the device (runtime/verdicts.py), the one policy that reads it
(exactness.py), and what the runtime does with it (padding, key-count boundaries, chains or trees)."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import numpy as np
import onnx
import pytest

from specdec_edge import Pipeline, SpecdecError
from specdec_edge.api.engines import Engines
from specdec_edge.bundle.manifest import read_manifest
from specdec_edge.exactness import Verdict, decide, describe, trees_allowed
from specdec_edge.runtime.base import GpuOptions
from specdec_edge.runtime.ort_engine import OrtEngine
from specdec_edge.runtime.threads import CpuThreads
from specdec_edge.runtime.verdicts import cached_verdicts, device_verdict, measure, to_verdict
from specdec_edge.speculative.loop import prefill

INVARIANT = Verdict(True, 2, True, 64)
CHAINS_ONLY = Verdict(True, 2, False, 64)
NOT_INVARIANT = Verdict(False, 2, False, 1)


# ---- the policy, pinned: verdict x dtype x chain/tree x allow_inexact


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "int8", "int4", "gguf"])
@pytest.mark.parametrize("allow", [False, True])
def test_policy_matrix(dtype, allow):
    floating = dtype in ("fp32", "fp16")
    # plain always runs, padded as plain decoding is
    for v in (INVARIANT, CHAINS_ONLY, NOT_INVARIANT):
        d = decide(v, dtype, speculative=False, allow_inexact=allow)
        assert (d.speculate, d.trees, d.inexact) == (False, False, False)
    # an invariant graph: chains and trees, exactly
    for branches in (False, True):
        d = decide(INVARIANT, dtype, speculative=True, branches=branches, allow_inexact=allow)
        assert (d.speculate, d.trees, d.inexact, d.note) == (True, True, False, None)
    # tree rows that round differently: chains exact everywhere; trees exact to rounding on float graphs only
    assert decide(CHAINS_ONLY, dtype, speculative=True, allow_inexact=allow).inexact is False
    assert trees_allowed(CHAINS_ONLY, dtype, allow) is (floating or allow)
    if floating:
        d = decide(CHAINS_ONLY, dtype, speculative=True, branches=True, allow_inexact=allow)
        assert not d.inexact and "float rounding" in d.note
    elif allow:
        d = decide(CHAINS_ONLY, dtype, speculative=True, branches=True, allow_inexact=True)
        assert d.inexact and "INEXACT" in d.note
    else:
        with pytest.raises(SpecdecError, match="token trees.*chain-shaped.*topk=1.*--allow-inexact"):
            decide(CHAINS_ONLY, dtype, speculative=True, branches=True)
    # not batch invariant: speculation only with allow_inexact, marked
    if allow:
        assert decide(NOT_INVARIANT, dtype, speculative=True, allow_inexact=True).inexact
    else:
        with pytest.raises(SpecdecError, match="not batch invariant.*'plain'.*--allow-inexact"):
            decide(NOT_INVARIANT, dtype, speculative=True)


def test_describe_names_what_runs():
    assert "trees round differently" in describe(CHAINS_ONLY, "gguf")
    assert "float rounding" in describe(CHAINS_ONLY, "fp32")
    assert describe(NOT_INVARIANT, "int8").startswith("NOT batch invariant")


def test_verdict_json_is_checked():
    assert Verdict.from_json(INVARIANT.to_json()) == INVARIANT
    for bad in ({**INVARIANT.to_json(), "max_width": 0}, {**INVARIANT.to_json(), "batch_invariant": 1}, [],
                {**INVARIANT.to_json(), "details": {"boundaries": ["64"]}}):  # fmt: skip
        with pytest.raises(ValueError):
            Verdict.from_json(bad)


# ---- what export measures and the runtime does with it


def test_fp32_bundle_is_measured_invariant_from_two_rows(tiny_bundle):
    graph = read_manifest(tiny_bundle).target.graph
    verdict = graph.verdict
    assert graph.verdict.batch_invariant and verdict.max_width == 64 and verdict.details["rows_compared"] >= 200
    # The graph pads its attention op to two rows inside (its one-row path rounds differently); whether the rest of
    # a one-row pass rounds as the first row of a two-row pass depends on the CPU's kernels: measured, not assumed.
    matches = verdict.details["single_row_matches"]
    assert verdict.min_pass_width == (1 if matches else 2)
    assert verdict.details["one_row_form"] == ("one row, attention padded to 2" if matches else "padded to 2")
    diff = verdict.details["single_row_max_abs_diff"]
    assert diff == 0 if matches else 0 < diff < 1e-4
    assert verdict.device["provider"] == "cpu" and verdict.device["name"]


def test_the_runtime_pads_single_rows_to_the_measured_width(tiny_bundle):
    graph = read_manifest(tiny_bundle).target.graph
    engine = OrtEngine(tiny_bundle / graph.path, graph, cpu=CpuThreads(1))
    assert engine.attention_rows == 2 and engine.min_width == graph.verdict.min_pass_width
    assert engine.capacity == graph.cache.capacity - 1  # a free slot for the padding row at the end of the cache
    prefill(engine, [5, 9, 17, 33, 2, 8])
    alone = engine.run([41]).logits.copy()
    chain = engine.run([41, 7, 7]).logits.copy()
    np.testing.assert_array_equal(alone[0], chain[0])  # bit for bit: what makes speculation exact
    engine.min_width = 2  # the whole pass padded on the host: the same bits too
    np.testing.assert_array_equal(engine.run([41]).logits[0], chain[0])


def test_one_row_passes_pad_only_attention_inside_the_graph(tiny_bundle):
    """A one-row pass of the graph: its attention sees a second row (a copy of the first, one slot later) and the
    rest runs one row; the copy's K/V land past the valid length only, and its result equals the host-padded pass's
    to float rounding on any CPU (bit for bit where the verdict says so). A bias as wide as the cache works too."""
    graph = read_manifest(tiny_bundle).target.graph
    engine = OrtEngine(tiny_bundle / graph.path, graph, cpu=CpuThreads(1))
    engine.min_width = 1
    prefill(engine, [5, 9, 17, 33, 2, 8])
    engine.cache[..., 6:, :] = 7.0
    one = engine.run([41]).logits.copy()
    kv = engine.cache[..., 6, :].copy()
    np.testing.assert_array_equal(engine.cache[..., 7, :], engine.cache[..., 6, :])  # the copy, one slot later
    assert (engine.cache[..., 8:, :] == 7.0).all()  # nothing else written
    engine.min_width = 2
    np.testing.assert_allclose(engine.run([41]).logits, one, rtol=0, atol=1e-5)
    np.testing.assert_allclose(engine.cache[..., 6, :], kv, rtol=0, atol=1e-6)
    engine.min_width = 1
    wide = np.full((1, 1, 1, graph.cache.capacity), -np.inf, np.float32)
    wide[..., :7] = 0
    np.testing.assert_allclose(engine.run([41], attention_bias=wide).logits, one, rtol=0, atol=1e-5)


def test_a_one_row_op_that_rounds_differently_is_padded_away(tiny_bundle, tmp_path):
    """Negative control: one op of the graph made to round a one-row pass differently (1e-6 added to layer 0's first
    MatMul when S == 1): the verdict finds the one-row pass unlike two rows and pads every pass to two, exactly."""
    graph = read_manifest(tiny_bundle).target.graph
    engine = OrtEngine(_one_row_differs(tiny_bundle, tmp_path), graph, cpu=CpuThreads(1))
    verdict = measure(engine)
    assert verdict["batch_invariant"] and not verdict["single_row_matches"]
    assert (verdict["min_pass_width"], verdict["one_row_form"]) == (2, "padded to 2")
    assert "one-row passes padded to 2" in describe(to_verdict(verdict, {}), "fp32")
    prefill(engine, [5, 9, 17, 33, 2, 8])
    chain = engine.run([41, 7, 7]).logits.copy()
    np.testing.assert_array_equal(engine.run([41]).logits[0], chain[0])  # the verdict's padding: exact
    engine.min_width = 1
    assert not np.array_equal(engine.run([41]).logits[0], chain[0])  # what it pads away


def _one_row_differs(bundle, tmp_path):
    src = tmp_path / "one-row-differs"
    shutil.copytree(bundle / "target", src)
    model = onnx.load(src / "model.onnx", load_external_data=False)
    at, node = next((i, n) for i, n in enumerate(model.graph.node) if n.op_type == "MatMul")
    out = node.output[0]
    node.output[0] = out + ".raw"
    make, const = onnx.helper.make_node, onnx.helper.make_tensor
    added = [
        make("Shape", ["input_ids"], ["odd.shape"], start=1, end=2),
        make("Constant", [], ["odd.one"], value=const("one", onnx.TensorProto.INT64, [1], [1])),
        make("Equal", ["odd.shape", "odd.one"], ["odd.alone"]),
        make("Cast", ["odd.alone"], ["odd.f"], to=onnx.TensorProto.FLOAT),
        make("Constant", [], ["odd.eps"], value=const("eps", onnx.TensorProto.FLOAT, [], [1e-6])),
        make("Mul", ["odd.f", "odd.eps"], ["odd.delta"]),
        make("Add", [out + ".raw", "odd.delta"], [out]),
    ]
    for k, n in enumerate(added):
        model.graph.node.insert(at + 1 + k, n)
    onnx.save(model, src / "model.onnx")
    return src / "model.onnx"


def test_greedy_decoding_is_the_same_with_one_row_passes(tiny_bundle):
    """Where the device's verdict runs one-row passes unpadded (attention padded inside the graph), greedy decoding
    equals decoding with every one-row pass padded to two on the host, and speculation equals both."""
    plain = Pipeline.load(tiny_bundle, method="plain", threads=1)
    if plain.engines.verdict.min_pass_width != 1:
        pytest.skip(
            f"one-row passes round differently on this CPU: {plain.engines.verdict.details.get('one_row_form')}"
        )
    padded = Pipeline.load(tiny_bundle, method="plain", threads=1)
    padded.engines.target.min_width = 2
    from tests.speculative.test_methods import assert_greedy_equals_plain, many_prompts

    prompts = many_prompts()[:12]
    for prompt in prompts:
        want = padded.generate(prompt, max_new_tokens=40).token_ids
        assert plain.generate(prompt, max_new_tokens=40).token_ids == want, prompt
    assert_greedy_equals_plain(plain, plain.with_method("pld"), prompts=prompts)


def test_per_tensor_activation_quantization_is_caught(tiny_bundle, tmp_path):
    """ONNX Runtime's dynamic quantization scales activations per tensor: every row depends on the others."""
    graph = read_manifest(tiny_bundle).target.graph
    verdict = measure(OrtEngine(_dynamic_quantized(tiny_bundle, tmp_path), graph, cpu=CpuThreads(1)))
    assert not verdict["batch_invariant"] and verdict["max_width"] == 1 and 2 in verdict["failed_widths"]


def _dynamic_quantized(bundle, tmp_path):
    from onnxruntime.quantization import QuantType, quantize_dynamic

    src = tmp_path / "fp32"
    shutil.copytree(bundle / "target", src)
    quantize_dynamic(
        str(src / "model.onnx"),
        str(tmp_path / "dyn.onnx"),
        weight_type=QuantType.QInt8,
        op_types_to_quantize=["MatMul"],
        extra_options={"MatMulConstBOnly": True, "DefaultTensorType": onnx.TensorProto.FLOAT},
    )
    return tmp_path / "dyn.onnx"


def test_a_target_that_is_not_batch_invariant_refuses_speculation(tiny_bundle):
    plain = Pipeline.load(tiny_bundle, method="plain", threads=1)
    failed = replace(plain.engines.verdict, batch_invariant=False)
    with pytest.raises(SpecdecError, match="not batch invariant.*'plain'.*--allow-inexact"):
        Pipeline(plain.tokenizer, Engines(plain.engines.target, verdict=failed), "pld")
    pipe = Pipeline(plain.tokenizer, Engines(plain.engines.target, verdict=failed), "pld", allow_inexact=True)
    assert pipe.exactness.inexact and pipe.generate("the quick", max_new_tokens=4).token_ids


def test_quantized_targets_take_chains_and_refuse_branching_trees(tiny_bundle):
    plain = Pipeline.load(tiny_bundle, method="plain", threads=1)
    chains = replace(plain.engines.verdict, tree_invariant=False)
    target = replace(plain.engines.target.graph, dtype="int4")
    plain.engines.target.graph = target
    try:
        engines = Engines(
            plain.engines.target,
            verdict=chains,
            step_costs=lambda e, p, hold, widths: plain.engines.step_costs(e, p, widths),
        )
        assert Pipeline(plain.tokenizer, engines, "pld").decoder.proposer.branches is False
        with pytest.raises(SpecdecError, match="proposes token trees.*only chain-shaped proposals.*topk=1"):
            Pipeline(plain.tokenizer, engines, "lookahead")
        inexact = Pipeline(plain.tokenizer, engines, "lookahead", allow_inexact=True)
        assert inexact.decoder.proposer.branches and inexact.exactness.inexact
        auto = Pipeline(plain.tokenizer, engines, "auto")
        assert not any(c.name == "lookahead" for c in auto.decoder.proposer.candidates)  # auto proposes chains only
    finally:
        plain.engines.target.graph = replace(target, dtype="fp32")


def test_eagle_as_a_chain_is_allowed_where_trees_are_not(heads_bundle):
    plain = Pipeline.load(heads_bundle, method="plain", threads=1)
    chains = replace(plain.engines.verdict, tree_invariant=False)
    graph = plain.engines.target.graph
    plain.engines.target.graph = replace(graph, dtype="gguf")
    try:

        def make(**o):
            return Pipeline(
                plain.tokenizer,
                Engines(plain.engines.target, heads=plain.engines.heads, verdict=chains),
                "pld-eagle",
                None,
                o,
            )

        with pytest.raises(SpecdecError, match="proposes token trees"):
            make()  # the bundle's recorded topk 3
        chain = make(topk=1, nodes=4, depth=4)
        assert not chain.decoder.proposer.branches
        assert chain.generate("the quick brown fox jumps", max_new_tokens=12).token_ids
    finally:
        plain.engines.target.graph = graph


# ---- key-count boundaries: a real graph whose passes round differently past a key count


def test_boundaries_are_found_and_no_pass_straddles_them(wide_heads_bundle):
    manifest = read_manifest(wide_heads_bundle)
    verdict = manifest.target.graph.verdict
    bounds = verdict.details["boundaries"]
    assert verdict.batch_invariant and bounds, verdict.details
    b = bounds[0]
    graph = manifest.target.graph
    engine = OrtEngine(wide_heads_bundle / graph.path, graph, cpu=CpuThreads(1))
    engine.min_width = 2
    rng = np.random.default_rng(0)
    context = rng.integers(0, graph.vocab_size, b + 8).tolist()
    past = b - 2 - 3  # the pass's rows sit at positions past .. past+5: plain decoding computes the first three
    prefill(engine, context[:past])  # over fewer keys than b, the last three over b or more
    wide = engine.run(context[past : past + 6]).logits.copy()
    engine.commit(0)
    plain = []
    for j in range(6):  # plain decoding: one token per pass (padded to two)
        plain.append(engine.run([context[past + j]]).logits[0].copy())
        engine.commit(1)
    straddled = [np.array_equal(wide[j], plain[j]) for j in range(6)]
    assert not all(straddled)  # the straddling pass rounds some rows unlike plain decoding
    engine.boundaries = tuple(bounds)
    engine.rollback(past)
    assert engine.max_rows() == 3  # so the decode loop cuts such a pass where the key count changes
    cut = engine.run(context[past : past + 3]).logits.copy()
    assert all(np.array_equal(cut[j], plain[j]) for j in range(3))


def test_a_one_row_pass_with_padded_attention_meets_a_boundary_a_row_early(tiny_bundle):
    # Where a one-row pass runs as one row with its attention padded to two inside the graph, plain decoding computes
    # the token at position p over p + 2 keys, as a host-padded pass does: at a boundary of 65 keys the rows up to
    # position 62 and those from 63 on must not share a pass. (Counting one row let a pass after 60 slots hold
    # position 63: Gemma 3's gguf graph was then refused speculation on an AVX-512 CPU, its verdict failing there.)
    graph = read_manifest(tiny_bundle).target.graph
    engine = OrtEngine(tiny_bundle / graph.path, graph, cpu=CpuThreads(1))
    engine.boundaries, engine.max_width, engine.bad_residues = (65,), None, {}
    engine.min_width, engine.attention_rows = 1, 2
    assert engine.plain_rows == 2 and engine.max_rows(60) == 3 and engine.max_rows(62) == 1
    assert engine.max_rows(63) is None  # past the boundary: no limit from it
    engine.attention_rows = 1  # a graph whose one-row pass is one row throughout
    assert engine.plain_rows == 1 and engine.max_rows(60) == 4
    engine.min_width = 2  # padded on the host
    assert engine.plain_rows == 2 and engine.max_rows(60) == 3


def test_greedy_speculation_across_boundaries_equals_plain(wide_heads_bundle):
    plain = Pipeline.load(wide_heads_bundle, method="plain", threads=1)
    bounds = plain.engines.verdict.details["boundaries"]
    prompt = "The quick brown fox jumps over the lazy dog. " * 8  # lookup has something to propose
    ids = plain.encode(prompt)
    assert len(ids) < bounds[0] < len(ids) + 96
    want = plain.generate(prompt, max_new_tokens=96).token_ids
    for method in ("pld", "lookahead"):
        pipe = plain.with_method(method, k=8)
        assert pipe.generate(prompt, max_new_tokens=96).token_ids == want, method


# ---- the verdict belongs to the device


def _other_device(verdict: Verdict) -> Verdict:
    return replace(verdict, device={**verdict.device, "cpu": "some other CPU", "isa": ["avx512f"]})


def test_a_verdict_from_another_device_is_measured_again_and_cached(tiny_bundle):
    graph = read_manifest(tiny_bundle).target.graph
    recorded = _other_device(graph.verdict)
    engine = OrtEngine(tiny_bundle / graph.path, graph, cpu=CpuThreads(1))
    here = graph.verdict.device
    lines = []
    first = device_verdict(tiny_bundle, recorded, graph.path, engine, here, progress=lines.append)
    assert len(lines) == 2 and "checking on" in lines[0] and "cached in" in lines[1]
    assert first.device == here and first.batch_invariant
    lines.clear()
    again = device_verdict(tiny_bundle, recorded, graph.path, engine, here, progress=lines.append)
    assert lines == [] and again == first  # reused
    assert any(v["device"] == here for v in cached_verdicts(tiny_bundle))
    from specdec_edge.runtime.verdicts import bundle_digest, verdict_path

    path = verdict_path(bundle_digest(tiny_bundle), graph.path, here)
    for damage in ("{", json.dumps({"format": 1, "bundle": "x"}), json.dumps([1])):
        path.write_text(damage)
        lines_path = []
        measured = device_verdict(tiny_bundle, recorded, graph.path, engine, here, progress=lines_path.append)
        assert replace(measured, details={}) == replace(first, details={})
        assert len(lines_path) == 2  # a damaged cache file is measured again (and rewritten)
    # the export machine's own verdict is used as recorded, nothing measured
    lines.clear()
    assert device_verdict(tiny_bundle, graph.verdict, graph.path, engine, here, progress=lines.append)
    assert lines == []


def test_a_device_whose_measurement_fails_refuses_speculation(tiny_bundle, tmp_path):
    """A bundle verified on the export machine, run on a device where batched passes round differently (here:
    a graph whose activations are quantized per tensor): measured there, speculation refused, plain runs."""
    bundle = tmp_path / "bundle"
    shutil.copytree(tiny_bundle, bundle)
    dyn = _dynamic_quantized(tiny_bundle, tmp_path)
    manifest = json.loads((bundle / "manifest.json").read_text())
    target = manifest["target"]["graph"]
    shutil.copy(dyn, bundle / target["path"])
    (bundle / "target" / "model.onnx.data").unlink(missing_ok=True)
    target["verdict"]["device"] = {**target["verdict"]["device"], "cpu": "the export machine's CPU"}
    from specdec_edge.bundle.hashes import file_table

    manifest["files"] = file_table(bundle)
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    pipe = Pipeline.load(bundle, threads=1)  # the default method
    assert pipe.method == "plain" and not pipe.engines.verdict.batch_invariant
    with pytest.raises(SpecdecError, match="not batch invariant on .*--allow-inexact"):
        Pipeline.load(bundle, method="pld", threads=1)
    assert Pipeline.load(bundle, method="pld", threads=1, allow_inexact=True).exactness.inexact
    assert to_verdict(measure(OrtEngine(dyn, read_manifest(bundle).target.graph, cpu=CpuThreads(1))), {}).max_width == 1


def test_info_lists_the_verdict_of_every_device(tiny_bundle):
    from click.testing import CliRunner

    from specdec_edge.cli import main

    graph = read_manifest(tiny_bundle).target.graph
    here = {**graph.verdict.device, "cpu": "a laptop CPU", "name": "a laptop CPU"}
    engine = OrtEngine(tiny_bundle / graph.path, graph, cpu=CpuThreads(1))
    device_verdict(tiny_bundle, graph.verdict, graph.path, engine, here, progress=lambda line: None)
    shown = CliRunner().invoke(main, ["info", str(tiny_bundle), "--json"])
    verdicts = json.loads(shown.output)["verdicts"]
    assert [v["measured"] for v in verdicts][:1] == ["at export"] and "a laptop CPU" in [
        v["device"]["name"] for v in verdicts
    ]
    text = CliRunner().invoke(main, ["info", str(tiny_bundle)]).output
    assert "exactness on a laptop CPU (cpu, threads" in text and "chains are verified bit for bit" in text


def test_bench_runs_what_users_run_and_marks_what_it_is_told_to_run_inexactly(tiny_bundle):
    """A verdict that vouches for chains only: bench skips tree methods with the policy's reason, as chat and
    serve refuse them; with allow_inexact it runs them and marks them."""
    from specdec_edge.bench.spec_bench import BenchPrompt, run_bench, to_markdown

    plain = Pipeline.load(tiny_bundle, method="plain", threads=1)
    target = replace(plain.engines.target.graph, dtype="int4")
    plain.engines.target.graph = target
    try:
        chains = Pipeline(
            plain.tokenizer,
            Engines(plain.engines.target, verdict=replace(plain.engines.verdict, tree_invariant=False)),
            "plain",
        )
        prompts = [BenchPrompt(1, "writing", ("the quick brown fox the quick brown fox",))]
        report = run_bench(chains, ["plain", "pld", "lookahead"], prompts, max_new_tokens=12, progress=False)
        assert "lookahead" in report["skipped_methods"] and "chain-shaped" in report["skipped_methods"]["lookahead"]
        assert report["results"]["pld"]["overall"]["identical_output_rate"] == 1.0
        assert report["meta"]["inexact_methods"] == [] and "trees round differently" in report["meta"]["exactness"]
        inexact = run_bench(chains, ["plain", "lookahead"], prompts, max_new_tokens=12, progress=False,
                            allow_inexact=True)  # fmt: skip
        assert inexact["meta"]["inexact_methods"] == ["lookahead"] and "lookahead (inexact)" in to_markdown(inexact)
    finally:
        plain.engines.target.graph = replace(target, dtype="fp32")


def test_gpu_engines_get_a_verdict_of_their_own(tiny_bundle, tmp_path):
    """GPU engines pad every pass to ``pad_to`` rows; their verdict is measured on them (here the CPU emulation of
    the CUDA engine), so a graph whose rows depend on their partners is refused there too."""
    from specdec_edge.runtime.ort_gpu_engine import OrtGpuEngine

    graph = read_manifest(tiny_bundle).target.graph
    ref = Pipeline.load(tiny_bundle, method="plain", threads=1)
    padded = OrtGpuEngine(
        tiny_bundle / graph.path, graph, provider="cpu", device="cpu", threads=1, gpu=GpuOptions(pad_to=8)
    )
    pipe = Pipeline(ref.tokenizer, Engines(padded), "pld", 4)
    assert (
        pipe.engines.verdict.batch_invariant and pipe.engines.verdict.min_pass_width == 1
    )  # every narrow pass is 8 rows
    assert (
        pipe.generate("the quick brown fox", max_new_tokens=12).token_ids
        == ref.generate("the quick brown fox", max_new_tokens=12).token_ids
    )
    dyn = OrtGpuEngine(
        _dynamic_quantized(tiny_bundle, tmp_path),
        graph,
        provider="cpu",
        device="cpu",
        threads=1,
        gpu=GpuOptions(pad_to=8),
    )
    with pytest.raises(SpecdecError, match="not batch invariant"):
        Pipeline(ref.tokenizer, Engines(dyn), "pld", 4)
    assert Pipeline(ref.tokenizer, Engines(dyn), "plain").generate("the quick", max_new_tokens=4).token_ids


# ---- key counts modulo a kernel's block: ONNX Runtime's arm64 attention (found under emulation, docs/JETSON.md)


class BlockTailEngine(OrtEngine):
    """The real engine, with the rounding of a kernel that sums a row's keys in blocks of 4 over its pass's key
    count and adds the rest in a scalar tail (ONNX Runtime's attention on arm64, which cannot run natively here):
    a row's logits move by a fixed vector per tail length, so rows whose keys split alike round alike."""

    BLOCK = 4

    def run(self, input_ids, position_ids=None, attention_bias=None, logits_to_keep=None):
        seq, past = len(np.asarray(input_ids).reshape(-1)), self.length
        out = super().run(input_ids, position_ids, attention_bias, logits_to_keep)
        if position_ids is not None or attention_bias is not None:
            return out  # token trees: not modelled (this test verifies chains)
        total = past + max(seq, self.min_width)
        logits = np.array(out.logits, dtype=np.float32)
        for i, j in enumerate(range(seq - len(logits), seq)):
            keys = past + j + 1
            tail = keys - min(keys, self.BLOCK * (total // self.BLOCK))
            logits[i] += 0.5 * np.sin(np.arange(logits.shape[1]) * (tail + 1)) * (tail > 0)
        return replace(out, logits=logits)


def _block_tail_pipeline(bundle, method, verdict=None):
    graph = read_manifest(bundle).target.graph
    engine = BlockTailEngine(bundle / graph.path, graph, cpu=CpuThreads(1))
    tokenizer = Pipeline.load(bundle, method="plain", threads=1).tokenizer
    return Pipeline(tokenizer, Engines(engine, None, {}, verdict=verdict), method, k=6)


def test_rows_that_round_by_key_count_modulo_a_block_are_found_and_never_batched(tiny_bundle):
    graph = read_manifest(tiny_bundle).target.graph
    engine = BlockTailEngine(tiny_bundle / graph.path, graph, cpu=CpuThreads(1))
    verdict = to_verdict(measure(engine), {})
    bad = verdict.details["bad_residues"]
    # two rows after p slots: the last row has 3 mod 4 keys exactly when p is 1 mod 4 (plain's padded row has one
    # masked key more, so its keys fit the blocks); the verdict keeps speculation, cut where it would not match
    assert verdict.batch_invariant and verdict.details["residue_period"] == 16
    assert bad["2"] == [1, 5, 9, 13], bad
    assert 2 <= verdict.max_width <= 8 and "modulo 16" in describe(verdict, "fp32")
    assert Verdict.from_json(verdict.to_json()) == verdict
    assert engine.max_rows(41) == 1 and engine.max_rows(42) >= 2  # applied: a plain step where two rows differ
    # on the untouched engine (this CPU's kernels) nothing is found
    plain_engine = OrtEngine(tiny_bundle / graph.path, graph, cpu=CpuThreads(1))
    assert to_verdict(measure(plain_engine), {}).details["bad_residues"] == {}


def test_greedy_speculation_on_block_tail_rounding_equals_plain(tiny_bundle):
    prompts = ["The quick brown fox jumps over the lazy dog. " * 4, "def add(a, b):\n    return a + b\n" * 3]
    plain = _block_tail_pipeline(tiny_bundle, "plain")
    pld = _block_tail_pipeline(tiny_bundle, "pld")
    assert pld.engines.verdict.details["bad_residues"]
    unguarded = _block_tail_pipeline(tiny_bundle, "pld", verdict=replace(pld.engines.verdict, details={}))
    differs = 0
    for prompt in prompts:
        want = plain.generate(prompt, max_new_tokens=64, reuse=False).token_ids
        assert pld.generate(prompt, max_new_tokens=64, reuse=False).token_ids == want
        differs += unguarded.generate(prompt, max_new_tokens=64, reuse=False).token_ids != want
    assert differs  # without the residues the same speculation changes the output: the check is what keeps it exact


def test_a_verdict_with_malformed_residues_is_refused():
    for residues in ([1], {"2": "1"}, {"two": [1]}, {"2": [-1]}):
        with pytest.raises(ValueError, match="bad_residues"):
            Verdict.from_json({**INVARIANT.to_json(), "details": {"bad_residues": residues}})


# ---- plain decoding's rows computed once per distinct input (cheaper verdicts, the same comparison)


class KvByWidthEngine(OrtEngine):
    """The real engine, except that a chain pass of three rows writes its first row's K/V a little off: the rows it
    computes are right, but plain decoding's next row after that K/V is not what the pass computed for it."""

    def run(self, input_ids, position_ids=None, attention_bias=None, logits_to_keep=None):
        past, seq = self.length, len(np.asarray(input_ids).reshape(-1))
        out = super().run(input_ids, position_ids, attention_bias, logits_to_keep)
        if seq == 3 and position_ids is None:
            self.cache[..., past, :] += 0.25
        return out


def test_rows_shared_between_widths_are_keyed_by_the_kv_they_follow(tiny_bundle):
    from specdec_edge.runtime.verdicts import _chain_rows_match, _Probe

    graph = read_manifest(tiny_bundle).target.graph
    measured = measure(KvByWidthEngine(tiny_bundle / graph.path, graph, cpu=CpuThreads(1)))
    # width 3's rows after its own K/V are checked against plain rows computed after that K/V: they differ
    assert 3 in measured["failed_widths"] and measured["max_width"] == 2, measured
    clean = measure(OrtEngine(tiny_bundle / graph.path, graph, cpu=CpuThreads(1)))
    assert clean["max_width"] > 2 and clean["failed_widths"] == []

    def plain_rows_computed(engine) -> int:  # chains of 2 and 3 rows after 20 slots, sharing what they can
        probe = _Probe(engine, seed=1)
        chain, known, calls = probe.fill(24)[20:23], {}, []
        canonical = probe.canonical
        probe.canonical = lambda past, token: calls.append(past) or canonical(past, token)
        assert _chain_rows_match(probe, 20, chain[:2], known)[0]
        ok = _chain_rows_match(probe, 20, chain[:3], known)[0]
        return len(calls), ok

    # the clean engine: rows 0 and 1 of width 3 are width 2's (same token, same K/V before them), row 2 is new
    assert plain_rows_computed(OrtEngine(tiny_bundle / graph.path, graph, cpu=CpuThreads(1))) == (3, True)
    # width 3 wrote other K/V for its row 0: its row 1 is computed again, and then differs
    assert plain_rows_computed(KvByWidthEngine(tiny_bundle / graph.path, graph, cpu=CpuThreads(1))) == (4, False)


def test_the_verdict_reads_kv_through_the_engine(tiny_bundle):
    """``Engine.host_kv``, what the verdict compares K/V with: a copy of slots as the last run left them (past the
    committed length too); None where the cache is not in host memory (the GPU engines, here their CPU emulation),
    where the verdict compares logits only."""
    from specdec_edge.runtime.ort_gpu_engine import OrtGpuEngine

    graph = read_manifest(tiny_bundle).target.graph
    c = graph.cache
    engine = OrtEngine(tiny_bundle / graph.path, graph, cpu=CpuThreads(1))
    prefill(engine, [5, 6, 7])
    engine.run([8, 9])  # slots 3 and 4 written, not committed
    kv = engine.host_kv(2, 5)
    assert kv.shape == (c.num_layers, 2, 1, c.num_kv_heads, 3, c.head_dim)
    np.testing.assert_array_equal(kv[..., :1, :], engine.snapshot()[..., 2:, :])
    assert (kv[..., 1:, :] != 0).any()  # the uncommitted slots
    kv[...] = 0
    assert engine.host_kv(2, 5).any()  # a copy: the cache is untouched
    gpu = OrtGpuEngine(tiny_bundle / graph.path, graph, provider="cpu", device="cpu", threads=1, gpu=GpuOptions(8))
    assert gpu.host_kv(0, 1) is None and gpu.can_snapshot


@pytest.mark.parametrize(
    "edit",
    [
        lambda v: v.update(min_pass_width=3 - v["min_pass_width"]),  # 1 <-> 2: a change whatever this CPU measured
        lambda v: v.update(max_width=64, batch_invariant=True, tree_invariant=True),
        lambda v: v["details"].update(boundaries=[7, 300]),
        lambda v: v["details"].update(bad_residues={"2": [1, 5]}),
        lambda v: v["device"].update(threads=99),
    ],
    ids=["width", "flags", "boundaries", "residues", "device"],
)
def test_an_edited_cached_verdict_is_measured_again(tiny_bundle, edit):
    """A cached verdict carries a checksum over itself, the bundle digest and the device: a file edited by accident
    (still valid JSON, a plausible verdict) is not trusted: measured again, said so, rewritten whole, and `info`
    does not list it meanwhile."""
    from specdec_edge.runtime.verdicts import bundle_digest, verdict_path

    graph = read_manifest(tiny_bundle).target.graph
    recorded = _other_device(graph.verdict)
    engine = OrtEngine(tiny_bundle / graph.path, graph, cpu=CpuThreads(1))
    here = graph.verdict.device
    first = device_verdict(tiny_bundle, recorded, graph.path, engine, here)
    path = verdict_path(bundle_digest(tiny_bundle), graph.path, here)
    data = json.loads(path.read_text())
    edit(data["verdict"])
    path.write_text(json.dumps(data))
    assert not any(v["device"] == here for v in cached_verdicts(tiny_bundle))
    lines = []
    again = device_verdict(tiny_bundle, recorded, graph.path, engine, here, progress=lines.append)
    assert len(lines) == 2 and "damaged or edited" in lines[0], lines
    assert replace(again, details={}) == replace(first, details={})
    assert any(v["device"] == here for v in cached_verdicts(tiny_bundle))  # rewritten whole
