"""Benchmark speculative methods against plain greedy decoding, per Spec-Bench category.

    from specdec_edge import Pipeline
    from specdec_edge.bench.spec_bench import load_prompts, run_bench, to_markdown
    pipe = Pipeline.load("bundles/smollm2", threads=2)
    report = run_bench(pipe, ["plain", "pld"], load_prompts(n_per_category=2))
    print(to_markdown(report))

Every prompt runs plain first, then each method, on the same engines (``with_method``), so
machine load affects all methods alike. Greedy only: every method must reproduce plain's
token ids, and any prompt where it does not is listed in ``divergences`` with the first
differing position. Two-turn prompts go through the chat template; turn 2's history holds
plain's turn-1 answer, so every method sees identical inputs. A base model's bundle (no chat
template) gets the turns as plain text instead (``tokenizer.plain_text``: paragraphs, plain's
answer continuing its turn), and the report says so (``meta.prompt_format``). Light imports only
(matplotlib is imported inside ``plot_speedups``).
"""

from __future__ import annotations

import functools
import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

from tqdm import tqdm

from specdec_edge import __version__
from specdec_edge.atomic import write_atomic
from specdec_edge.bundle.manifest import read_manifest
from specdec_edge.errors import SpecdecError
from specdec_edge.runtime.ov_prefill import prefill_name
from specdec_edge.speculative.costs import CostModel
from specdec_edge.speculative.methods import METHODS
from specdec_edge.speculative.stats import Stats, add_stats, proposer_summary
from specdec_edge.tokenizer import plain_text

DEFAULT_PROMPTS = Path(__file__).parent.parent / "data" / "spec_bench_question.jsonl"
OVERALL = "overall"
# Open text (issue 36): the Spec-Bench categories whose answers copy little of the prompt, so that only a drafter
# that predicts the model's own text pays there. A row of its own where two or more of them ran beside others.
OPEN_TEXT = "open text"
OPEN_TEXT_CATEGORIES = ("writing", "roleplay", "reasoning", "stem", "humanities")
CHAT_FORMAT = "chat template"
PLAIN_FORMAT = "plain text: no chat template (base model), turns joined as paragraphs"
KEYS = (
    "tokens_per_s",
    "decode_tokens_per_s",
    "prefill_s",
    "speedup_vs_plain",
    "mean_accepted_tokens",
    "acceptance_rate",
    "identical_output_rate",
    "near_ties",
    "min_logit_gap",
    "reused_tokens",
    "prefilled_tokens",
    "by_proposer",
)


@dataclass(frozen=True)
class BenchPrompt:
    question_id: int | str
    category: str
    turns: tuple[str, ...]  # one or two user turns


@dataclass
class Run:
    """One method on one prompt, both turns summed."""

    turn_ids: list[list[int]]  # generated token ids per turn
    wall_s: float = 0.0  # whole generate calls: template, prefill, decode, detokenize
    calls: int = 0
    stats: Stats = field(default_factory=Stats)  # the turns' stats summed (``add_stats``)

    def add(self, result, wall_s: float) -> None:
        self.turn_ids.append(list(result.token_ids))
        self.wall_s += wall_s
        self.calls += 1
        self.stats = add_stats(self.stats, result.stats)


def load_prompts(
    path: str | Path | None = None, categories: list[str] | None = None, n_per_category: int = 2
) -> list[BenchPrompt]:
    """The first ``n_per_category`` prompts of each category (all categories unless given), in file order.

    ``path``: a Spec-Bench style JSONL file (``question_id``, ``category``, ``turns``);
    default: the copy shipped in the package.
    """
    path = Path(path) if path else DEFAULT_PROMPTS
    if not path.is_file():
        raise SpecdecError(f"prompts file {path} does not exist; give a JSONL file with question_id, category, turns.")
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            rows.append(BenchPrompt(r["question_id"], r["category"], tuple(r["turns"][:2])))
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise SpecdecError(
                f"{path} line {n} is not a prompt ({e!r}); each line needs question_id, category "
                "and turns (a list of one or two strings)."
            ) from None
        if not rows[-1].turns or not all(isinstance(t, str) for t in rows[-1].turns):
            raise SpecdecError(f"{path} line {n}: turns must be a list of one or two strings.")
    known = list(dict.fromkeys(r.category for r in rows))
    unknown = [c for c in categories or () if c not in known]
    if unknown:
        raise SpecdecError(
            f"unknown categor{'y' if len(unknown) == 1 else 'ies'} {', '.join(unknown)} in {path}; "
            f"choose from {', '.join(known)}."
        )
    picked = []
    for category in categories or known:
        picked += [r for r in rows if r.category == category][:n_per_category]
    return picked


