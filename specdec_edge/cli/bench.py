"""`bench`: speculative methods vs plain greedy decoding per task category; thin over ``specdec_edge.bench``."""

from __future__ import annotations

import json
from dataclasses import replace

import click

from specdec_edge.api.settings import LoadSettings
from specdec_edge.cli.options import K_OPTION, file_option, load_options, settings_options
from specdec_edge.errors import SpecdecError
from specdec_edge.speculative.methods import METHODS, options_help

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


@click.command(context_settings=CONTEXT)
@settings_options(LoadSettings, load_options(threads_default=2))
@click.argument("bundle", type=click.Path())
@click.option(
    "--methods",
    default="plain,pld,draft",
    show_default=True,
    help=f"Comma-separated methods ({', '.join(METHODS)}); plain always runs as the "
    "baseline. Methods the bundle cannot run are skipped with a message.",
)
@file_option(
    "--prompts",
    "prompts_file",
    help="Spec-Bench style JSONL (question_id, category, turns). Default: the packaged Spec-Bench copy.",
)
@click.option("--categories", default=None, help="Comma-separated categories (default: all in the file).")
@click.option(
    "--n-per-category",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="Prompts per category (the first ones in the file).",
)
@click.option(
    "--max-new-tokens", type=click.IntRange(min=1), default=128, show_default=True, help="New tokens per turn at most."
)
@K_OPTION
@click.option(
    "--temperature",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="0: greedy, outputs compared with plain's. Above 0: sampled with --seed, outputs not compared "
    "(speed and acceptance only), e.g. to measure medusa-typical.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Sampling seed of every call (--temperature > 0).")
