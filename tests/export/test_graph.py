"""The decoder graph builder's structure, at every dtype and flavour (no ONNX Runtime session): the contract's
inputs and outputs, a well-formed graph, each linear weight in the form its dtype asks for, errors for bad
arguments. That a refactor of the builder changes no byte is shown by ``benchmarks/graph_hashes.py``."""

from __future__ import annotations

import collections

import onnx
import pytest

from specdec_edge.export.graph import build_decoder
from specdec_edge.export.sources import load_model

# the op that reads each linear weight, by dtype
LINEAR_OP = {"fp32": "MatMul", "fp16": "MatMul", "int8": "MatMulInteger", "int4": "MatMulNBits"}
FEATURES = (0, 1)


@pytest.fixture(scope="module")
def configs(tiny_llama_dir, base_gemma_dir):
    """Llama (untied head, packed QKV on ort) and Gemma 3 (tied, sliding window, QK norms, sandwich norms)."""
    return {
        name: load_model(str(d), capacity=64).decoder
        for name, d in (("llama", tiny_llama_dir), ("gemma3", base_gemma_dir))
    }


def build(cfg, flavour, dtype, hidden_states=False, feature_layers=()):
    return build_decoder(
        cfg, flavour=flavour, dtype=dtype, capacity=64, hidden_states=hidden_states, feature_layers=feature_layers
    )


def check_well_formed(model: onnx.ModelProto) -> None:
    """Every node reads names defined before it, every initializer is read, node and value names are unique."""
    graph = model.graph
    defined = {i.name for i in graph.input} | {i.name for i in graph.initializer} | {""}
    assert len(defined) == len(graph.input) + len(graph.initializer) + 1, "an input shadows an initializer"
    read, names = set(), collections.Counter(n.name for n in graph.node)
    for node in graph.node:
        missing = set(node.input) - defined
        assert not missing, f"{node.name} ({node.op_type}) reads {missing} before they exist"
        assert not set(node.output) & defined, f"{node.name} redefines {set(node.output) & defined}"
        defined |= set(node.output)
        read |= set(node.input)
    assert not [n for n, c in names.items() if c > 1], "node names repeat"
    assert not {i.name for i in graph.initializer} - read, "initializers nothing reads"
    assert {o.name for o in graph.output} <= defined


@pytest.mark.parametrize("flavour", ["ort", "portable"])
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "int8", "int4"])
@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_graph_keeps_the_contract_at_every_dtype(configs, name, dtype, flavour):
    cfg = configs[name]
    cache = [f"{{}}.{i}.{kind}" for i in range(cfg.num_layers) for kind in ("key", "value")]
    for hidden, layers in ((False, ()), (True, ()), (True, FEATURES)):
        model = build(cfg, flavour, dtype, hidden, layers)
        check_well_formed(model)
        graph = model.graph
        assert [i.name for i in graph.input] == [
            "input_ids",
            "position_ids",
            "attention_bias",
            "logits_to_keep",
            *(c.format("past_key_values") for c in cache),
        ]
        extra = (["hidden_states"] if hidden else []) + (["layer_features"] if layers else [])
        assert [o.name for o in graph.output] == ["logits", *(c.format("present") for c in cache), *extra]
        shapes = {o.name: [d.dim_value or d.dim_param for d in o.type.tensor_type.shape.dim] for o in graph.output}
        assert shapes["logits"] == ["batch", "kept", cfg.vocab_size]
        if layers:
            assert shapes["layer_features"] == ["batch", "seq", len(layers) * cfg.hidden_size]
        # contrib ops: GroupQueryAttention and the fused norms (ort), MatMulNBits (int4); MatMulInteger is standard
        contrib = flavour == "ort" or dtype == "int4"
        assert {n.domain for n in graph.node} == ({"", "com.microsoft"} if contrib else {""})
        if not contrib:
            onnx.checker.check_model(model, full_check=True)


@pytest.mark.parametrize("dtype", ["fp32", "int8", "int4"])
def test_each_linear_weight_takes_its_dtypes_form(configs, dtype):
    """Llama on ort: per layer one packed QKV, o_proj, one gate+up, down_proj, plus the untied LM head."""
    cfg = configs["llama"]
    ops = collections.Counter(n.op_type for n in build(cfg, "ort", dtype).graph.node)
    assert ops[LINEAR_OP[dtype]] == 4 * cfg.num_layers + 1
    assert ops["GroupQueryAttention"] == cfg.num_layers


def test_a_tied_float_head_reads_the_embedding_table(configs):
    """Gemma 3 ties its head: at fp32 the LM head multiplies by the embedding table itself, not a copy."""
    graph = build(configs["gemma3"], "ort", "fp32").graph
    table = "model.embed_tokens.weight"
    assert [i.name for i in graph.initializer].count(table) == 1
    readers = {n.op_type for n in graph.node if table in n.input}
    assert readers == {"Gather", "Transpose"}


def test_bad_arguments_are_refused(configs):
    cfg = configs["llama"]
    with pytest.raises(ValueError, match="unknown flavour"):
        build(cfg, "tensorrt", "fp32")
    with pytest.raises(ValueError, match="outside 0..1"):
        build(cfg, "ort", "fp32", True, (0, 2))


def test_save_ignores_a_data_file_in_the_working_directory(tmp_path, monkeypatch):
    """onnx 1.23's external-data save refuses when the *working* directory holds a file of the data file's
    name; ``graph.save`` marks the tensors itself and writes the same bytes onnx would."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from specdec_edge.export.graph import IR_VERSION, save

    weight = numpy_helper.from_array(np.arange(4096, dtype=np.float32).reshape(64, 64), "w")
    small = numpy_helper.from_array(np.ones(4, dtype=np.float32), "b")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])],
        initializer=[weight, small],
    )
    model = helper.make_model(graph)
    model.ir_version = min(model.ir_version, IR_VERSION)  # what save() writes
    (tmp_path / "onnx").mkdir()
    monkeypatch.chdir(tmp_path / "onnx")
    onnx.save_model(
        onnx.ModelProto.FromString(model.SerializeToString()),
        str(tmp_path / "onnx" / "model.onnx"),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="model.onnx.data",
        size_threshold=1024,
    )
    (tmp_path / "ours").mkdir()  # the working directory now holds a model.onnx.data (onnx's own)
    save(onnx.ModelProto.FromString(model.SerializeToString()), tmp_path / "ours" / "model.onnx")
    for name in ("model.onnx", "model.onnx.data"):
        assert (tmp_path / "ours" / name).read_bytes() == (tmp_path / "onnx" / name).read_bytes()