def check_methods(methods: list[str]) -> list[str]:
    """``["pld", "draft"]`` -> ``["plain", "pld", "draft"]``: plain always runs first, as the baseline."""
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise SpecdecError(
            f"unknown method {', '.join(map(repr, unknown)) or '(none given)'}; choose from "
            f"{', '.join(METHODS)} (--methods takes a comma-separated list, e.g. plain,pld)."
        )
    return list(dict.fromkeys(["plain", *methods]))


@dataclass(frozen=True)
class BenchSettings:
    """How ``run_bench`` runs the methods (`bench`'s options).

    ``options`` maps a method to its proposer options (e.g. ``{"lookahead": {"window": 5}}``). ``temperature`` > 0
    samples (every call with ``seed``): outputs are then not comparable token by token, so
    ``identical_output_rate`` is None; speeds and acceptance still are. ``allow_inexact``: run what the device's
    exactness verdict refuses, marked. ``reuse``: a prompt's second turn keeps the KV cache of its first
    (``Pipeline.generate``'s reuse), for every method alike; first turns start afresh, as by default every call does
    here (the report's ``reused_tokens`` and ``prefilled_tokens`` count what was kept and computed).
    """

    k: int | None = None
    max_new_tokens: int = 128
    options: dict | None = None
    temperature: float = 0.0
    seed: int = 0
    allow_inexact: bool = False
    reuse: bool = False


def run_bench(
    pipeline, methods: list[str], prompts: list[BenchPrompt], settings: BenchSettings | None = None, *,
    meta: dict | None = None, progress: bool = True, **keywords,
) -> dict:  # fmt: skip
    """Run plain and every method on every prompt, interleaved; return the report (see ``KEYS``). ``settings``
    (``BenchSettings``), or its fields as ``keywords``, say how.

    Every method is loaded as ``chat``, ``generate`` and ``serve`` load it (``exactness.py``): a method that the
    device's exactness verdict refuses is skipped with the reason, unless ``allow_inexact``; methods that then
    run inexactly are listed under ``meta["inexact_methods"]`` and marked "(inexact)".

    Methods the pipeline cannot run (e.g. "draft" without a draft model) are listed under
    ``skipped_methods`` with the reason, prompts too long for the KV cache under ``skipped_prompts``.
    Lossy methods (the registry's ``Method.lossy``) are listed under ``meta["lossy_methods"]`` and marked "(lossy)".
    """
    s = replace(settings or BenchSettings(), **keywords)
    load_start = load_average()
    pipes, skipped = {}, {}
    for m in check_methods(methods):
        try:
            pipes[m] = pipeline.with_method(m, k=s.k, allow_inexact=s.allow_inexact, **(s.options or {}).get(m, {}))
        except SpecdecError as e:
            skipped[m] = str(e)
    as_text = not pipeline.tokenizer.has_chat_template
    _warm_up(pipes, as_text)
    runs, skipped_prompts, divergences = _run_prompts(pipes, prompts, s, as_text, progress)
    if not runs["plain"]:
        first = skipped_prompts[0]["reason"] if skipped_prompts else "no prompts were given"
        raise SpecdecError(f"no prompt could run ({first}); give other prompts or categories.")
    cats = list(dict.fromkeys(p.category for p in prompts))
    groups = {c: [i for i, p in enumerate(prompts) if p.category == c and i in runs["plain"]] for c in cats}
    groups = {c: ids for c, ids in groups.items() if ids}
    open_text = sorted(i for c in OPEN_TEXT_CATEGORIES for i in groups.get(c, ()))
    if sum(c in groups for c in OPEN_TEXT_CATEGORIES) >= 2 and len(open_text) < len(runs["plain"]):
        groups[OPEN_TEXT] = open_text
    groups[OVERALL] = sorted(runs["plain"])
    results = {
        m: {
            c: _aggregate([runs[m][i] for i in ids], [runs["plain"][i] for i in ids], s.temperature == 0)
            for c, ids in groups.items()
        }
        for m in pipes
    }
    per_category = {c: len(ids) for c, ids in groups.items() if c not in (OPEN_TEXT, OVERALL)}
    load = {"load_average_start_end": [load_start, load_average()]}  # what else ran meanwhile, beside the figures
    info = _meta(pipeline, pipes, s, as_text, per_category, {**load, **(meta or {})})
    return {
        "meta": info,
        "results": results,
        "skipped_methods": skipped,
        "skipped_prompts": skipped_prompts,
        "divergences": divergences,
    }


