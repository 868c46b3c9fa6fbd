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
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from torch import nn

from specdec_edge.api.settings import LoadSettings
from specdec_edge.atomic import write_atomic
from specdec_edge.bundle.hashes import sha256_file
from specdec_edge.bundle.manifest import read_manifest
from specdec_edge.bundle.schema import Manifest
from specdec_edge.bundle.write import disk_errors, prepare_out_dir
from specdec_edge.errors import ExportError
from specdec_edge.export.draft_data import batches, draft_vocabulary, generate_data, load_prompt_texts, prepare_bundle
from specdec_edge.export.head_export import target_final_norm, target_weights
from specdec_edge.export.head_losses import answer_top1
from specdec_edge.export.head_modules import Eagle3Head, FrozenTarget
from specdec_edge.export.head_recipes import HEAD_METHODS, RECIPES, HeadRecipe
from specdec_edge.export.heads_folder import checked_weights, read_head_config, save_heads, trainable_state
from specdec_edge.export.self_data import batch_answerer, self_written_prompts, torch_target


@dataclass(frozen=True)
class TrainSettings:
    """How ``train_draft`` trains; the defaults are the shipped heads' recipe (``data/heads/README.md``)."""

    prompts: str | Path | None = None  # Spec-Bench style JSONL or text file, or "spec-bench"; None: self-written
    corpus: str | Path | None = None  # a corpus folder (``corpus.py``): its answers instead of ``prompts``
    self_prompts: int = 1024  # prompts the target writes itself when ``prompts`` is None
    answer_batch: int = 32  # answers the PyTorch model generates at a time, at most PART (0: our runtime, one by one)
    max_prompts: int = 0  # 0: every prompt
    holdout: int = 2  # prompts per category kept out of training
    answer_tokens: int = 128  # the target's greedy answer per prompt
    draft_vocab: int = 4096  # tokens of the heads' own vocabulary
    epochs: int | None = None  # None: the method's ``HeadRecipe.epochs``
    lr: float = 1e-3
    batch_tokens: int = 1024
    save_every: int = 20  # steps between checkpoints
    max_minutes: float = 0.0  # of training (0: no limit); a rerun continues
    medusa_heads: int = 4
    ttt_steps: int | None = None  # draft steps unrolled in training (None: the recipe's: eagle 1, eagle3 4)
    capacity: int | None = None  # the target bundle's KV cache (None: the exporter's default)
    threads: int | None = 2
    seed: int = 0
    progress: bool = True  # progress bars on stderr
    spinning: bool = True  # False: the runtime generating the answers uses sleeping thread pools
    eval_bundle: str | Path | None = None  # after each epoch: the heads' chain acceptance on this bundle
    eval_prompts: int = 24  # held-out corpus requests answered by that check
    held_out_every: int = 50  # one corpus request in this many is kept apart from training (``corpus.held_out``)
    corpus_shards: int = 0  # the corpus's first N shards (0: all): a rerun resumes on the shards it started with
    # shards before this one are skipped: a run that continues ``init`` on the shards it has not seen yet, so that
    # each session trains on what the corpus gained since the last (the shards are samples of one distribution)
    corpus_from: int = 0
    init: str | Path | None = None  # a heads folder to start from (its weights and draft vocabulary), not random


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
    held_out: list[dict] = field(default_factory=list)  # sequences kept apart from training (a corpus's)
    corpus_shards: int = 0  # how many of the corpus's shards the data holds (0: no corpus)
    corpus_from: int = 0  # the first of them trained on


def prepare(target: str, out: Path, s: TrainSettings, layers: bool = False) -> Prepared:
    """Export (or reuse) the target bundle, generate (or reuse) the answers, pick the draft vocabulary.
    ``layers``: the head reads the target's layer features (EAGLE-3); load them too."""
    bundle = prepare_bundle(target, out, s.capacity, s.progress, layers)
    manifest = read_manifest(bundle)
    graph = manifest.target.graph
    if s.corpus is not None:
        return prepare_corpus(bundle, manifest, out, s, layers)
    loaded = torch_target(target) if s.prompts is None or s.answer_batch else None
    if s.prompts is not None:
        texts = load_prompt_texts(s.prompts, s.max_prompts, s.holdout)
    elif loaded is None:
        raise ExportError(
            f"{target} is a bundle (ONNX graphs only), which cannot write its own prompts; give a prompt file "
            "with --prompts FILE (or --prompts spec-bench), or the model itself as --target."
        )
    else:
        texts = self_written_prompts(loaded, out / "prompts.jsonl", s.self_prompts, s.seed, s.progress)
    answer = None
    if loaded is not None and s.answer_batch:
        # the layer features too, as the runtime's parts hold them: one data folder serves every head method
        answer = batch_answerer(
            loaded, graph.cache.capacity, tuple(graph.feature_layers), s.answer_tokens, s.answer_batch
        )
    data = generate_data(
        bundle,
        texts,
        out / "data",
        answer_tokens=s.answer_tokens,
        progress=s.progress,
        layers=layers,
        load=LoadSettings(threads=s.threads, spinning=s.spinning),
        answer=answer,
    )
    embed, lm_head = target_weights(bundle)
    eos = manifest.tokenizer.eos_token_ids
    vocab_ids = draft_vocabulary(data, manifest.target.graph.vocab_size, s.draft_vocab, eos)
    return Prepared(manifest, embed, lm_head, texts, data, vocab_ids, target_final_norm(bundle))


