"""TensorRT shape profiles and ONNX Runtime TensorRT EP options for a bundle graph.

TensorRT builds kernels for a range of input shapes (an optimization profile). Both TensorRT
paths -- the ONNX Runtime TensorRT EP (``ort_gpu_engine``) and engines built by ``specdec-edge
build-engines`` (``export/build_engines.py``) -- use the profiles made here, so an engine
accepts every pass the runtime sends: prefill chunks, padded decode passes and verified trees.
"""

from __future__ import annotations

from pathlib import Path

from specdec_edge.bundle.schema import GraphSpec
from specdec_edge.errors import SpecdecError
from specdec_edge.runtime.base import MAX_VERIFY, PAD_TO, PREFILL_CHUNK


def max_pass_tokens(graph: GraphSpec, max_verify: int = MAX_VERIFY) -> int:
    """The largest S one pass may have: a prefill chunk or a verified tree, capped by the cache."""
    return min(graph.cache.capacity, max(PREFILL_CHUNK, max_verify))


def tensorrt_profiles(graph: GraphSpec, max_verify: int = MAX_VERIFY) -> dict[str, tuple]:
    """One optimization profile: input name -> (min, opt, max) shape, batch 1.

    S (new tokens) spans 1..max_pass_tokens, optimized for a padded decode pass (PAD_TO rows); the bias width
    (past + S) spans 1..capacity. The cache buffers are fixed at the exported capacity.
    ``logits_to_keep`` is a shape *value* input (it sizes the logits): see ``shape_value_ranges``.
    """
    cache = graph.cache
    top = max_pass_tokens(graph, max_verify)
    opt_s = min(PAD_TO, top)  # GPU engines pad every decode pass to PAD_TO rows (runtime/base.pad_step)
    opt_t = max(opt_s, cache.capacity // 2)
    profiles = {
        "input_ids": ((1, 1), (1, opt_s), (1, top)),
        "position_ids": ((1, 1), (1, opt_s), (1, top)),
        "attention_bias": ((1, 1, 1, 1), (1, 1, opt_s, opt_t), (1, 1, top, cache.capacity)),
    }
    kv = (1, cache.num_kv_heads, cache.capacity, cache.head_dim)
    for layer in range(cache.num_layers):
        for kind in ("key", "value"):
            profiles[cache.input_name(layer, kind)] = (kv, kv, kv)
    return profiles


def shape_value_ranges(graph: GraphSpec, max_verify: int = MAX_VERIFY) -> dict[str, tuple]:
    """Inputs whose *values* are shapes for TensorRT: name -> (min, opt, max) values."""
    top = max_pass_tokens(graph, max_verify)
    return {"logits_to_keep": ((1,), (min(PAD_TO, top),), (top,))}


def _profile_string(profiles: dict, which: int) -> str:
    return ",".join(f"{name}:{'x'.join(str(d) for d in shapes[which])}" for name, shapes in profiles.items())


def tensorrt_ep_options(
    graph: GraphSpec, cache_dir: str | Path, *, max_verify: int = MAX_VERIFY, fp16: bool | None = None
) -> dict[str, str]:
    """ONNX Runtime TensorRT EP options for ``graph``: explicit profile, precision, engine cache.

    fp16 defaults to the graph's precision (an fp32 graph stays fp32, so it matches CPU results).
    """
    if graph.flavour != "portable":
        raise SpecdecError(
            f"the {graph.flavour!r} graph uses ONNX Runtime's fused ops that TensorRT cannot run; "
            "export with --flavour portable (and --dtype fp16) for provider 'tensorrt' or 'trt'."
        )
    profiles = tensorrt_profiles(graph, max_verify)
    cache_dir = Path(cache_dir)
    return {
        "device_id": "0",  # GPU engines use device 0: choose the GPU with CUDA_VISIBLE_DEVICES
        "trt_fp16_enable": "1" if (graph.dtype == "fp16" if fp16 is None else fp16) else "0",
        "trt_engine_cache_enable": "1",
        "trt_engine_cache_path": str(cache_dir),
        "trt_timing_cache_enable": "1",
        "trt_timing_cache_path": str(cache_dir),
        "trt_profile_min_shapes": _profile_string(profiles, 0),
        "trt_profile_opt_shapes": _profile_string(profiles, 1),
        "trt_profile_max_shapes": _profile_string(profiles, 2),
    }