def _run_prompts(pipes: dict, prompts: list[BenchPrompt], s: BenchSettings, as_text: bool, progress: bool) -> tuple:
    """Plain, then every method, on each prompt: the runs (method -> prompt index -> ``Run``), the prompts skipped
    (with the reason) and the greedy divergences from plain."""
    gen = {"temperature": s.temperature, "seed": s.seed}
    runs: dict[str, dict] = {m: {} for m in pipes}  # method -> prompt index -> Run
    skipped_prompts, divergences = [], []
    bar = tqdm(total=len(prompts) * len(pipes), desc="bench", unit="gen", file=sys.stderr, disable=not progress)
    for i, prompt in enumerate(prompts):
        try:
            plain, inputs = _run_plain(pipes["plain"], prompt, s.max_new_tokens, gen, as_text, s.reuse)
        except SpecdecError as e:
            skipped_prompts.append({"question_id": prompt.question_id, "category": prompt.category, "reason": str(e)})
            bar.update(len(pipes))
            continue
        runs["plain"][i] = plain
        bar.update()
        for m, pipe in pipes.items():
            if m == "plain":
                continue
            run = Run([])
            for turn, request in enumerate(inputs):
                run.add(*_timed(pipe, request, s.max_new_tokens, {**gen, "reuse": s.reuse and turn > 0}))
            runs[m][i] = run
            if s.temperature == 0:
                divergences += _divergences(m, prompt, plain, run)
            bar.update()
    bar.close()
    return runs, skipped_prompts, divergences


def _meta(pipeline, pipes: dict, s: BenchSettings, as_text: bool, per_category: dict, meta: dict | None) -> dict:
    """The report's ``meta``: how it ran (method, k, sampling, reuse, format, exactness, step costs, versions)."""
    costs = next(
        (p.decoder.proposer.costs for p in pipes.values() if hasattr(p.decoder.proposer, "costs")), None
    )  # auto's
    return {
        "baseline": baseline(meta or {}),
        "methods": list(pipes),
        "k": s.k if s.k is not None else {m: p.k for m, p in pipes.items() if METHODS[m].speculative},
        "max_new_tokens": s.max_new_tokens,
        "step_costs": None if costs is None else costs.to_json(),
        "temperature": s.temperature,
        "seed": s.seed,
        "reuse": s.reuse,
        "prompt_format": PLAIN_FORMAT if as_text else CHAT_FORMAT,
        "lossy_methods": [m for m in pipes if METHODS[m].lossy],
        "inexact_methods": [m for m, p in pipes.items() if p.exactness.inexact],
        "exactness": pipeline.describe_exactness(),
        "prefill": prefill_name(pipeline.engines.target),
        "prompts_per_category": per_category,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "versions": versions(),
        **(meta or {}),
    }


def baseline(meta: dict) -> str:
    """What ``speedup_vs_plain`` divides by, in words (the JSON's ``meta.baseline`` and the table's header)."""
    threads = meta.get("threads") or "default"
    if meta.get("spinning", True):
        pool = "one process-wide spinning thread pool (the draft and head sessions share it and sit idle)"
    else:
        pool = "a sleeping thread pool per session (--no-spinning: plain is not at its fastest here)"
    return f"plain decoding on the same target engine, {threads} threads, {pool}"


