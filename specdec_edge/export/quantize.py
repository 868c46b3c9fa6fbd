"""Weight quantization of an fp32 decoder graph with ONNX Runtime's tools (CPU).

* int8: dynamic quantization of the MatMul weights (``quantize_dynamic``, QInt8, per
  channel) except the LM head and the MLP down projections.
* int4: weight-only blockwise quantization to ``MatMulNBits`` (block 32, symmetric,
  accuracy_level 4 = int8 activations; level 0 is ~3x slower here).
The attention op and the cache stay fp32.
"""

from __future__ import annotations

from pathlib import Path

import onnx


def quantize(src: Path, dst: Path, dtype: str) -> None:
    dst = Path(dst)
    if dtype == "int8":
        import logging

        from onnxruntime.quantization import QuantType, quantize_dynamic

        logging.getLogger().setLevel(logging.ERROR)  # "consider pre-processing" advice does not apply

        quantize_dynamic(
            str(src),
            str(dst),
            weight_type=QuantType.QInt8,
            op_types_to_quantize=["MatMul"],
            # Activations are quantized per tensor at run time; the LM head and the MLP down
            # projection see outlier channels that wreck that (SmolLM2-135M: top-1 agreement
            # with fp32 49 % with them quantized, 79 % without; docs/PERFORMANCE.md).
            nodes_to_exclude=_nodes_reading(src, ("lm_head", "down_proj")),
            per_channel=True,
            use_external_data_format=True,
            extra_options={"MatMulConstBOnly": True, "DefaultTensorType": onnx.TensorProto.FLOAT},
        )
        model = onnx.load(str(dst))
    elif dtype == "int4":
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

        model = onnx.load(str(src))
        q = MatMulNBitsQuantizer(model, block_size=32, is_symmetric=True, accuracy_level=4)
        q.process()
        model = q.model.model
    else:
        raise ValueError(dtype)
    for p in dst.parent.glob(dst.name + "*"):
        p.unlink()
    save(model, dst)


def _nodes_reading(path: Path, weight_names: tuple) -> list[str]:
    graph = onnx.load(str(path), load_external_data=False).graph
    return [n.name for n in graph.node if any(w in i for i in n.input for w in weight_names)]


def save(model: onnx.ModelProto, path: Path) -> None:
    """Save with all weights in one external file ``<name>.data`` beside the graph."""
    from specdec_edge.export.graph import IR_VERSION

    model.ir_version = min(model.ir_version, IR_VERSION)
    onnx.save_model(
        model,
        str(path),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=Path(path).name + ".data",
        size_threshold=1024,
    )
