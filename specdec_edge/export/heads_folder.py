"""The heads folder that ``train-draft`` writes and ``export --heads`` reads: ``config.json`` + ``weights.safetensors``.

``config.json`` is the ``HeadConfig`` (sizes and training summary); ``weights.safetensors``
holds the head's own weights in fp16 and its draft vocabulary (``vocab_ids``), not the
target's embedding or LM head, which come from the target when the folder is loaded.
An EAGLE-3 serving checkpoint folder (``eagle3_checkpoint.py``) is read as such a folder too.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from torch import nn

from specdec_edge.errors import ExportError
from specdec_edge.export.head_modules import FrozenTarget, HeadConfig
from specdec_edge.export.head_recipes import RECIPES, build_head


def trainable_state(head: nn.Module) -> dict:
    """The head's own weights: its state dict without the frozen target's."""
    return {k: v for k, v in head.state_dict().items() if not k.startswith("target.")}


def save_heads(folder: Path, head: nn.Module, vocab_ids: np.ndarray) -> Path:
    """Write ``head`` (its ``cfg`` included) and its draft vocabulary [V'] into ``folder``; returns it."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(torch.float16).contiguous() for k, v in trainable_state(head).items()}
    tensors["vocab_ids"] = torch.as_tensor(np.asarray(vocab_ids, np.int32))
    save_file(tensors, str(folder / "weights.safetensors"))
    (folder / "config.json").write_text(json.dumps(asdict(head.cfg), indent=2) + "\n")
    return folder


def read_head_config(folder: Path) -> HeadConfig:
    """The ``HeadConfig`` of a heads folder (or of an EAGLE-3 serving checkpoint, ``eagle3_checkpoint.py``), or an
    ExportError saying it is neither (cheap: no weights read)."""
    from specdec_edge.export.eagle3_checkpoint import is_checkpoint, read_checkpoint

    folder = Path(folder)
    if is_checkpoint(folder):
        return read_checkpoint(folder)[0]
    what = f"{folder} is not a heads folder (config.json + weights.safetensors from `specdec-edge train-draft`)"
    if not (folder / "config.json").is_file() or not (folder / "weights.safetensors").is_file():
        raise ExportError(f"{what}; train one with `specdec-edge train-draft --method eagle|eagle3|medusa --out DIR`.")
    try:
        cfg = HeadConfig(**json.loads((folder / "config.json").read_text()))
    except (ValueError, TypeError) as e:
        raise ExportError(f"{what}: its config.json is unreadable ({e}); train the heads again.") from None
    if cfg.method not in RECIPES:
        raise ExportError(f"{what}: its method {cfg.method!r} is not one of {', '.join(RECIPES)}.")
    return cfg


def heads_feature_layers(heads_dirs, feature_layers=()) -> tuple:
    """The target feature layers that the heads in ``heads_dirs`` read (EAGLE-3), else ``feature_layers``."""
    wanted = {tuple(read_head_config(folder).feature_layers) for folder in heads_dirs} - {()}
    if len(wanted) > 1:
        raise ExportError(f"the heads read different target layers {sorted(wanted)}; pass heads trained alike.")
    if wanted and feature_layers and feature_layers != "default" and tuple(feature_layers) not in wanted:
        raise ExportError(f"the heads read target layers {list(wanted.pop())}, not {list(feature_layers)}.")
    return wanted.pop() if wanted else feature_layers


def read_weights(folder: Path) -> dict[str, np.ndarray]:
    """The tensors of a heads folder (or EAGLE-3 checkpoint, renamed): the head's own weights and ``vocab_ids``."""
    from safetensors.numpy import load_file

    from specdec_edge.export.eagle3_checkpoint import is_checkpoint, read_checkpoint

    folder = Path(folder)
    if is_checkpoint(folder):
        return read_checkpoint(folder)[1]
    return load_file(str(folder / "weights.safetensors"))


def load_heads(folder: Path, embed: np.ndarray, lm_head: np.ndarray, embed_dtype=np.float16) -> nn.Module:
    """The head saved in ``folder`` over the target's embedding [V, H] (held as ``embed_dtype``) and LM head
    [V, H], in eval mode."""
    folder = Path(folder)
    cfg = read_head_config(folder)
    if embed.shape != (cfg.vocab_size, cfg.hidden_size):
        raise ExportError(
            f"heads in {folder} were trained for vocab {cfg.vocab_size} x hidden {cfg.hidden_size}, "
            f"the target has {embed.shape[0]} x {embed.shape[1]}; train heads for this target."
        )
    tensors = read_weights(folder)
    vocab_ids = tensors.pop("vocab_ids").astype(np.int64)
    head = build_head(cfg, FrozenTarget(embed, lm_head, vocab_ids, embed_dtype))
    head.load_state_dict({k: torch.as_tensor(v).float() for k, v in tensors.items()}, strict=False)
    return head.eval()