def _warm_up(pipes: dict, as_text: bool = False) -> None:
    """One short untimed generation per method, so session start-up costs stay out of the numbers."""
    messages = [{"role": "user", "content": "Say hello."}]
    for pipe in pipes.values():
        pipe.generate(plain_text(messages) if as_text else messages, max_new_tokens=8, history=False)


def _timed(pipe, request: list[dict] | str, max_new_tokens: int, gen: dict | None = None):
    start = time.perf_counter()
    # No history: a method run after plain on the same prompt would draft plain's answer from it.
    result = pipe.generate(request, max_new_tokens=max_new_tokens, history=False, **{"reuse": False, **(gen or {})})
    return result, time.perf_counter() - start


def _run_plain(
    pipe, prompt: BenchPrompt, max_new_tokens: int, gen: dict | None = None, as_text: bool = False, reuse=False
) -> tuple[Run, list]:
    """Plain on every turn; also the requests every method gets (turn 2 carries plain's answer): message
    lists, or with ``as_text`` (a model without a chat template) the same conversation as plain text."""
    run, inputs, history = Run([]), [], []
    for i, turn in enumerate(prompt.turns):
        messages = [*history, {"role": "user", "content": turn}]
        request = plain_text(messages) if as_text else messages
        # Untimed: ONNX Runtime plans each new input shape on first sight (the prefill chunks of
        # this prompt); without this the first method run on a prompt, plain, would pay for it. (Not before a
        # turn that reuses the turn before: it would leave this turn's whole prompt in the cache.)
        if not (reuse and i):
            pipe.generate(request, max_new_tokens=1, reuse=False, history=False)
        result, wall_s = _timed(pipe, request, max_new_tokens, {**(gen or {}), "reuse": reuse and i > 0})
        run.add(result, wall_s)
        inputs.append(request)
        history = [*messages, {"role": "assistant", "content": result.text}]
    return run, inputs


def _divergences(method: str, prompt: BenchPrompt, plain: Run, run: Run) -> list[dict]:
    """Where ``run``'s tokens first differ from plain's, per turn (none when they are identical)."""
    out = []
    for turn, (a, b) in enumerate(zip(plain.turn_ids, run.turn_ids), 1):
        if a != b:
            pos = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            out.append(
                {
                    "method": method,
                    "question_id": prompt.question_id,
                    "category": prompt.category,
                    "turn": turn,
                    "position": pos,
                    "plain_token": a[pos] if pos < len(a) else None,
                    "method_token": b[pos] if pos < len(b) else None,
                }
            )
    return out


def _aggregate(runs: list[Run], plain: list[Run], comparable: bool = True) -> dict:
    """One (method, category) row over ``runs``; rates are totals over totals, not means of ratios.
    ``comparable``: greedy runs, whose tokens must equal plain's (sampled runs are not compared)."""
    total = functools.reduce(add_stats, (r.stats for r in runs), Stats())
    tokens, prefill, proposed, steps = total.new_tokens, total.prefill_s, total.proposed, total.steps
    wall = sum(r.wall_s for r in runs)
    tps = tokens / wall if wall > 0 else 0.0
    plain_wall = sum(r.wall_s for r in plain)
    plain_tps = sum(r.stats.new_tokens for r in plain) / plain_wall if plain_wall > 0 else 0.0
    return {
        "tokens_per_s": tps,
        "decode_tokens_per_s": tokens / (wall - prefill) if wall > prefill else 0.0,
        "prefill_s": prefill / max(sum(r.calls for r in runs), 1),
        "speedup_vs_plain": tps / plain_tps if plain_tps > 0 else None,
        "mean_accepted_tokens": tokens / steps if steps else 0.0,
        "acceptance_rate": total.accepted / proposed if proposed else None,
        "identical_output_rate": (
            sum(r.turn_ids == p.turn_ids for r, p in zip(runs, plain)) / len(runs) if comparable else None
        ),
        "near_ties": total.near_ties,
        "min_logit_gap": total.min_logit_gap,
        "reused_tokens": total.reused_tokens,
        "prefilled_tokens": total.prefilled_tokens,
        "by_proposer": {name: p.as_dict() for name, p in sorted(total.by_proposer.items())},
    }


