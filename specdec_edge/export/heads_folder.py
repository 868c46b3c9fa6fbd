"""The heads folder that ``train-draft`` writes and ``export --heads`` reads: ``config.json`` + ``weights.safetensors``.

``config.json`` is the ``HeadConfig`` (sizes and training summary); ``weights.safetensors``
holds the head's own weights in fp16 and its draft vocabulary (``vocab_ids``), not the
target's embedding or LM head, which come from the target when the folder is loaded.
An EAGLE-3 serving checkpoint folder (``eagle3_checkpoint.py``) is read as such a folder too.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from torch import nn

from specdec_edge.errors import ExportError
from specdec_edge.export.head_modules import FrozenTarget, HeadConfig
from specdec_edge.export.head_recipes import RECIPES, build_head
from specdec_edge.values import is_int

# The most each size of a head's config.json may hold; within it, the weights file decides (its shapes must be the
# ones the config makes).
SIZE_LIMITS = {"hidden_size": 1 << 16, "vocab_size": 1 << 22, "draft_vocab": 1 << 22, "num_heads": 1024,
               "num_kv_heads": 1024, "head_dim": 1024, "intermediate_size": 1 << 20, "medusa_heads": 64,
               "ttt_steps": 64}  # fmt: skip
RETRAIN = "train the heads again (`specdec-edge train-draft`) or pass the folder it wrote"


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
        try:
            cfg = read_checkpoint(folder)[0]
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ExportError(f"the EAGLE-3 checkpoint {folder} has a damaged config.json ({e!r}).") from None
    else:
        cfg = _read_folder_config(folder)
    if problem := config_problem(cfg):
        raise ExportError(f"the heads folder {folder} has a damaged config.json: {problem}; {RETRAIN}.")
    return cfg


def _read_folder_config(folder: Path) -> HeadConfig:
    what = f"{folder} is not a heads folder (config.json + weights.safetensors from `specdec-edge train-draft`)"
    if not (folder / "config.json").is_file() or not (folder / "weights.safetensors").is_file():
        raise ExportError(f"{what}; train one with `specdec-edge train-draft --method eagle|eagle3|medusa --out DIR`.")
    try:
        cfg = HeadConfig(**json.loads((folder / "config.json").read_text()))
    except (ValueError, TypeError, RecursionError) as e:
        raise ExportError(f"{what}: its config.json is unreadable ({e}); train the heads again.") from None
    if not isinstance(cfg.method, str) or cfg.method not in RECIPES:
        raise ExportError(f"{what}: its method {cfg.method!r} is not one of {', '.join(RECIPES)}.")
    return cfg


def config_problem(cfg: HeadConfig) -> str | None:
    """What is wrong with a head config's fields (types, bounds, the sizes its method needs), or None."""
    for name, most in SIZE_LIMITS.items():
        value = getattr(cfg, name)
        if not is_int(value) or not 0 <= value <= most:
            return f"{name}={value!r} is not an integer from 0 to {most}"
    for name in ("hidden_size", "vocab_size", "draft_vocab", *RECIPES[cfg.method].sizes):
        if getattr(cfg, name) < 1:
            return f"{name}={getattr(cfg, name)}, but the method {cfg.method} needs at least 1"
    if cfg.draft_vocab > cfg.vocab_size:
        return f"draft_vocab={cfg.draft_vocab} is more than vocab_size={cfg.vocab_size}"
    if "num_kv_heads" in RECIPES[cfg.method].sizes and cfg.num_heads % cfg.num_kv_heads:
        return f"num_heads={cfg.num_heads} is not a multiple of num_kv_heads={cfg.num_kv_heads}"
    for name in ("rope_theta", "rms_eps"):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
            return f"{name}={value!r} is not a positive number"
    layers = cfg.feature_layers
    if not isinstance(layers, list) or len(layers) > 16 or not all(is_int(k) and 0 <= k < 4096 for k in layers):
        return f"feature_layers={layers!r} is not a list of up to 16 layer numbers"
    if RECIPES[cfg.method].reads_layers != bool(layers):
        return f"feature_layers={layers!r} does not fit a {cfg.method} head"
    if not isinstance(cfg.training, dict):
        return "training is not an object"
    return None


def expected_shapes(cfg: HeadConfig) -> dict[str, tuple]:
    """The shape of every weight of the module ``cfg`` makes, built on the meta device (nothing allocated)."""
    stand_in = SimpleNamespace(
        final_norm=None, feature_scale=None, lm_head_t=torch.empty(cfg.hidden_size, cfg.draft_vocab, device="meta")
    )
    with torch.device("meta"):
        head = build_head(cfg, stand_in)
    return {k: tuple(v.shape) for k, v in head.state_dict().items()}


def checked_weights(folder: Path, cfg: HeadConfig) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """(weights, vocab_ids) of a heads folder, each checked against ``cfg``: exactly the module's tensors, at its
    shapes, finite; a draft vocabulary of ``draft_vocab`` distinct ids of the target's vocabulary. One ExportError
    naming the folder otherwise."""
    try:
        tensors = dict(read_weights(folder))
    except Exception as e:  # safetensors' own error types: a truncated or foreign file
        raise ExportError(f"the heads folder {folder} has an unreadable weights file ({e}); {RETRAIN}.") from None
    vocab_ids = tensors.pop("vocab_ids", None)
    want = expected_shapes(cfg)
    got = {k: tuple(v.shape) for k, v in tensors.items()}
    problems = [f"missing {', '.join(sorted(set(want) - set(got)))}"] if set(want) - set(got) else []
    problems += [f"unexpected {', '.join(sorted(set(got) - set(want)))}"] if set(got) - set(want) else []
    problems += [f"{k} is {list(got[k])}, its config makes {list(want[k])}" for k in sorted(want) if k in got
                 and got[k] != want[k]]  # fmt: skip
    problems += [f"{k} is not finite floats" for k, v in sorted(tensors.items()) if k in want and got[k] == want[k]
                 and (v.dtype.kind != "f" or not np.isfinite(v).all())]  # fmt: skip
    if vocab_ids is None or vocab_ids.dtype.kind not in "iu" or vocab_ids.shape != (cfg.draft_vocab,):
        problems.append(f"vocab_ids is not {cfg.draft_vocab} integers (draft_vocab)")
    elif vocab_ids.min() < 0 or vocab_ids.max() >= cfg.vocab_size or len(np.unique(vocab_ids)) != len(vocab_ids):
        problems.append(f"vocab_ids are not distinct token ids below vocab_size={cfg.vocab_size}")
    if problems:
        raise ExportError(
            f"the heads folder {folder} does not hold the {cfg.method} head its config.json describes ("
            + "; ".join(problems[:4])
            + (f"; and {len(problems) - 4} more" if len(problems) > 4 else "")
            + f"); {RETRAIN}."
        )
    return tensors, vocab_ids.astype(np.int64)


def check_heads_folder(folder: Path) -> HeadConfig:
    """Read and check a heads folder whole (config, weights, draft vocabulary) before anything slow runs."""
    cfg = read_head_config(folder)
    checked_weights(Path(folder), cfg)
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
    tensors, vocab_ids = checked_weights(folder, cfg)
    head = build_head(cfg, FrozenTarget(embed, lm_head, vocab_ids, embed_dtype))
    head.load_state_dict({k: torch.as_tensor(v).float() for k, v in tensors.items()}, strict=True)
    return head.eval()