def prepare_corpus(bundle: Path, manifest: Manifest, out: Path, s: TrainSettings, layers: bool) -> Prepared:
    """``prepare`` from a corpus: its sequences with ``bundle``'s own features (cached per shard in ``out``)."""
    from specdec_edge.export.corpus import Corpus
    from specdec_edge.export.corpus_data import corpus_data

    shards = s.corpus_shards or len(Corpus.read(s.corpus).shards)  # fixed now: the generator may be adding more
    data, apart = corpus_data(
        bundle, s.corpus, out / "corpus-features", layers=layers, held_out_every=s.held_out_every,
        threads=s.threads, progress=s.progress, shards=slice(s.corpus_from, shards),
    )  # fmt: skip
    embed, lm_head = target_weights(bundle)
    eos = manifest.tokenizer.eos_token_ids
    vocab_ids = draft_vocabulary(data, manifest.target.graph.vocab_size, s.draft_vocab, eos)
    texts = [""] * (len(data) + len(apart))  # the requests live in the corpus; only their count is reported
    final_norm = target_final_norm(bundle)
    return Prepared(
        manifest, embed, lm_head, texts, data, vocab_ids, final_norm, held_out=apart, corpus_shards=shards,
        corpus_from=s.corpus_from,
    )  # fmt: skip


def build_head(recipe: HeadRecipe, prep: Prepared, medusa_heads: int, seed: int, ttt_steps=None) -> nn.Module:
    """The recipe's head sized for the target, initialised from ``seed``; ``ttt_steps`` (EAGLE, EAGLE-3): draft
    steps unrolled in training instead of the recipe's."""
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
    if ttt_steps is not None:
        if recipe.name not in ("eagle", "eagle3"):
            raise ExportError(f"--ttt-steps trains EAGLE and EAGLE-3 heads, not {recipe.name}.")
        cfg.ttt_steps = ttt_steps
    torch.manual_seed(seed)
    scale = feature_scale(prep.data) if recipe.reads_layers else None
    target = FrozenTarget(prep.embed, prep.lm_head, prep.vocab_ids, final_norm=prep.final_norm, feature_scale=scale)
    return recipe.module(cfg, target)


def initial_weights(folder: str | Path, method: str, prep: Prepared) -> dict[str, np.ndarray]:
    """``--init``: the weights of an earlier run's heads folder, checked to be ``method``'s for this target.
    ``prep`` takes its draft vocabulary (the head's output rows belong to it), so training continues that head on
    new data instead of starting from random weights: each session's run adds to the last."""
    folder = Path(folder)
    cfg = read_head_config(folder)
    graph = prep.manifest.target.graph
    if cfg.method != method:
        raise ExportError(f"--init {folder} holds {cfg.method} heads, not {method}; pass a {method} heads folder.")
    if method == "eagle3" and list(cfg.feature_layers) != list(graph.feature_layers):
        raise ExportError(
            f"--init {folder} reads target layers {list(cfg.feature_layers)}, the target bundle outputs "
            f"{list(graph.feature_layers)}; export the target with these heads (`export --heads {folder}`)."
        )
    if (cfg.hidden_size, cfg.vocab_size) != (graph.hidden_size, graph.vocab_size):
        raise ExportError(
            f"--init {folder} was trained for hidden {cfg.hidden_size} x vocab {cfg.vocab_size}, the target has "
            f"{graph.hidden_size} x {graph.vocab_size}; pass heads trained for this target."
        )
    tensors, prep.vocab_ids = checked_weights(folder, cfg)
    return tensors