def machine() -> dict:
    """The machine a report's figures belong to: CPU model, its kernel-relevant instruction set features, the CPUs
    the OS shows, the architecture (speeds compare only within one machine)."""
    from specdec_edge.runtime.device import cpu_features, cpu_name

    return {"cpu": cpu_name(), "isa": cpu_features(), "cpus": os.cpu_count(), "arch": platform.machine()}


def load_average() -> float | None:
    """The 1-minute load average (None where the OS has none): beside every figure, what else the machine ran."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def machine_line(meta: dict) -> str | None:
    """The header's line naming the machine, from ``meta["machine"]`` and its load averages (None without them)."""
    m = meta.get("machine")
    if not m:
        return None
    line = f"Machine: {m['cpu']} ({m['arch']}; {', '.join(m['isa']) or 'no listed features'}), {m['cpus']} CPUs"
    load = meta.get("load_average_start_end") or [None, None]
    if None not in load:
        line += f"; load average {load[0]:.2f} at start, {load[1]:.2f} at end"
    return line + "."


def versions() -> dict:
    """Versions of the packages that decide the speed."""
    out = {"specdec_edge": __version__, "python": platform.python_version(), "platform": platform.platform()}
    for name in ("onnxruntime", "numpy", "tokenizers"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def bundle_metadata(bundle: str | Path) -> dict:
    """What the report says about the bundle: path, model sources, precision."""
    manifest = read_manifest(bundle)
    draft = manifest.draft
    return {
        "bundle": str(bundle),
        "model_source": manifest.target.source,
        "dtype": manifest.target.graph.dtype,
        "flavour": manifest.target.graph.flavour,
        "draft_source": draft.source if draft else None,
    }


def model_name(meta: dict) -> str:
    """The target's file or folder name (the full source path is in the JSON)."""
    return Path(str(meta.get("model_source") or meta.get("bundle", "?"))).name


def _fmt(x, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def to_markdown(report: dict) -> str:
    """The report as a Markdown table (one row per category and method), then skips and divergences."""
    meta = report["meta"]
    temperature = meta.get("temperature", 0.0)
    mode = "greedy" if not temperature else f"sampling at temperature {temperature} (outputs not compared)"
    lossy = set(meta.get("lossy_methods", ()))
    inexact = set(meta.get("inexact_methods", ()))
    k = meta["k"]
    k = ", ".join(f"{m} {v}" for m, v in k.items()) if isinstance(k, dict) else k
    lines = [
        f"Bench of {model_name(meta)} ({meta.get('dtype', '?')}), "
        f"{mode}, k={k}, {meta['max_new_tokens']} new tokens max, threads={meta.get('threads', '?')}, "
        f"{meta['date']}. Tokens/s over whole calls incl. prefill; decode tok/s excludes prefill.",
        f"Speedup baseline: {meta.get('baseline', 'plain decoding on the same engines')}.",
        f"Prompts: {meta.get('prompt_format', CHAT_FORMAT)}.",
        *filter(None, [machine_line(meta)]),
        "",
        "| category | method | tok/s | decode tok/s | prefill s | speedup | tokens/pass | acceptance "
        "| identical | near-ties | reused / prefilled tokens |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    categories = next(iter(report["results"].values()), {})
    for c in categories:
        for m, rows in report["results"].items():
            r = rows[c]
            label = m + (" (lossy)" if m in lossy else "") + (" (inexact)" if m in inexact else "")
            lines.append(
                f"| {c} | {label} | {r['tokens_per_s']:.1f} | {r['decode_tokens_per_s']:.1f} | "
                f"{r['prefill_s']:.3f} | {_fmt(r['speedup_vs_plain'], '.2f')}x | "
                f"{r['mean_accepted_tokens']:.2f} | {_fmt(r['acceptance_rate'], '.0%')} | "
                f"{_fmt(r['identical_output_rate'], '.0%')} | {r['near_ties']} | "
                f"{r.get('reused_tokens', 0)} / {r.get('prefilled_tokens', 0)} |"
            )
    mixed = {m: rows[OVERALL]["by_proposer"] for m, rows in report["results"].items()}
    mixed = {m: by for m, by in mixed.items() if len(by) > 1}
    if mixed:
        lines.append("\nWhich proposer verified each pass (overall; width = draft tokens verified):")
        for m, by in mixed.items():
            lines.append(f"- {m}: {proposer_summary(by)}")
    costs = meta.get("step_costs")
    if costs:
        lines.append("\nStep costs measured on this device (auto's cost model):")
        lines += [f"- {line}" for line in CostModel.from_json(costs).describe().splitlines()]
    if meta.get("exactness"):
        lines.append(f"\nExactness on this device: {meta['exactness']}.")
    if inexact:
        lines.append(
            f"\n(inexact): {', '.join(sorted(inexact))} ran with --allow-inexact where this device's exactness verdict "
            "does not vouch for them: their output may differ from plain decoding."
        )
    if lossy:
        lines.append(
            f"\n(lossy): {', '.join(sorted(lossy))} trade exactness for acceptance when sampling: the "
            "output no longer follows the target's distribution (greedy stays exact)."
        )
    for m, reason in report["skipped_methods"].items():
        lines.append(f"\nSkipped method {m}: {reason}")
    for p in report["skipped_prompts"]:
        lines.append(f"\nSkipped prompt {p['question_id']} ({p['category']}): {p['reason']}")
    for d in report["divergences"]:
        lines.append(
            f"\nDIVERGENCE: {d['method']} differs from plain on prompt {d['question_id']} ({d['category']}) "
            f"turn {d['turn']} at token {d['position']}."
        )
    return "\n".join(lines) + "\n"


def require_matplotlib() -> None:
    """Fail before a long run when the plot cannot be drawn."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SpecdecError(
            "--plot needs matplotlib: `pip install matplotlib` "
            "(or `pip install specdec-edge[bench]`), or leave out --plot."
        ) from None


def check_output_path(path: str | Path, option: str) -> Path:
    """Fail before a long run when a report cannot be written to ``path`` (``option`` names the flag)."""
    out = Path(path)
    if out.is_dir():
        raise SpecdecError(f"{option} {out} is a folder; give a file path.")
    folder = out.parent
    if not folder.is_dir():
        raise SpecdecError(f"{option} {out}: the folder {folder} does not exist; create it or choose another path.")
    try:  # a real write: permission bits say little for root or on read-only mounts
        with tempfile.NamedTemporaryFile(dir=folder, prefix=f".{out.name}.", suffix=".probe"):
            pass
    except OSError as e:
        raise SpecdecError(f"{option} {out}: cannot write in {folder} ({e.strerror}); choose another path.") from None
    return out


def plot_speedups(report: dict, out: str | Path) -> None:
    """A PNG bar chart: speedup vs plain per category, one bar per speculative method."""
    methods = [m for m in report["results"] if m != "plain"]
    categories = list(next(iter(report["results"].values()), {}))
    bars = {m: [report["results"][m][c]["speedup_vs_plain"] or 0.0 for c in categories] for m in methods}
    title = f"{model_name(report['meta'])}, greedy, k={report['meta']['k']}"
    plot_bars(out, categories, bars, "speedup vs plain (tokens/s incl. prefill)", title, group_width=0.7)


def plot_bars(
    out: str | Path,
    groups: list[str],
    bars: dict[str, list[float]],
    ylabel: str,
    title: str,
    *,
    group_width: float,
    rotate: bool = True,
    legend_size: int | None = None,
) -> None:
    """A PNG of grouped bars, written atomically: a group per ``groups`` entry, in each a bar per series of
    ``bars`` (its value per group), around a line at 1.0 (bench's and the session benchmark's speedups)."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    width = 0.8 / max(len(bars), 1)
    fig, ax = plt.subplots(figsize=(max(6.0, group_width * len(groups) + 2), 4))
    for j, (name, values) in enumerate(bars.items()):
        xs = [i + (j - (len(bars) - 1) / 2) * width for i in range(len(groups))]
        ax.bar(xs, values, width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(groups)), groups, **({"rotation": 45, "ha": "right"} if rotate else {}))
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=legend_size)
    fig.tight_layout()
    write_atomic(out, write=lambda tmp: fig.savefig(tmp, dpi=120, format="png"))
    plt.close(fig)
