"""Load a causal LM from a Hugging Face id, a local folder or a .gguf file.

Returns the PyTorch model (for weights and validation), its tokenizer and a
``DecoderConfig`` for the graph builder. transformers is imported here only.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from specdec_edge.errors import ExportError
from specdec_edge.export.arch import arch_for, attention_windows
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


def read_config(source: str, revision: str | None = None):
    """The model's (text) config, read without its weights (a GGUF's metadata only)."""
    import transformers
    from transformers import AutoConfig

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
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def cache_limits(source: str, revision: str | None = None) -> tuple[int | None, int]:
    """``(positions the model was trained for, fp32 KV cache bytes per token)`` from its config; a GGUF's
    header is read directly (transformers' GGUF config reader parses the whole vocabulary: ~25 s here)."""
    name, kwargs = resolve_source(source)
    if "gguf_file" in kwargs:
        meta = gguf_scalars(Path(name) / kwargs["gguf_file"])
        arch = meta.get("general.architecture")
        get = lambda key: meta.get(f"{arch}.{key}")  # noqa: E731
        layers, heads, hidden = get("block_count"), get("attention.head_count"), get("embedding_length")
        if not all(isinstance(x, int) and x > 0 for x in (layers, heads, hidden)):
            raise ExportError(
                f"{source} lacks the GGUF metadata of a decoder ({arch}.block_count, ...); is it a model?"
            )
        kv_heads, head_dim = get("attention.head_count_kv") or heads, get("attention.key_length") or hidden // heads
        return get("context_length"), layers * 2 * kv_heads * head_dim * 4
    if (Path(name) / "config.json").is_file():  # a local folder: its JSON (importing transformers takes ~10 s)
        data = json.loads((Path(name) / "config.json").read_text())
        c = SimpleNamespace(**data.get("text_config", data))
    else:
        c = read_config(source, revision)
    positions = getattr(c, "max_position_embeddings", None)
    try:
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        return positions, c.num_hidden_layers * 2 * kv_heads * head_dim * 4
    except (AttributeError, TypeError, ZeroDivisionError):  # an unusual config: the load reports it
        return positions, 0


# GGUF metadata value types: struct format of the fixed-size ones; 8 = string, 9 = array.
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def gguf_scalars(path: Path) -> dict:
    """The scalar and string metadata of a GGUF file (arrays skipped), read from its header only."""
    import struct

    def read(fmt):
        data = f.read(struct.calcsize("<" + fmt))
        if len(data) < struct.calcsize("<" + fmt):
            raise ExportError(f"{path} ends inside its GGUF header; the file is truncated or not a GGUF.")
        return struct.unpack("<" + fmt, data)[0]

    def string():
        return f.read(read("Q")).decode("utf-8", "replace")

    def skip(kind):
        if kind == 8:
            f.seek(read("Q"), 1)
        elif kind == 9:
            item, count = read("I"), read("Q")
            if item in _GGUF_SCALARS:
                f.seek(count * struct.calcsize(_GGUF_SCALARS[item]), 1)
            else:
                for _ in range(count):
                    skip(item)
        elif kind in _GGUF_SCALARS:
            f.seek(struct.calcsize(_GGUF_SCALARS[kind]), 1)
        else:
            raise ExportError(f"{path} has an unknown GGUF metadata type {kind}; is it a GGUF file?")

    out = {}
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ExportError(f"{path} is not a GGUF file (no GGUF magic number).")
        read("I")  # version
        read("Q")  # tensor count
        for _ in range(read("Q")):
            key, kind = string(), read("I")
            if kind in _GGUF_SCALARS:
                out[key] = read(_GGUF_SCALARS[kind])
            elif kind == 8:
                out[key] = string()
            else:
                skip(kind)
    return out


def load_model(source: str, revision: str | None = None, capacity: int = 2048) -> LoadedModel:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.logging.disable_progress_bar()  # the exporter reports its own stages
    transformers.logging.set_verbosity_error()
    name, kwargs = resolve_source(source)
    if revision:
        kwargs["revision"] = revision
    text_config = read_config(source, revision)
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
    # every model type's window, as its transformers attention applies it; the graph masks the same keys
    layer_types, window = attention_windows(c, c.model_type, capacity)
    scale = getattr(c, "query_pre_attn_scalar", None)
    attn_scale = float(scale) ** -0.5 if arch.name == "gemma3" and scale else head_dim**-0.5
    rope = {}
    positions = torch.arange(capacity)[None]
    dummy = torch.zeros(1, dtype=torch.float32)
    rotary = model.model.rotary_emb
    with torch.no_grad():
        for t in sorted(set(layer_types)):
            cos, sin = rotary(dummy, positions, t) if arch.rope_by_layer_type else rotary(dummy, positions)
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
        sliding_window=window,
        rope=rope,
        final_logit_softcap=getattr(c, "final_logit_softcapping", None),
        weights=weights,
    )