def load_initial(head: nn.Module, tensors: dict[str, np.ndarray], folder: str | Path) -> None:
    """Copy ``tensors`` (``initial_weights``) into ``head``: every trainable tensor, at its shape."""
    own = trainable_state(head)
    if set(own) != set(tensors) or any(tuple(own[k].shape) != tuple(v.shape) for k, v in tensors.items()):
        raise ExportError(
            f"--init {folder} holds heads of other sizes than this run trains (e.g. --medusa-heads); pass "
            "the same sizes or train from the start."
        )
    head.load_state_dict({k: torch.as_tensor(v).float() for k, v in tensors.items()}, strict=False)


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

    def __init__(self, path: Path, settings: dict, corpus_shards: int = 0):
        self.path, self.settings, self.corpus_shards = path, settings, corpus_shards  # shards: for its error only

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
            shards = state.get("corpus_shards") if isinstance(state, dict) else None
            grown = f" (it trained on the corpus's first {shards} shards: add --corpus-shards {shards})" if (
                shards and shards != self.corpus_shards) else ""  # fmt: skip
            raise ExportError(
                f"{self.path} was written with other settings{grown}; use a new --out or delete the checkpoint."
            )
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
            "corpus_shards": self.corpus_shards,
        }
        write_atomic(self.path, write=lambda tmp: torch.save(state, tmp))


def run_training(
    recipe: HeadRecipe,
    t: Training,
    data: list[dict],
    checkpoint: Checkpoint,
    s: TrainSettings,
    epoch_ends: tuple[int, ...] = (),
    on_epoch=None,
) -> float:
    """Run the planned steps from ``t.step`` until done or ``s.max_minutes`` have passed; returns its seconds.

    Checkpoints every ``s.save_every`` steps and at the end, so a rerun continues where this one stopped; batches
    of ``s.batch_tokens``, progress bars when ``s.progress``.
    """
    from tqdm import tqdm

    batch_tokens, save_every, max_minutes, progress = s.batch_tokens, s.save_every, s.max_minutes, s.progress

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
        if t.step % save_every == 0 or t.step in epoch_ends:
            checkpoint.save(t)
        if on_epoch is not None and t.step in epoch_ends:
            on_epoch(epoch_ends.index(t.step) + 1, t)
    bar.close()
    checkpoint.save(t)
    return time.perf_counter() - start


def training_summary(
    prep: Prepared, t: Training, s: TrainSettings, train_seconds: float, seconds: float, cpu_seconds: float | None
) -> dict:
    """The ``training`` section of the heads' config.json (and of a bundle's manifest); ``s.epochs`` resolved."""
    source, losses, agrees = prep.manifest.target.source, t.losses, t.agrees
    return {
        "target": Path(source).name if Path(source).exists() else source,
        "prompts_file": _prompts_source(s),
        "answers": _answers_source(s),
        "prompts": len(prep.texts),
        "holdout_per_category": s.holdout,
        "sequences": len(prep.data),
        **({"corpus_shards": prep.corpus_shards} if prep.corpus_shards else {}),
        **({"corpus_from": prep.corpus_from} if prep.corpus_from else {}),
        "tokens": int(sum(len(d["ids"]) for d in prep.data)),
        "answer_tokens": s.answer_tokens,
        "draft_vocab": len(prep.vocab_ids),
        "steps": t.step,
        "planned_steps": len(t.plan),
        "epochs": s.epochs,
        "lr": s.lr,
        "first_loss": float(np.mean(losses[:10])) if losses else None,
        "final_loss": float(np.mean(losses[-10:])) if losses else None,
        "draft_top1": float(np.mean(agrees[-10:])) if agrees else None,
        "train_seconds": round(train_seconds, 1),
        "seconds": round(seconds, 1),
        # CPU time of this process (all threads): on a shared machine, wall time / threads overstates the work
        "cpu_seconds": None if cpu_seconds is None else round(cpu_seconds, 1),
    }


