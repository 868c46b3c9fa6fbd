"""The prefill graph: the target graph once more, its 4-bit layers computing with fp32 activations.

A target graph's 4-bit layers (``MatMulNBits``, ``linears.ACCURACY_LEVEL`` 4) quantize every activation block to
int8 before multiplying: the rounding that makes decode passes cheap. A prefill pass has hundreds of rows, where
ONNX Runtime's other path for the same weights (accuracy level 1: the 4-bit blocks unpacked to fp32 once per call,
then an fp32 GEMM) can be the faster one, and it computes the prompt's K/V as the fp32 model does (the default gguf
bundle: 3e-6 relative error against the fp32 export's K/V, where the int8 path's is 5e-2; docs/lab/prefill-and-
passes.md). ``write_prefill_graph`` saves that form beside the target graph: the same nodes, inputs, outputs and
weights (it reads the target graph's own external data file, so it adds ~200 KB to a bundle, not a second copy of
the weights), with every 4-bit ``MatMulNBits`` at accuracy level 1; other layers (the 8-bit LM head) as they are.
Whether a device prefills with it is measured there (``runtime/prefill_choice.py``); decode passes never use it.
"""

from __future__ import annotations

from pathlib import Path

PREFILL_FILE = "prefill.onnx"
PREFILL_LEVEL = 1  # MatMulNBits' accuracy level for fp32 activations


def write_prefill_graph(graph_path: Path) -> str | None:
    """Write ``prefill.onnx`` beside the graph at ``graph_path`` when it has 4-bit layers at another accuracy level,
    reading the same external data file; return its file name, or None (no such layers: nothing to gain)."""
    import onnx
    from onnx import helper

    model = onnx.load(str(graph_path), load_external_data=False)
    changed = 0
    for node in model.graph.node:
        if node.op_type != "MatMulNBits":
            continue
        attributes = {a.name: a for a in node.attribute}
        if helper.get_attribute_value(attributes["bits"]) != 4:
            continue
        level = attributes.get("accuracy_level")
        if level is None:
            node.attribute.append(helper.make_attribute("accuracy_level", PREFILL_LEVEL))
        elif level.i != PREFILL_LEVEL:
            level.i = PREFILL_LEVEL
        else:
            continue
        changed += 1
    if not changed:
        return None
    out = Path(graph_path).with_name(PREFILL_FILE)
    onnx.save_model(model, str(out))  # its tensors keep their external data locations: the target graph's file
    return out.name
