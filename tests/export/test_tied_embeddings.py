"""Tied embeddings are stored once: the embedding Gather and the LM head read one table, and the graph computes
what it computed with two copies (bit for bit where the table keeps its values: float, a GGUF's own blocks)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from gguf import GGMLQuantizationType, quants

from specdec_edge.bundle.manifest import read_manifest
from specdec_edge.export import graph as graph_module
from specdec_edge.export.exporter import export_bundle
from specdec_edge.export.gguf_blocks import blocks_from_raw
from specdec_edge.export.graph import build_decoder, save
from specdec_edge.export.sources import load_model
from specdec_edge.runtime.ort_engine import OrtEngine
from specdec_edge.runtime.threads import CpuThreads
from specdec_edge.speculative.loop import prefill


def vocab_tables(path, vocab: int, hidden: int) -> list[str]:
    """Initializers that hold a whole [V, H] table in some form (float, transposed, int8, packed 4-bit blocks)."""
    model = onnx.load(str(path), load_external_data=False)
    return [i.name for i in model.graph.initializer if vocab in i.dims and int(np.prod(i.dims)) >= vocab * hidden // 2]


def readers(path, name: str) -> set[str]:
    """Op types of the nodes that read initializer ``name``, directly or through one Reshape/Transpose."""
    nodes = onnx.load(str(path), load_external_data=False).graph.node
    direct = [n for n in nodes if name in n.input]
    through = {o for n in direct if n.op_type in ("Reshape", "Transpose") for o in n.output}
    return {n.op_type for n in direct} | {n.op_type for n in nodes if through & set(n.input)}


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "int8", "int4"])
def test_a_tied_model_stores_its_embedding_once(base_gemma_dir, tmp_path, dtype):
    out = export_bundle(str(base_gemma_dir), tmp_path / dtype, dtype=dtype, capacity=64, progress=False)
    m = read_manifest(out)
    graph = m.target.graph
    path = out / graph.path
    tables = vocab_tables(path, graph.vocab_size, graph.hidden_size)
    assert len(tables) == 1, f"the tied embedding is stored {len(tables)} times: {tables}"
    ops = readers(path, tables[0])
    assert "Gather" in ops, "the embedding reads the table"
    assert ops & {"MatMul", "MatMulInteger", "MatMulNBits"}, "the LM head reads the same table"
    if dtype in ("fp32", "fp16"):  # random weights: int8/int4 rounding flips some of their near-tied argmaxes
        assert m.target.validation["top1_agreement"] == 1.0


def test_an_untied_model_keeps_both_tables(tiny_bundle):
    """The check above sees two tables where there are two (Llama here does not tie its head)."""
    graph = read_manifest(tiny_bundle).target.graph
    assert len(vocab_tables(tiny_bundle / graph.path, graph.vocab_size, graph.hidden_size)) == 2


@pytest.fixture(scope="module")
def gemma_cfg(base_gemma_dir):
    return load_model(str(base_gemma_dir), capacity=256).decoder


def run_logits(cfg, spec, folder, two_tables=False) -> np.ndarray:
    """Logits of a 3-token pass after an 8-token prefill through the real engine; ``two_tables``: the graph as it
    was built before (a float embedding beside the LM head's own copy)."""
    folder.mkdir()
    path = folder / "model.onnx"
    with pytest.MonkeyPatch.context() as mp:
        if two_tables:
            mp.setattr(graph_module, "tied_weights", lambda *args: None)
        save(build_decoder(cfg, flavour="ort", dtype="fp32", capacity=256, hidden_states=False), path)
    assert len(vocab_tables(path, cfg.vocab_size, cfg.hidden_size)) == (2 if two_tables else 1)
    engine = OrtEngine(path, spec, cpu=CpuThreads(1))
    prefill(engine, [5, 9, 17, 33, 2, 8, 41, 12])
    return engine.run([7, 3, 11]).logits.copy()


# K-quants need rows of 256 values; these cover 4- and 8-bit blocks, zero points and minima.
@pytest.mark.parametrize("qtype", [None, "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_one_table_computes_what_two_did_bit_for_bit(gemma_cfg, base_gemma_bundle, tmp_path, qtype):
    """fp32, and a GGUF's own blocks (the embedding dequantizes the rows it gathers from the LM head's blocks)."""
    cfg = gemma_cfg
    if qtype is not None:
        embed = cfg.weights["model.embed_tokens.weight"]
        blocks = blocks_from_raw(quants.quantize(embed, GGMLQuantizationType[qtype]), qtype)
        # As transformers loads such a file: the float weights are the blocks' values, the head tied to them.
        table = blocks.dequantize()
        weights = {**cfg.weights, "model.embed_tokens.weight": table, "lm_head.weight": table}
        cfg = type(cfg)(**{**cfg.__dict__, "weights": weights, "quantized": {"model.embed_tokens.weight": blocks}})
    spec = read_manifest(base_gemma_bundle).target.graph
    one = run_logits(cfg, spec, tmp_path / "one")
    two = run_logits(cfg, spec, tmp_path / "two", two_tables=True)
    np.testing.assert_array_equal(one, two)


# ---- heads: an EAGLE head embeds tokens with the target's table


def own_tables(path, vocab: int, hidden: int) -> list[str]:
    """[V, H] tables whose bytes a graph holds itself (not read from another graph's data file): initializers, or
    Constant nodes (how torch's exporter writes a buffer)."""
    model = onnx.load(str(path), load_external_data=False)
    own_data = path.name + ".data"
    tensors = [*model.graph.initializer, *(n.attribute[0].t for n in model.graph.node if n.op_type == "Constant")]
    return [
        t.name
        for t in tensors
        if list(t.dims) == [vocab, hidden]
        and ({e.value for e in t.external_data if e.key == "location"} or {own_data}) == {own_data}
    ]


def test_eagle_head_reads_the_target_table(heads_bundle):
    m = read_manifest(heads_bundle)
    graph, eagle = m.target.graph, m.heads["eagle"]
    assert eagle.graph == "target/eagle_head.onnx"  # beside the target graph, whose data file it reads
    head = onnx.load(str(heads_bundle / eagle.graph), load_external_data=False)
    table = next(i for i in head.graph.initializer if list(i.dims) == [graph.vocab_size, graph.hidden_size])
    target = onnx.load(str(heads_bundle / graph.path), load_external_data=False)
    embed = next(i for i in target.graph.initializer if i.name == "model.embed_tokens.weight")
    assert {e.key: e.value for e in table.external_data} == {e.key: e.value for e in embed.external_data}
    assert not own_tables(heads_bundle / eagle.graph, graph.vocab_size, graph.hidden_size)
    assert not (heads_bundle / "heads" / "eagle.onnx").exists()
    assert m.heads["medusa"].graph == "heads/medusa.onnx"  # reads no embedding


def test_add_heads_replaces_a_head_that_reads_the_target_table(heads_bundle, trained, tmp_path):
    from specdec_edge.api.pipeline import Pipeline
    from specdec_edge.export.head_export import add_heads

    out = add_heads(heads_bundle, [trained / "eagle"], tmp_path / "again")
    m = read_manifest(out)
    assert set(m.heads) == {"eagle"} and m.heads["eagle"].graph == "target/eagle_head.onnx"
    assert not (out / "heads" / "medusa.onnx").exists()
    plain = Pipeline.load(out, method="plain", threads=1).generate("the quick brown", 16)
    assert Pipeline.load(out, method="eagle", threads=1).generate("the quick brown", 16).token_ids == plain.token_ids


def test_a_head_over_a_quantized_table_ships_its_own_copy_once(base_gemma_dir, trained, tmp_path):
    """int8 stores a tied table as int8 rows, which the head's float Gather cannot read: one fp16 copy."""
    out = export_bundle(
        str(base_gemma_dir),
        tmp_path / "int8-heads",
        dtype="int8",
        capacity=64,
        heads=(trained / "eagle",),
        progress=False,
    )
    m = read_manifest(out)
    graph = m.target.graph
    assert m.heads["eagle"].graph == "heads/eagle.onnx"
    assert len(own_tables(out / "heads" / "eagle.onnx", graph.vocab_size, graph.hidden_size)) == 1
    assert vocab_tables(out / graph.path, graph.vocab_size, graph.hidden_size) == ["model.embed_tokens.weight.q.T"]
