"""`train-draft`: train EAGLE, EAGLE-3 or Medusa heads by self-distillation on the target's own answers.

Stages, each resumable inside ``--out``:

1. ``prepare``: the target bundle with hidden states, the target's answers and their features,
   the draft vocabulary (``draft_data.py``; cached in ``target-bundle/`` and ``data/``).
2. ``build_head``: the untrained head, sized for the target by the method's recipe.
3. ``run_training``: the loop, with the recipe's loss; ``<method>/checkpoint.pt`` every
   ``save_every`` steps (head, optimizer, schedule, step) so that a rerun continues.
4. ``training_summary`` into the config, then ``<method>/config.json`` + ``weights.safetensors``
   (fp16): the folder ``export --heads`` takes.

The losses and default epochs of each method are in its recipe (``head_recipes.py``).
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from specdec_edge.atomic import write_atomic
from specdec_edge.bundle import Manifest, read_manifest
from specdec_edge.bundle_write import disk_errors, prepare_out_dir
from specdec_edge.errors import ExportError
from specdec_edge.export.draft_data import batches, draft_vocabulary, generate_data, load_prompt_texts, prepare_bundle
from specdec_edge.export.head_export import target_final_norm, target_weights
from specdec_edge.export.head_modules import Eagle3Head, FrozenTarget
from specdec_edge.export.head_recipes import HEAD_METHODS, RECIPES, HeadRecipe
from specdec_edge.export.heads_folder import save_heads, trainable_state


@dataclass
class Prepared:
    """What training reads: the target bundle's manifest and weights, the prompts, sequences and draft vocabulary."""

    manifest: Manifest
    embed: np.ndarray  # [V, H]
    lm_head: np.ndarray  # [V, H]
    texts: list[str]
    data: list[dict]  # draft_data sequences
    vocab_ids: np.ndarray  # [V'] target token ids of the draft vocabulary, sorted
    final_norm: np.ndarray | None = None  # [H] the target's final norm weight, if the graph names it


def prepare(
    target: str,
    out: Path,
    *,
    prompts,
    max_prompts: int,
    holdout: int,
    answer_tokens: int,
    draft_vocab: int,
    capacity: int | None,
    threads: int | None,
    progress: bool,
    layers: bool = False,
    spinning: bool = True,
) -> Prepared:
    """Export (or reuse) the target bundle, generate (or reuse) the answers, pick the draft vocabulary.
    ``layers``: the head reads the target's layer features (EAGLE-3); load them too."""
    bundle = prepare_bundle(target, out, capacity, progress, layers)
    manifest = read_manifest(bundle)
    texts = load_prompt_texts(prompts, max_prompts, holdout)
    data = generate_data(
        bundle,
        texts,
        out / "data",
        answer_tokens=answer_tokens,
        threads=threads,
        progress=progress,
        layers=layers,
        spinning=spinning,
    )
    embed, lm_head = target_weights(bundle)
    vocab_ids = draft_vocabulary(data, manifest.target.graph.vocab_size, draft_vocab, manifest.tokenizer.eos_token_ids)
    return Prepared(manifest, embed, lm_head, texts, data, vocab_ids, target_final_norm(bundle))


def build_head(recipe: HeadRecipe, prep: Prepared, medusa_heads: int, seed: int) -> nn.Module:
    """The recipe's head sized for the target, initialised from ``seed``."""
    graph = prep.manifest.target.graph
    cfg = recipe.config(
        graph.hidden_size,
        graph.vocab_size,
        len(prep.vocab_ids),
        graph.cache.num_kv_heads,
        graph.cache.head_dim,
        medusa_heads,
        graph.feature_layers,
    )
    torch.manual_seed(seed)
    scale = feature_scale(prep.data) if recipe.reads_layers else None
    target = FrozenTarget(prep.embed, prep.lm_head, prep.vocab_ids, final_norm=prep.final_norm, feature_scale=scale)
    return recipe.module(cfg, target)


