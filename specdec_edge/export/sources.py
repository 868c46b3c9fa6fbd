"""Load a causal LM from a Hugging Face id, a local folder or a .gguf file.

Returns the PyTorch model (for weights and validation), its tokenizer and a
``DecoderConfig`` for the graph builder. transformers is imported here only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specdec_edge.errors import ExportError
from specdec_edge.export.arch import arch_for
from specdec_edge.export.graph import DecoderConfig


@dataclass
class LoadedModel:
    source: str
    revision: str | None
    model: object  # transformers PreTrainedModel, fp32, eval mode
    tokenizer: object  # transformers tokenizer
    decoder: DecoderConfig


def _looks_like_path(source: str) -> bool:
    return (
        source.endswith(".gguf")
        or source.startswith((".", "/", "~"))
        or os.sep in source.rstrip(os.sep)
        and source.count("/") != 1
    )


def resolve_source(source: str) -> tuple[str, dict]:
    """Map the user's --target/--draft value to (from_pretrained argument, extra kwargs)."""
    path = Path(os.path.expanduser(source))
    if path.exists():
        if path.is_file():
            if path.suffix != ".gguf":
                raise ExportError(
                    f"{source} is a file but not a .gguf; pass a .gguf file, a model folder or a Hugging Face id."
                )
            return str(path.parent), {"gguf_file": path.name}
        if not (path / "config.json").is_file():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return str(path), {"gguf_file": ggufs[0].name}
            raise ExportError(
                f"folder {source} has no config.json"
                + (f" and {len(ggufs)} .gguf files (pass one of them)" if ggufs else "")
                + "; pass a Hugging Face model folder (config.json + safetensors + tokenizer) or a .gguf file."
            )
        return str(path), {}
    if _looks_like_path(source):
        raise ExportError(
            f"model path {source} does not exist; check the path "
            "(a folder, a .gguf file, or a Hugging Face id like org/name)."
        )
    return source, {}


def load_model(source: str, revision: str | None = None, capacity: int = 2048) -> LoadedModel:
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    transformers.logging.disable_progress_bar()  # the exporter reports its own stages
    transformers.logging.set_verbosity_error()
    name, kwargs = resolve_source(source)
    if revision:
        kwargs["revision"] = revision
    try:
        config = AutoConfig.from_pretrained(name, **kwargs)
    except OSError as e:
        raise ExportError(f"could not load a model config from {source!r}: {str(e).splitlines()[0]}") from None
    except ValueError as e:  # unknown model_type in config.json / gguf architecture
        raise ExportError(f"could not read the config of {source!r}: {str(e).splitlines()[0]}") from None
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    arch = arch_for(text_config.model_type)
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32, **kwargs)
    except (OSError, ValueError, ImportError) as e:
        raise ExportError(f"could not load {source!r}: {str(e).splitlines()[0]}") from None
    model.eval()
    del transformers
    return LoadedModel(source, revision, model, tokenizer, decoder_config(model, arch, capacity))


def decoder_config(model, arch, capacity: int) -> DecoderConfig:
    """Read sizes, rotary tables and weights off a transformers model."""
    import torch

    c = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    layer_types = list(getattr(c, "layer_types", None) or ["full_attention"] * c.num_hidden_layers)
    layer_types = ["sliding_attention" if t == "sliding_attention" else "full_attention" for t in layer_types]
    if not arch.sliding_window and getattr(c, "sliding_window", None) and getattr(c, "use_sliding_window", False):
        raise ExportError("sliding-window attention is not supported for this architecture; disable it in the config.")
    scale = getattr(c, "query_pre_attn_scalar", None)
    attn_scale = float(scale) ** -0.5 if arch.name == "gemma3" and scale else head_dim**-0.5
    rope = {}
    positions = torch.arange(capacity)[None]
    dummy = torch.zeros(1, dtype=torch.float32)
    rotary = model.model.rotary_emb
    with torch.no_grad():
        for t in sorted(set(layer_types)):
            cos, sin = rotary(dummy, positions, t) if arch.sliding_window else rotary(dummy, positions)
            rope[t] = (
                cos[0, :, : head_dim // 2].numpy().astype(np.float32),
                sin[0, :, : head_dim // 2].numpy().astype(np.float32),
            )
    weights = {k: v.detach().to(torch.float32).numpy() for k, v in model.state_dict().items()}
    return DecoderConfig(
        arch=arch,
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        num_layers=c.num_hidden_layers,
        num_heads=c.num_attention_heads,
        num_kv_heads=c.num_key_value_heads,
        head_dim=head_dim,
        rms_eps=c.rms_norm_eps,
        attn_scale=attn_scale,
        layer_types=layer_types,
        sliding_window=getattr(c, "sliding_window", None) if arch.sliding_window else None,
        rope=rope,
        final_logit_softcap=getattr(c, "final_logit_softcapping", None),
        weights=weights,
    )
