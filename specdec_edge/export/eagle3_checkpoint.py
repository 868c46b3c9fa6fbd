"""EAGLE-3 heads as a serving-engine checkpoint: the drafter folder vLLM, SGLang and TensorRT-LLM load.

``export-drafter`` writes a trained ``eagle3`` heads folder (``heads_folder.py``) in the layout of the
reference EAGLE repository's EAGLE-3 checkpoints, as vLLM's and SGLang's ``LlamaForCausalLMEagle3``
loaders read it::

    config.json         a one-layer Llama config: architectures ["LlamaForCausalLMEagle3"], the target's
                        vocab_size and the head's draft_vocab_size, head sizes, rope_theta, and the target
                        layers it reads (eagle_aux_hidden_state_layer_ids; vLLM's numbering: k = the hidden
                        state entering layer k, 0 = the embedding -- ours too)
    model.safetensors   fc.weight [H, n*H]; midlayer.* (q/k/v projections read 2H: the normed embedding,
                        then the normed feature); norm.weight; lm_head.weight [V', H];
                        d2t [V'] int64 (target id - draft id: target = draft + d2t[draft]); t2d [V] bool

The embedding is not stored: the engines take the target's, as for the reference checkpoints. The
weights are the heads folder's fp16 values, bit for bit. ``read_checkpoint`` reads such a folder back
(ours, or one trained elsewhere in this layout) as heads-folder tensors, so ``export --heads`` takes it.
No serving engine runs on this machine: the layout is checked against the reference names and shapes
(tests/export/test_eagle3.py), not by loading it into vLLM.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from importlib import metadata
from pathlib import Path

import numpy as np

from specdec_edge.errors import ExportError
from specdec_edge.export.head_modules import HeadConfig

ARCHITECTURE = "LlamaForCausalLMEagle3"
WEIGHTS = "model.safetensors"
# Our Eagle3Head's parameter names -> the reference checkpoint's tensor names.
NAMES = {
    "fc.weight": "fc.weight",
    "q_proj.weight": "midlayer.self_attn.q_proj.weight",
    "k_proj.weight": "midlayer.self_attn.k_proj.weight",
    "v_proj.weight": "midlayer.self_attn.v_proj.weight",
    "o_proj.weight": "midlayer.self_attn.o_proj.weight",
    "gate_proj.weight": "midlayer.mlp.gate_proj.weight",
    "up_proj.weight": "midlayer.mlp.up_proj.weight",
    "down_proj.weight": "midlayer.mlp.down_proj.weight",
    "input_norm": "midlayer.input_layernorm.weight",
    "hidden_norm": "midlayer.hidden_norm.weight",
    "post_norm": "midlayer.post_attention_layernorm.weight",
    "norm": "norm.weight",
    "lm_head": "lm_head.weight",
}


def checkpoint_config(cfg: HeadConfig) -> dict:
    """The checkpoint's config.json for an ``eagle3`` head config."""
    try:
        transformers_version = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        transformers_version = None
    layers = list(cfg.feature_layers)
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": cfg.hidden_size,
        "target_hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": 2048,
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab,
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
        "use_cache": True,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "pretraining_tp": 1,
        "transformers_version": transformers_version,
        "eagle_aux_hidden_state_layer_ids": layers,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": layers, "use_aux_hidden_state": True},
        "specdec_edge": {"method": "eagle3", "ttt_steps": cfg.ttt_steps, "training": cfg.training},
    }


def write_checkpoint(heads: str | Path, out: str | Path, force: bool = False) -> Path:
    """Write the ``eagle3`` heads folder ``heads`` as a serving-engine checkpoint folder ``out``; returns it."""
    from safetensors.numpy import load_file

    from specdec_edge.bundle.write import disk_errors, prepare_out_dir

    out = Path(out).resolve()
    prepare_out_dir(out, force)  # an occupied or unwritable --out first
    heads = Path(heads)
    if not (heads / "config.json").is_file() or not (heads / "weights.safetensors").is_file():
        raise ExportError(
            f"{heads} is not a heads folder (config.json + weights.safetensors); "
            "train one with `specdec-edge train-draft --method eagle3`."
        )
    cfg = HeadConfig(**json.loads((heads / "config.json").read_text()))
    if cfg.method != "eagle3":
        raise ExportError(
            f"{heads} holds {cfg.method} heads; serving engines load EAGLE-3 drafters: "
            "train them with `specdec-edge train-draft --method eagle3`."
        )
    tensors = load_file(str(heads / "weights.safetensors"))
    vocab_ids = tensors.pop("vocab_ids").astype(np.int64)
    missing = sorted(set(NAMES) - set(tensors))
    if missing or set(tensors) - set(NAMES):
        raise ExportError(f"{heads} does not hold an EAGLE-3 head's weights (missing {missing}); retrain it.")
    out_tensors = {NAMES[k]: np.ascontiguousarray(v) for k, v in tensors.items()}
    out_tensors["d2t"] = vocab_ids - np.arange(len(vocab_ids), dtype=np.int64)
    t2d = np.zeros(cfg.vocab_size, dtype=bool)
    t2d[vocab_ids] = True
    out_tensors["t2d"] = t2d
    with disk_errors(out):
        _write(out, out_tensors, checkpoint_config(cfg))
    return out


