"""Draft heads that read the target's own hidden states: an EAGLE head and Medusa heads.

Both reuse the target's embedding and LM head (frozen, optionally cut to a reduced draft
vocabulary) and train only their own small weights (``train_draft.py``).

* ``EagleHead``: one Llama-style decoder layer over ``fc(concat(embed(x[i+1]), f[i]))``; it
  predicts the target's next feature ``f[i+1]``, whose LM-head logits give the token after
  ``x[i+1]``. Features are the target graph's ``hidden_states`` (after the final norm), so
  the LM head applies to them directly. It keeps its own small KV cache at run time.
* ``MedusaHeads``: K residual blocks ``h + SiLU(W_i h + b_i)``; head i on ``f[t]`` predicts
  the token ``x[t+1+i]``.

A trained heads folder holds ``config.json`` and ``weights.safetensors`` (the head's own
weights in fp16 and the draft vocabulary, no embedding or LM head). ``export_heads`` turns
it into ONNX graphs inside a bundle (``heads/<method>.onnx``), validated against the torch
module; ``add_heads`` writes a copy of an existing bundle with heads, atomically.
"""

from __future__ import annotations

import json
import shutil
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from specdec_edge.bundle import StagingDir, read_manifest
from specdec_edge.errors import ExportError

METHODS = ("eagle", "medusa")
TOP_K = 10  # candidates per row that a head graph returns
# Tree settings a bundle records for each head method (manifest ``heads.<method>.tree``) and a
# pipeline uses unless told otherwise: the fastest measured for SmolLM2-135M on 2 CPU cores
# (docs/PERFORMANCE.md, "Trained heads"). On a CPU a verify pass costs more the wider it is, so
# small trees win; a GPU, where width is nearly free, wants larger ones (-o nodes=..., -o tree=...).
TREE_SETTINGS = {
    "eagle": {"topk": 3, "nodes": 5, "depth": 3},
    "medusa": {"tree": [[0], [1], [0, 0], [0, 0, 0]]},
}
TOLERANCE = 1e-3  # max |onnx - torch| of predicted features / log-probs, relative to their scale