@click.option(
    "-o",
    "--option",
    "options",
    multiple=True,
    metavar="METHOD.KEY=VALUE",
    help=f"Method option, repeatable, e.g. pld.max_ngram=4, lookahead.window=5 ({options_help()}).",
)
@click.option(
    "--reuse",
    is_flag=True,
    help="Each prompt's second turn keeps the KV cache of its first (as chat and serve do), for every method "
    "alike; without it every call prefills its whole prompt, as a first call does.",
)
@click.option(
    "--sessions",
    is_flag=True,
    help="Multi-turn sessions instead (Spec-Bench's two turns, a five-turn document conversation, a code-editing "
    "loop, an agent loop; specdec_edge/bench/sessions.py): each turn timed, rows with and without KV reuse and "
    "history; --methods defaults to plain,auto here, --n-per-category is sessions per kind.",
)
@file_option(
    "--json",
    "json_out",
    help="Write the report as JSON (a disk that fills up during the run: an error line; the table on stdout "
    "keeps the results).",
)
@file_option("--md", "md_out", help="Write the Markdown table.")
@file_option("--plot", "plot_out", help="Write a PNG bar chart of speedups (needs matplotlib).")
def bench(
    settings: LoadSettings,
    bundle,
    methods,
    prompts_file,
    categories,
    n_per_category,
    max_new_tokens,
    k,
    temperature,
    seed,
    options,
    sessions,
    json_out,
    md_out,
    plot_out,
):
    """Benchmark methods against plain greedy decoding on the same engines, per category.

    Prompts run one by one, plain then each method, so load affects all alike. Every method's greedy output must
    equal plain's; where it does not, the prompt and the first differing token are listed. Prints the Markdown
    table: a row per category, "open text" (writing, roleplay, reasoning, stem and humanities, where two or more ran)
    and "overall"; lossy methods marked "(lossy)". Methods run as chat, generate and serve run them: what this
    device's exactness verdict refuses is skipped, unless --allow-inexact (marked "(inexact)"). The report names
    the machine and the load average at its start and end: compare speeds within one machine and one run.

    \b
    Examples:
      specdec-edge bench bundles/smollm2 --methods plain,pld --json bench.json --md bench.md
      specdec-edge bench bundles/pair --categories rag,summarization --n-per-category 5 --plot speedup.png
      specdec-edge bench bundles/smollm2 --prompts my_prompts.jsonl --max-new-tokens 64 -k 8
      specdec-edge bench bundles/smollm2 --methods plain,lookahead -o lookahead.window=3 -o lookahead.guesses=2
      specdec-edge bench bundles/heads --methods plain,medusa,medusa-typical --temperature 0.7
    """
    from specdec_edge.api.pipeline import Pipeline
    from specdec_edge.bench.spec_bench import (
        bundle_metadata,
        check_methods,
        check_output_path,
        load_prompts,
        plot_speedups,
        require_matplotlib,
        run_bench,
        to_markdown,
    )
    from specdec_edge.cli.options import parse_options
    from specdec_edge.progress import to_stderr

    for path, option in ((json_out, "--json"), (md_out, "--md"), (plot_out, "--plot")):
        if path:
            check_output_path(path, option)  # before the run, so that its results are not lost at the end
    method_options = parse_options(options, per_method=True)
    if sessions and click.get_current_context().get_parameter_source("methods").name == "DEFAULT":
        methods = "plain,auto"
    if sessions and temperature:
        raise SpecdecError("--sessions is greedy (every turn is compared with plain's); leave out --temperature.")
    if sessions and settings.reuse:
        raise SpecdecError("--sessions runs its rows with and without KV reuse itself; leave out --reuse.")
    wanted = check_methods([m.strip() for m in methods.split(",") if m.strip()])
    if plot_out:
        require_matplotlib()
    cats = [c.strip() for c in categories.split(",") if c.strip()] if categories else None
    prompts = load_prompts(prompts_file, cats, n_per_category)
    meta = {
        **bundle_metadata(bundle),
        "threads": settings.threads,
        "spinning": settings.spinning,
        "n_per_category": n_per_category,
        "prompts_file": prompts_file or "packaged Spec-Bench",
    }
    # no history: every method runs the prompts plain ran first (sessions give each row a store of its own)
    settings = replace(settings, history=False, progress=to_stderr)
    pipe = Pipeline.load(bundle, settings, method="plain", k=k)
    meta["options"] = method_options
    if sessions:
        from specdec_edge.bench.sessions import build_sessions, plot_sessions, run_sessions, sessions_markdown

        sessions_list = build_sessions(prompts_file, n_per_category)
        run = dict(max_new_tokens=max_new_tokens, meta=meta, k=k, options=method_options)
        report = run_sessions(pipe, wanted, sessions_list, **run)
        write_report(report, sessions_markdown(report), plot_sessions, json_out, md_out, plot_out)
        return
    run = dict(
        k=k,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        seed=seed,
        allow_inexact=settings.allow_inexact,
        reuse=settings.reuse,
    )
    report = run_bench(pipe, wanted, prompts, meta=meta, options=method_options, **run)
    for m, reason in report["skipped_methods"].items():
        click.echo(f"Skipped method {m}: {reason}", err=True)
    for d in report["divergences"]:
        click.echo(
            f"Warning: {d['method']} differs from plain on prompt {d['question_id']} turn {d['turn']} "
            f"at token {d['position']}.",
            err=True,
        )
    write_report(report, to_markdown(report), plot_speedups, json_out, md_out, plot_out)


def write_report(report: dict, table: str, plot, json_out, md_out, plot_out) -> None:
    """Print the Markdown table, then write the JSON, Markdown and PNG asked for."""
    from specdec_edge.atomic import write_atomic

    click.echo(table)
    failed = []
    for path, option, write in (
        (json_out, "--json", lambda p: write_atomic(p, json.dumps(report, indent=2))),
        (md_out, "--md", lambda p: write_atomic(p, table)),
        (plot_out, "--plot", lambda p: plot(report, p)),
    ):
        if not path:
            continue
        try:
            write(path)
        except OSError as e:  # a disk that filled up (or went read-only) during the run: the results are above
            failed.append(f"could not write {option} {path} ({e.strerror or e})")
    if failed:
        raise SpecdecError("; ".join(failed) + ": the results are the Markdown table printed above on stdout.")