def _write(out: Path, out_tensors: dict, config: dict) -> None:
    """The checkpoint folder, staged beside ``out`` and renamed into place."""
    from safetensors.numpy import save_file

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))  # renamed into place
    try:
        save_file(out_tensors, str(staging / WEIGHTS), metadata={"format": "pt"})
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def is_checkpoint(folder: str | Path) -> bool:
    """Whether ``folder`` looks like an EAGLE-3 serving checkpoint (config.json naming the architecture)."""
    path = Path(folder) / "config.json"
    if not path.is_file() or not (Path(folder) / WEIGHTS).is_file():
        return False
    try:
        return ARCHITECTURE in json.loads(path.read_text()).get("architectures", [])
    except (json.JSONDecodeError, AttributeError):
        return False


def read_checkpoint(folder: str | Path) -> tuple[HeadConfig, dict[str, np.ndarray]]:
    """A serving checkpoint folder as (head config, heads-folder tensors: our names, fp16, and ``vocab_ids``)."""
    from safetensors.numpy import load_file

    folder = Path(folder)
    c = json.loads((folder / "config.json").read_text())
    layers = c.get("eagle_aux_hidden_state_layer_ids") or (c.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids"
    )
    problems = [
        (c.get("num_hidden_layers", 1) != 1, "more than one decoder layer"),
        (c.get("target_hidden_size", c["hidden_size"]) != c["hidden_size"], "a target hidden size of its own"),
        (bool(c.get("norm_before_residual")), "norm_before_residual"),
        (not layers, "no eagle_aux_hidden_state_layer_ids (which target layers it reads)"),
    ]
    for bad, what in problems:
        if bad:
            raise ExportError(f"the EAGLE-3 checkpoint {folder} has {what}; only the reference layout is supported.")
    tensors = load_file(str(folder / WEIGHTS))
    draft_vocab = int(c.get("draft_vocab_size") or c["vocab_size"])
    d2t = tensors.pop("d2t", np.zeros(draft_vocab, np.int64)).astype(np.int64)
    vocab_ids = np.arange(draft_vocab, dtype=np.int64) + d2t
    t2d = tensors.pop("t2d", None)
    if t2d is not None and not np.array_equal(np.flatnonzero(t2d), np.sort(vocab_ids)):
        raise ExportError(f"the EAGLE-3 checkpoint {folder} has d2t and t2d maps that disagree; re-export it.")
    theirs = {v: k for k, v in NAMES.items()}
    missing = sorted(set(theirs) - set(tensors))
    if missing:
        raise ExportError(f"the EAGLE-3 checkpoint {folder} lacks {missing}; it cannot be used as a head.")
    ours = {theirs[k]: v.astype(np.float16) for k, v in tensors.items() if k in theirs}
    ours["vocab_ids"] = vocab_ids.astype(np.int32)
    H = int(c["hidden_size"])
    cfg = HeadConfig(
        method="eagle3",
        hidden_size=H,
        vocab_size=int(c["vocab_size"]),
        draft_vocab=draft_vocab,
        num_heads=int(c["num_attention_heads"]),
        num_kv_heads=int(c.get("num_key_value_heads", c["num_attention_heads"])),
        head_dim=int(c.get("head_dim") or H // int(c["num_attention_heads"])),
        intermediate_size=int(c["intermediate_size"]),
        rope_theta=float(c.get("rope_theta", 10000.0)),
        rms_eps=float(c.get("rms_norm_eps", 1e-5)),
        feature_layers=[int(k) for k in layers],
        ttt_steps=int((c.get("specdec_edge") or {}).get("ttt_steps", 0)),
        training=(c.get("specdec_edge") or {}).get("training", {"source": str(folder)}),
    )
    return cfg, ours