def feature_scale(data: list[dict], rows: int = 65536) -> np.ndarray:
    """[n*H]: the mean absolute value of each layer-feature dimension over (about ``rows`` of) the data."""
    step = max(1, sum(len(d["layer_features"]) for d in data) // rows)
    sample = np.concatenate([d["layer_features"][::step] for d in data]).astype(np.float32)
    return np.abs(sample).mean(0) + 1e-3


@dataclass
class Training:
    """What the loop advances: the head, its optimizer and schedule, the step plan, the step reached.

    ``losses`` and ``agrees`` (draft top-1 agreement) are those of the steps run in this process.
    """

    head: nn.Module
    optimizer: torch.optim.Optimizer
    schedule: torch.optim.lr_scheduler.LambdaLR
    plan: list[list[int]]  # sequence indices per step
    step: int = 0
    losses: list[float] = field(default_factory=list)
    agrees: list[float] = field(default_factory=list)

    @classmethod
    def start(cls, head: nn.Module, plan: list[list[int]], lr: float) -> Training:
        """AdamW at ``lr``: linear warm-up over the first 5 % of the steps, then cosine decay to 0."""
        optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
        steps, warmup = len(plan), max(1, len(plan) // 20)
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
        )
        return cls(head, optimizer, schedule, plan)

    def advance(self, loss: torch.Tensor, agree: float) -> None:
        """One optimizer step on ``loss`` (gradient norm clipped to 1); records the loss and agreement."""
        self.optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.optimizer.param_groups[0]["params"], 1.0)
        self.optimizer.step()
        self.schedule.step()
        self.step += 1
        self.losses.append(loss.item())
        self.agrees.append(agree)


class Checkpoint:
    """``<method>/checkpoint.pt``: a training state and the settings it was made with, replaced atomically."""

    def __init__(self, path: Path, settings: dict):
        self.path, self.settings = path, settings

    def resume(self, t: Training) -> None:
        """Load the saved state into ``t``, if there is one; an ExportError if it was made with other settings."""
        if not self.path.is_file():
            return
        try:  # weights only: a pickle planted in a shared or downloaded work folder cannot run code
            state = torch.load(self.path, weights_only=True)
        except Exception as e:  # torch raises UnpicklingError, RuntimeError or others for what it refuses
            raise ExportError(
                f"{self.path} is not a training checkpoint that can be loaded safely (weights only: "
                f"{type(e).__name__}); delete it to train from the start, or use a new --out."
            ) from None
        if not isinstance(state, dict) or state.get("settings") != self.settings:
            raise ExportError(f"{self.path} was written with other settings; use a new --out or delete the checkpoint.")
        t.head.load_state_dict(state["head"], strict=False)
        t.optimizer.load_state_dict(state["optimizer"])
        t.schedule.load_state_dict(state["schedule"])
        t.step = state["step"]

    def save(self, t: Training) -> None:
        """Write ``t``'s state (the head's own weights, not the frozen target's)."""
        state = {
            "settings": self.settings,
            "step": t.step,
            "head": trainable_state(t.head),
            "optimizer": t.optimizer.state_dict(),
            "schedule": t.schedule.state_dict(),
        }
        write_atomic(self.path, write=lambda tmp: torch.save(state, tmp))


def run_training(
    recipe: HeadRecipe,
    t: Training,
    data: list[dict],
    checkpoint: Checkpoint,
    *,
    batch_tokens: int,
    save_every: int,
    max_minutes: float,
    progress: bool,
) -> float:
    """Run the planned steps from ``t.step`` until done or ``max_minutes`` have passed; returns its seconds.

    Checkpoints every ``save_every`` steps and at the end, so a rerun continues where this one stopped.
    """
    from tqdm import tqdm

    t.head.train()
    bar = tqdm(
        total=len(t.plan),
        initial=t.step,
        desc=f"train {recipe.name}",
        unit="step",
        file=sys.stderr,
        disable=not progress,
    )
    start = time.perf_counter()
    deadline = start + max_minutes * 60 if max_minutes else math.inf  # the training phase only
    while t.step < len(t.plan) and time.perf_counter() < deadline:
        t.advance(*recipe.loss(t.head, [data[i] for i in t.plan[t.step]], batch_tokens))
        bar.set_postfix(loss=f"{np.mean(t.losses[-10:]):.3f}", top1=f"{np.mean(t.agrees[-10:]):.2f}")
        bar.update()
        if t.step % save_every == 0:
            checkpoint.save(t)
    bar.close()
    checkpoint.save(t)
    return time.perf_counter() - start