class EpochCheck:
    """After each epoch: the head's loss and top-1 on the held-out sequences (every slot, and the answers' slots
    alone: ``held_out_answer_top1``, what drafting meets), and its chain acceptance on
    ``s.eval_bundle`` (``head_eval.py``), appended to ``<method>/epochs.jsonl`` and printed."""

    def __init__(self, recipe: HeadRecipe, prep: Prepared, s: TrainSettings, folder: Path):
        self.recipe, self.prep, self.s, self.log = recipe, prep, s, folder / "epochs.jsonl"
        self.folder = folder
        self.groups = batches(prep.held_out, s.batch_tokens, 1, 0)[:16] if prep.held_out else []

    def __call__(self, epoch: int, t: Training) -> None:
        import copy
        import json

        from specdec_edge.export.head_eval import chain_acceptance

        row = {"epoch": epoch, "step": t.step, "train_loss": float(np.mean(t.losses[-20:])) if t.losses else None}
        apart = self.prep.held_out
        head = copy.deepcopy(t.head).eval()
        if apart:
            with torch.no_grad():
                scores = [self.recipe.loss(head, [apart[i] for i in b], self.s.batch_tokens) for b in self.groups]
                answers = np.sum(
                    [answer_top1(head, [apart[i] for i in b], self.s.batch_tokens) for b in self.groups], 0
                )
            row.update(held_out_loss=float(np.mean([float(x) for x, _ in scores])),
                       held_out_top1=float(np.mean([a for _, a in scores])))  # fmt: skip
            if answers[1]:  # what the first drafted token meets at run time: the answers' slots alone
                row["held_out_answer_top1"] = float(answers[0] / answers[1])
        if isinstance(head, Eagle3Head):
            head.fold_feature_scale()
        snapshot = save_heads(self.folder / f"epoch-{epoch}", head, self.prep.vocab_ids)
        prompts = [d["request"] for d in apart if "request" in d][: self.s.eval_prompts]
        if prompts:
            row[Path(self.s.eval_bundle).name] = chain_acceptance(
                snapshot, Path(self.s.eval_bundle), prompts, method=self.recipe.name, threads=self.s.threads
            )
        with open(self.log, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        if self.s.progress:
            print(f"train-draft: epoch {epoch}: {json.dumps(row)}", file=sys.stderr, flush=True)
        t.head.train()


def _answers_source(s: TrainSettings) -> str:
    if s.corpus:
        return "the corpus's (our runtime, greedy)"
    return f"PyTorch, batches of {s.answer_batch}" if s.answer_batch else "our runtime, one at a time"


def _prompts_source(s: TrainSettings) -> str:
    if s.corpus:
        return f"corpus {Path(s.corpus).name}"
    return Path(s.prompts).name if s.prompts else f"written by the target (seed {s.seed})"


def train_draft(method: str, target: str, out: str | Path, settings: TrainSettings | None = None, **changes) -> Path:
    """Train ``method`` heads for ``target``; returns the heads folder ``out/<method>``.

    ``settings`` (default ``TrainSettings()``, the shipped heads' recipe) with any of its fields given as
    keywords (``changes``: e.g. ``epochs=2``)."""
    if method not in RECIPES:
        raise ExportError(f"unknown --method {method!r}; choose one of {', '.join(HEAD_METHODS)}.")
    recipe = RECIPES[method]
    s = replace(settings or TrainSettings(), **changes)
    s = replace(s, epochs=s.epochs or recipe.epochs)
    if s.threads:
        torch.set_num_threads(s.threads)
    out = Path(out)
    with disk_errors(out):
        out.mkdir(parents=True, exist_ok=True)
    prepare_out_dir(out / method, force=True)  # a writable file system, before the long work
    started, cpu_started = time.perf_counter(), time.process_time()
    prep = prepare(target, out, s, layers=recipe.reads_layers)
    init = initial_weights(s.init, method, prep) if s.init else None
    head = build_head(recipe, prep, s.medusa_heads, s.seed, s.ttt_steps)
    if init is not None:
        load_initial(head, init, s.init)
        if isinstance(head, Eagle3Head):
            head.unfold_feature_scale()  # a saved EAGLE-3 fc reads raw features; this run's divides them first
    t = Training.start(head, batches(prep.data, s.batch_tokens, s.epochs, s.seed), s.lr)
    ends = tuple(np.cumsum([len(batches(prep.data, s.batch_tokens, 1, s.seed + e)) for e in range(s.epochs)]).tolist())
    folder = out / method
    folder.mkdir(exist_ok=True)
    settings = {"method": method, "config": asdict(head.cfg), "steps": len(t.plan), "lr": s.lr, "seed": s.seed}
    if s.corpus_from:  # ... and only on the shards it began with
        settings["corpus_from"] = s.corpus_from
    if s.init:  # a checkpoint continues only the run that started from these weights
        settings["init"] = sha256_file(Path(s.init) / "weights.safetensors")
    checkpoint = Checkpoint(folder / "checkpoint.pt", settings, prep.corpus_shards)
    checkpoint.resume(t)
    on_epoch = EpochCheck(recipe, prep, s, folder) if s.eval_bundle else None
    train_seconds = run_training(recipe, t, prep.data, checkpoint, s, ends, on_epoch)
    seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
    head.cfg.training = training_summary(prep, t, s, train_seconds, seconds, cpu_seconds)
    if s.init:  # where the weights came from, with that run's own summary (and so on back)
        head.cfg.training["init"] = {"folder": Path(s.init).name, "training": read_head_config(Path(s.init)).training}
    if isinstance(head, Eagle3Head):
        head.fold_feature_scale()  # the checkpoint above keeps the unfolded weights a rerun continues from
    return save_heads(folder, head.eval(), prep.vocab_ids)