@dataclass
class HeadConfig:
    method: str  # "eagle" | "medusa"
    hidden_size: int
    vocab_size: int  # the target's
    draft_vocab: int  # rows of the (reduced) LM head
    num_heads: int = 0  # eagle attention heads
    num_kv_heads: int = 0
    head_dim: int = 0
    intermediate_size: int = 0
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    medusa_heads: int = 0
    training: dict = field(default_factory=dict)

    @classmethod
    def for_target(cls, method: str, hidden_size: int, vocab_size: int, draft_vocab: int, kv_heads: int,
                   head_dim: int, medusa_heads: int = 4) -> "HeadConfig":
        if method not in METHODS:
            raise ExportError(f"unknown head method {method!r}; choose one of {', '.join(METHODS)}.")
        if method == "medusa":
            return cls(method, hidden_size, vocab_size, draft_vocab, medusa_heads=medusa_heads)
        heads = max(hidden_size // head_dim, kv_heads)
        heads -= heads % kv_heads
        inter = int(round(8 * hidden_size / 3 / 64)) * 64
        return cls(method, hidden_size, vocab_size, draft_vocab, heads, kv_heads, head_dim, inter)


def rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotate(x, positions, theta):  # x [B, n, S, hd], positions [B, S]
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    freqs = positions[:, None, :, None].float() * inv  # [B, 1, S, hd/2]
    cos, sin = torch.cat([freqs.cos()] * 2, -1), torch.cat([freqs.sin()] * 2, -1)
    rot = torch.cat([-x[..., hd // 2:], x[..., : hd // 2]], -1)
    return x * cos + rot * sin


class FrozenTarget(nn.Module):
    """The target's embedding and (draft-vocabulary) LM head, as buffers that are never trained."""

    def __init__(self, embed: np.ndarray, lm_head: np.ndarray, vocab_ids: np.ndarray):
        super().__init__()
        # The full-vocabulary embedding is the biggest tensor of a head graph: kept in fp16.
        self.register_buffer("embed", torch.as_tensor(np.asarray(embed, np.float16)), persistent=False)
        head = np.asarray(lm_head, np.float32)[np.asarray(vocab_ids)]
        self.register_buffer("lm_head_t", torch.as_tensor(np.ascontiguousarray(head.T)), persistent=False)  # [H, V']
        self.register_buffer("vocab_ids", torch.as_tensor(np.asarray(vocab_ids, np.int64)), persistent=False)

    def embed_tokens(self, ids):
        return self.embed[ids].float()

    def logits(self, x):  # [..., H] -> [..., V']
        return x @ self.lm_head_t


class EagleHead(nn.Module):
    def __init__(self, cfg: HeadConfig, target: FrozenTarget):
        super().__init__()
        self.cfg, self.target = cfg, target
        H, nh, kvh, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.q_proj, self.k_proj = nn.Linear(H, nh * hd, bias=False), nn.Linear(H, kvh * hd, bias=False)
        self.v_proj, self.o_proj = nn.Linear(H, kvh * hd, bias=False), nn.Linear(nh * hd, H, bias=False)
        self.gate_proj = nn.Linear(H, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(H, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, H, bias=False)
        self.input_norm, self.post_norm = nn.Parameter(torch.ones(H)), nn.Parameter(torch.ones(H))
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, 0.0, 0.02)

    def forward(self, features, input_ids, positions, past_key, past_value, bias):
        """features [B, S, H] (f[i]), input_ids [B, S] (x[i+1]), positions [B, S], past K/V
        [B, P, kvh, hd], bias [B, 1, S, P+S] -> predicted f[i+1] [B, S, H], new key and value [B, S, kvh, hd].

        The cache is BSNH so that the host's committed prefix is a contiguous slice (no copy)."""
        cfg = self.cfg
        B, S, _ = features.shape
        x = self.fc(torch.cat([self.target.embed_tokens(input_ids), features], -1))
        h = rms_norm(x, self.input_norm, cfg.rms_eps)
        q = self.q_proj(h).view(B, S, cfg.num_heads, cfg.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(B, S, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(B, S, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        q, k = rotate(q, positions, cfg.rope_theta), rotate(k, positions, cfg.rope_theta)
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, S, kvh, hd]
        keys, values = torch.cat([past_key, k], 1).transpose(1, 2), torch.cat([past_value, v], 1).transpose(1, 2)
        g = cfg.num_heads // cfg.num_kv_heads
        keys, values = keys.repeat_interleave(g, 1), values.repeat_interleave(g, 1)
        scores = q @ keys.transpose(-1, -2) * cfg.head_dim ** -0.5 + bias
        attn = (scores.softmax(-1) @ values).transpose(1, 2).reshape(B, S, -1)
        x = x + self.o_proj(attn)
        h = rms_norm(x, self.post_norm, cfg.rms_eps)
        x = x + self.down_proj(nn.functional.silu(self.gate_proj(h)) * self.up_proj(h))
        return x, k, v


class MedusaHeads(nn.Module):
    def __init__(self, cfg: HeadConfig, target: FrozenTarget):
        super().__init__()
        self.cfg, self.target = cfg, target
        H, K = cfg.hidden_size, cfg.medusa_heads
        self.weight = nn.Parameter(torch.zeros(K, H, H))  # zero init: every head starts as the target's LM head
        self.bias = nn.Parameter(torch.zeros(K, 1, H))

    def forward(self, hidden):  # [R, H] -> per-head features [K, R, H]
        return hidden + nn.functional.silu(hidden @ self.weight + self.bias)


def make_head(cfg: HeadConfig, target: FrozenTarget) -> nn.Module:
    return EagleHead(cfg, target) if cfg.method == "eagle" else MedusaHeads(cfg, target)


def trainable_state(head: nn.Module) -> dict:
    return {k: v for k, v in head.state_dict().items() if not k.startswith("target.")}


# ---- heads folder: config.json + weights.safetensors


def save_heads(folder: Path, head: nn.Module, vocab_ids: np.ndarray) -> Path:
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(torch.float16).contiguous() for k, v in trainable_state(head).items()}
    tensors["vocab_ids"] = torch.as_tensor(np.asarray(vocab_ids, np.int32))
    save_file(tensors, str(folder / "weights.safetensors"))
    (folder / "config.json").write_text(json.dumps(asdict(head.cfg), indent=2) + "\n")
    return folder


def load_heads(folder: Path, embed: np.ndarray, lm_head: np.ndarray) -> nn.Module:
    from safetensors.torch import load_file

    folder = Path(folder)
    if not (folder / "config.json").is_file() or not (folder / "weights.safetensors").is_file():
        raise ExportError(f"{folder} is not a heads folder (config.json + weights.safetensors); "
                          "train one with `specdec-edge train-draft`.")
    cfg = HeadConfig(**json.loads((folder / "config.json").read_text()))
    if embed.shape != (cfg.vocab_size, cfg.hidden_size):
        raise ExportError(f"heads in {folder} were trained for vocab {cfg.vocab_size} x hidden {cfg.hidden_size}, "
                          f"the target has {embed.shape[0]} x {embed.shape[1]}; train heads for this target.")
    tensors = load_file(str(folder / "weights.safetensors"))
    vocab_ids = tensors.pop("vocab_ids").numpy().astype(np.int64)
    head = make_head(cfg, FrozenTarget(embed, lm_head, vocab_ids))
    head.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False)
    return head.eval()


# ---- ONNX


class _EagleGraph(nn.Module):
    def __init__(self, head: EagleHead):
        super().__init__()
        self.head = head

    def forward(self, features, input_ids, position_ids, past_key, past_value, attention_bias, logit_rows):
        head = self.head
        out, key, value = head(features, input_ids, position_ids, past_key, past_value, attention_bias)
        logp = head.target.logits(out[0].index_select(0, logit_rows)).log_softmax(-1)  # [R, V']
        values, idx = logp.topk(TOP_K, -1)
        return out, values, head.target.vocab_ids[idx], key, value


class _MedusaGraph(nn.Module):
    def __init__(self, head: MedusaHeads):
        super().__init__()
        self.head = head

    def forward(self, hidden_states):  # [R, H]
        logp = self.head.target.logits(self.head(hidden_states)).log_softmax(-1)  # [K, R, V']
        values, idx = logp.topk(TOP_K, -1)
        return values, self.head.target.vocab_ids[idx]


def _eagle_example(cfg: HeadConfig, past: int = 5, seq: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    bias = torch.zeros(1, 1, seq, past + seq)
    bias[0, 0, :, past:] = torch.triu(torch.full((seq, seq), float("-inf")), 1)
    return (torch.randn(1, seq, cfg.hidden_size, generator=g), torch.randint(0, cfg.vocab_size, (1, seq), generator=g),
            torch.arange(past, past + seq)[None], torch.randn(1, past, cfg.num_kv_heads, cfg.head_dim, generator=g),
            torch.randn(1, past, cfg.num_kv_heads, cfg.head_dim, generator=g), bias, torch.tensor([seq - 1, 0]))


EAGLE_IO = (["features", "input_ids", "position_ids", "past_key", "past_value", "attention_bias", "logit_rows"],
            ["hidden_states", "topk_logprobs", "topk_ids", "key", "value"],
            {"features": {1: "seq"}, "input_ids": {1: "seq"}, "position_ids": {1: "seq"}, "past_key": {1: "past"},
             "past_value": {1: "past"}, "attention_bias": {2: "seq", 3: "total"}, "logit_rows": {0: "rows"},
             "hidden_states": {1: "seq"}, "topk_logprobs": {0: "rows"}, "topk_ids": {0: "rows"}, "key": {1: "seq"},
             "value": {1: "seq"}})
MEDUSA_IO = (["hidden_states"], ["topk_logprobs", "topk_ids"],
             {"hidden_states": {0: "rows"}, "topk_logprobs": {1: "rows"}, "topk_ids": {1: "rows"}})


def export_head_graph(head: nn.Module, path: Path) -> dict:
    """Write ``head`` as an ONNX graph at ``path``; validate it in ONNX Runtime; return the report."""
    import onnxruntime as ort

    from specdec_edge.export.graph import IR_VERSION
    from specdec_edge.export.quantize import save

    cfg = head.cfg
    if cfg.method == "eagle":
        wrapper, (names_in, names_out, axes) = _EagleGraph(head), EAGLE_IO
        examples = [_eagle_example(cfg), _eagle_example(cfg, past=9, seq=6, seed=1)]
    else:
        wrapper, (names_in, names_out, axes) = _MedusaGraph(head), MEDUSA_IO
        examples = [(torch.randn(n, cfg.hidden_size, generator=torch.Generator().manual_seed(n)),) for n in (3, 5)]
    tmp = path.with_suffix(".tmp.onnx")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notices
        torch.onnx.export(wrapper, examples[0], str(tmp), input_names=names_in, output_names=names_out,
                          dynamic_axes=axes, opset_version=17, dynamo=False)
    import onnx

    model = onnx.load(str(tmp))
    tmp.unlink()
    model.ir_version = min(model.ir_version, IR_VERSION)
    save(model, path)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    report: dict = {}
    for example in examples:  # the traced shapes and other ones (dynamic axes)
        with torch.no_grad():
            want = [t.numpy() for t in wrapper(*example)]
        got = sess.run(None, {n: t.numpy() for n, t in zip(names_in, example)})
        for name, g, w in zip(names_out, got, want):
            if name == "topk_ids":
                agree = float(np.mean(g[..., 0] == w[..., 0]))
                report["topk_ids_agreement"] = min(report.get("topk_ids_agreement", 1.0), agree)
                continue
            err = float(np.abs(g - w).max() / max(np.abs(w).max(), 1e-6))
            report[f"{name}_max_rel_err"] = max(report.get(f"{name}_max_rel_err", 0.0), err)
    worst = max(v for k, v in report.items() if k.endswith("err"))
    report["max_rel_err"], report["tolerance"] = worst, TOLERANCE
    if not np.isfinite(worst) or worst > TOLERANCE:
        raise ExportError(f"the {cfg.method} head graph differs from PyTorch by {worst:.3g} > {TOLERANCE}; "
                          "no bundle was written.")
    return report


def export_heads(heads_dirs, embed: np.ndarray, lm_head: np.ndarray, root: Path, default: str | None = None) -> dict:
    """Build and validate a graph per heads folder under ``root/heads``; the manifest's ``heads`` section.

    ``default``: the method a pipeline uses when none is asked for (default: pld-eagle when EAGLE
    heads are given, the fastest measured on a CPU; docs/PERFORMANCE.md).
    """
    section = {}
    (root / "heads").mkdir(exist_ok=True)
    for folder in heads_dirs:
        head = load_heads(Path(folder), embed, lm_head)
        cfg = head.cfg
        if cfg.method in section:
            raise ExportError(f"two {cfg.method} heads folders were given; pass one per method.")
        report = export_head_graph(head, root / "heads" / f"{cfg.method}.onnx")
        config = {k: v for k, v in asdict(cfg).items() if k not in ("method", "training")}
        section[cfg.method] = {"graph": f"heads/{cfg.method}.onnx", "top_k": TOP_K, "config": config,
                               "tree": TREE_SETTINGS[cfg.method],
                               "training": cfg.training, "validation": report}
    # Exact methods a bundle can default to: its heads, and prompt lookup backed by EAGLE.
    choices = [*section, *(["pld-eagle"] if "eagle" in section else [])]
    default = default or ("pld-eagle" if "eagle" in section else "medusa")
    if default not in choices:
        raise ExportError(f"default head method {default!r} needs heads that were not given; choose one of "
                          f"{', '.join(choices)}.")
    section["default"] = default
    return section


def target_weights(bundle: Path) -> tuple[np.ndarray, np.ndarray]:
    """The target's embedding [V, H] and LM head [V, H] read from a bundle's fp32/fp16 graph."""
    import onnx
    from onnx import numpy_helper
    from onnx.external_data_helper import load_external_data_for_tensor, uses_external_data

    manifest = read_manifest(bundle)
    graph = manifest.target.graph
    if graph.dtype not in ("fp32", "fp16"):
        raise ExportError(f"bundle {bundle} has {graph.dtype} weights; heads need an fp32 or fp16 target bundle "
                          "(export one with --dtype fp32 --hidden-states).")
    path = Path(bundle) / graph.path
    model = onnx.load(str(path), load_external_data=False)  # read only the two tensors needed
    found = {i.name: i for i in model.graph.initializer if i.name in ("model.embed_tokens.weight", "lm_head.weight.T")}
    for tensor in found.values():
        if uses_external_data(tensor):
            load_external_data_for_tensor(tensor, str(path.parent))
    embed = numpy_helper.to_array(found["model.embed_tokens.weight"]).astype(np.float32)
    head = numpy_helper.to_array(found["lm_head.weight.T"]).astype(np.float32).T
    return embed, np.ascontiguousarray(head)


def add_heads(bundle: str | Path, heads_dirs, out: str | Path, force: bool = False, default: str | None = None) -> Path:
    """Write a copy of ``bundle`` with head graphs at ``out`` (staged, then renamed into place)."""
    bundle, out = Path(bundle), Path(out)
    manifest = read_manifest(bundle)
    if not manifest.target.graph.has_hidden_states:
        raise ExportError(f"bundle {bundle} has no hidden_states output; heads read it. Re-export with --hidden-states.")
    if out.resolve() == bundle.resolve():
        raise ExportError("--out must differ from the source bundle; the new bundle is written beside it.")
    embed, lm_head = target_weights(bundle)
    with StagingDir(out, force) as staging:
        for rel in manifest.files:
            if rel.startswith("heads/"):
                continue
            dest = staging.path / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(bundle / rel, dest)
        data = manifest.to_json()
        data.pop("files")
        data["heads"] = export_heads(heads_dirs, embed, lm_head, staging.path, default)
        return staging.commit(data)