def training_summary(
    prep: Prepared,
    t: Training,
    *,
    prompts,
    holdout: int,
    answer_tokens: int,
    epochs: int,
    lr: float,
    train_seconds: float,
    seconds: float,
    cpu_seconds: float | None = None,
) -> dict:
    """The ``training`` section of the heads' config.json (and of a bundle's manifest)."""
    source, losses, agrees = prep.manifest.target.source, t.losses, t.agrees
    return {
        "target": Path(source).name if Path(source).exists() else source,
        "prompts_file": Path(prompts).name if prompts else "packaged Spec-Bench",
        "prompts": len(prep.texts),
        "holdout_per_category": holdout,
        "sequences": len(prep.data),
        "tokens": int(sum(len(d["ids"]) for d in prep.data)),
        "answer_tokens": answer_tokens,
        "draft_vocab": len(prep.vocab_ids),
        "steps": t.step,
        "planned_steps": len(t.plan),
        "epochs": epochs,
        "lr": lr,
        "first_loss": float(np.mean(losses[:10])) if losses else None,
        "final_loss": float(np.mean(losses[-10:])) if losses else None,
        "draft_top1": float(np.mean(agrees[-10:])) if agrees else None,
        "train_seconds": round(train_seconds, 1),
        "seconds": round(seconds, 1),
        # CPU time of this process (all threads): on a shared machine, wall time / threads overstates the work
        "cpu_seconds": None if cpu_seconds is None else round(cpu_seconds, 1),
    }


def train_draft(
    method: str,
    target: str,
    out: str | Path,
    *,
    prompts: str | Path | None = None,
    max_prompts: int = 0,
    holdout: int = 2,
    answer_tokens: int = 128,
    draft_vocab: int = 4096,
    epochs: int | None = None,
    lr: float = 1e-3,
    batch_tokens: int = 1024,
    save_every: int = 20,
    max_minutes: float = 0.0,
    medusa_heads: int = 4,
    capacity: int | None = None,
    threads: int | None = 2,
    seed: int = 0,
    progress: bool = True,
    spinning: bool = True,
) -> Path:
    """Train ``method`` heads for ``target``; returns the heads folder ``out/<method>``.

    The defaults are the shipped heads' recipe (``data/heads/README.md``); ``epochs`` defaults to
    the method's ``HeadRecipe.epochs``. ``spinning=False``: the runtime that generates the answers
    uses sleeping thread pools (faster on a machine that other jobs share)."""
    if method not in RECIPES:
        raise ExportError(f"unknown --method {method!r}; choose one of {', '.join(HEAD_METHODS)}.")
    recipe = RECIPES[method]
    epochs = epochs or recipe.epochs
    if threads:
        torch.set_num_threads(threads)
    out = Path(out)
    with disk_errors(out):
        out.mkdir(parents=True, exist_ok=True)
    prepare_out_dir(out / method, force=True)  # a writable file system, before the long work
    started, cpu_started = time.perf_counter(), time.process_time()
    prep = prepare(
        target,
        out,
        prompts=prompts,
        max_prompts=max_prompts,
        holdout=holdout,
        answer_tokens=answer_tokens,
        draft_vocab=draft_vocab,
        capacity=capacity,
        threads=threads,
        progress=progress,
        layers=recipe.reads_layers,
        spinning=spinning,
    )
    head = build_head(recipe, prep, medusa_heads, seed)
    t = Training.start(head, batches(prep.data, batch_tokens, epochs, seed), lr)
    folder = out / method
    folder.mkdir(exist_ok=True)
    settings = {"method": method, "config": asdict(head.cfg), "steps": len(t.plan), "lr": lr, "seed": seed}
    checkpoint = Checkpoint(folder / "checkpoint.pt", settings)
    checkpoint.resume(t)
    train_seconds = run_training(
        recipe,
        t,
        prep.data,
        checkpoint,
        batch_tokens=batch_tokens,
        save_every=save_every,
        max_minutes=max_minutes,
        progress=progress,
    )
    head.cfg.training = training_summary(
        prep,
        t,
        prompts=prompts,
        holdout=holdout,
        answer_tokens=answer_tokens,
        epochs=epochs,
        lr=lr,
        train_seconds=train_seconds,
        seconds=time.perf_counter() - started,
        cpu_seconds=time.process_time() - cpu_started,
    )
    if isinstance(head, Eagle3Head):
        head.fold_feature_scale()  # the checkpoint above keeps the unfolded weights a rerun continues from
    return save_heads(folder, head.eval(), prep.vocab_ids)
