"""`chat` and `generate`: the runtime commands, thin over ``Pipeline`` (light imports only)."""

from __future__ import annotations

import contextlib
import json
import re
import threading
from dataclasses import asdict, dataclass, replace

import click

from specdec_edge.api.settings import LoadSettings
from specdec_edge.cli.options import K_OPTION, file_option, load_options, parse_options, settings_options
from specdec_edge.errors import SpecdecError
from specdec_edge.sampling import SamplingParams
from specdec_edge.speculative.history import DEFAULT_HISTORY_MB, MAX_HISTORY_MB
from specdec_edge.speculative.methods import METHODS, options_help

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


@dataclass(frozen=True)
class PipelineChoice:
    """What the options of ``pipeline_options`` say: the bundle, the method (with -k and -o KEY=VALUE, parsed by
    ``load``) and how to load it (``LoadSettings``: --threads, --provider, --history, chat's and serve's --reuse,
    serve's --prompt-cache-mb)."""

    bundle: str
    method: str | None = None
    k: int | None = None
    options: tuple[str, ...] = ()
    load: LoadSettings = LoadSettings()


@dataclass(frozen=True)
class SamplingSettings:
    """What the options of ``generation_options`` say about each answer (``Pipeline.stream``'s keywords)."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def check(self) -> None:
        """Refuse a bad value (e.g. --temperature inf) before the (slow) load."""
        SamplingParams(self.temperature, self.top_k, self.top_p, self.seed)

    def stream(self, pipe, request, stop=None):
        """``request`` streamed as these settings say (KV reuse: the pipeline's, ``LoadSettings.reuse``)."""
        return pipe.stream(request, stop=stop, **asdict(self))


def pipeline_options(f):
    """The options that load a pipeline, shared by `chat`, `generate` and `serve`: the command gets them as one
    ``PipelineChoice``, its first argument."""
    options = [
        click.argument("bundle", type=click.Path()),
        click.option(
            "--method",
            type=click.Choice(list(METHODS)),
            default=None,
            help="Default: the one the bundle records (export --default-method), else auto. "
            + "; ".join(f"{m.name}: {m.summary}" for m in METHODS.values())
            + ".",
        ),
        K_OPTION,
        click.option(
            "-o",
            "--option",
            "options",
            multiple=True,
            metavar="KEY=VALUE",
            help=f"Method option, repeatable ({options_help()}); see the README's methods table.",
        ),
        *load_options(),
    ]
    return settings_options(PipelineChoice, options)(f)


def generation_options(f):
    """The options shared by `chat` and `generate`: the pipeline's (a ``PipelineChoice``, the first argument),
    then how to sample (a ``SamplingSettings``, the second)."""
    options = [
        click.option(
            "--max-new-tokens",
            type=click.IntRange(min=1),
            default=256,
            show_default=True,
            help="Stop after this many new tokens.",
        ),
        click.option(
            "--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True, help="0 means greedy."
        ),
        click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True, help="0 turns it off."),
        click.option(
            "--top-p",
            type=click.FloatRange(0, 1, min_open=True),
            default=1.0,
            show_default=True,
            help="1 turns it off.",
        ),
        click.option("--seed", type=click.IntRange(min=0), default=None, help="Seed for reproducible sampling."),
    ]
    return pipeline_options(settings_options(SamplingSettings, options)(f))


def history_options(f):
    """``--history/--no-history`` and ``--history-mb``: drafting from earlier calls (`chat`, `serve`; fields of
    ``LoadSettings``, in ``PipelineChoice.load``)."""
    f = click.option(
        "--history-mb",
        type=click.FloatRange(0, MAX_HISTORY_MB, min_open=True),
        default=DEFAULT_HISTORY_MB,
        show_default=True,
        help="Memory for the history (per client when serving); the oldest text is dropped first.",
    )(f)
    return click.option(
        "--history/--no-history",
        default=True,
        show_default=True,
        help="Keep earlier calls' prompts and answers for the methods that draft from them (auto, history): "
        "text that repeats what was said before is generated faster; the output is the same either way.",
    )(f)


def load(choice: PipelineChoice, template_file: str | None = None):
    """The pipeline ``choice`` describes (with the chat template of ``template_file``); what takes a while to
    measure on first use is reported on stderr."""
    from specdec_edge.api.pipeline import Pipeline
    from specdec_edge.progress import to_stderr
    from specdec_edge.tokenizer import read_chat_template

    options = parse_options(choice.options)  # option syntax errors before the (slow) load
    template = read_chat_template(template_file) if template_file else None
    settings = replace(choice.load, chat_template=template, progress=to_stderr)
    return Pipeline.load(choice.bundle, settings, method=choice.method, k=choice.k, **options)


ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}


def unescape(text: str) -> str:
    r"""``--stop`` text with ``\n``, ``\t``, ``\r`` and ``\\`` turned into the characters (a shell passes them
    as a backslash and a letter); other backslashes stay as they are."""
    return re.sub(r"\\([ntr\\])", lambda m: ESCAPES[m.group(1)], text)


CHAT_COMMANDS = ("/reset", "/stats", "/exit")


def line_problem(line: str) -> str | None:
    """Why a typed chat line cannot be sent, or None. A terminal whose bytes are not UTF-8 reaches Python as
    lone surrogates (surrogateescape): the error names the byte and where it is in the line typed."""
    try:
        line.encode("utf-8")
    except UnicodeEncodeError as e:
        char = ord(line[e.start])
        byte = f"byte 0x{char - 0xDC00:02X}" if 0xDC80 <= char <= 0xDCFF else f"U+{char:04X}"
        return (
            f"that line is not valid UTF-8 text ({byte} at character {e.start + 1} of the line); set the terminal "
            "to UTF-8 and type it again."
        )
    return None


def _line_editing() -> None:
    """Arrow keys, line editing and history for ``input()`` where the platform has readline."""
    try:
        import readline  # noqa: F401  (importing it is what turns it on)
    except ImportError:
        pass


def stats_line(stats) -> str:
    line = (
        f"[{stats.new_tokens} tokens, {stats.tokens_per_s:.1f} tok/s, "
        f"{stats.tokens_per_pass:.2f} tokens per target pass, prefill {stats.prefill_s * 1000:.0f} ms"
        + (f", {stats.reused_tokens} prompt tokens reused" if stats.reused_tokens else "")
        + "]"
    )
    if len(stats.by_proposer) > 1:  # a method that mixes proposers (auto, pld-eagle): which ran, how well
        line += f"\n[{stats.proposer_summary()}]"
    return line


@click.command(context_settings=CONTEXT)
@generation_options
@history_options
@click.option("--system", default=None, help="System message at the start of the conversation.")
@file_option(
    "--chat-template",
    "template_file",
    help="Jinja chat template file (or a tokenizer_config.json holding one) to use instead of the bundle's. "
    "Without one, a base model's bundle (no template) runs as a completion REPL.",
)
@click.option(
    "--reuse/--no-reuse",
    default=True,
    show_default=True,
    help="Keep the conversation's KV cache between turns, so each turn prefills only what is new (--no-reuse "
    "prefills the whole conversation every turn, for comparison).",
)
def chat(choice: PipelineChoice, sampling: SamplingSettings, system, template_file):
    """Chat with a bundle in the terminal; answers stream as tokens are accepted.

    \b
    Commands: /reset (forget the conversation), /stats (last answer's stats),
    /exit (or Ctrl-D). Ctrl-C stops the current answer (then neither it nor
    its question stays in the conversation). Arrow keys edit the line and
    recall earlier ones where Python has readline.
    A base model's bundle (no chat template) runs as a completion REPL: each line is
    added to the text so far as a new paragraph, and the model continues the text.
    \b
    Examples:
      specdec-edge chat bundles/smollm2
      specdec-edge chat bundles/smollm2 --temperature 0.7 --top-p 0.9 --system "Be brief."
      specdec-edge chat bundles/pair --method plain --threads 2
      specdec-edge chat bundles/gemma-base --chat-template my_template.jinja
    """
    sampling.check()
    pipe = load(choice, template_file)
    completion = not pipe.tokenizer.has_chat_template
    _line_editing()
    start = [{"role": "system", "content": system}] if system else []
    click.echo(
        f"specdec-edge chat ({pipe.method}"
        + (f", k={pipe.k}" if pipe.method in ("draft", "auto") else "")
        + "). /reset, /stats, /exit."
    )
    if completion:
        click.echo(
            "This model has no chat template (a base model): completion mode. Each line is added to the text "
            "so far and the model continues it. For chat, pass --chat-template FILE."
        )
    with warming_up(pipe):
        _converse(pipe, sampling, start, completion)


@contextlib.contextmanager
def warming_up(pipe):
    """``pipe.warm_up()`` in a thread while the first line is typed: the runtime that prefills long prompts compiles
    then (~3 s), not when a first long message arrives. A message sent meanwhile waits for it (the engines' lease);
    a failure is left to the first long message to report. Joined on the way out."""

    def warm() -> None:
        with contextlib.suppress(SpecdecError):
            pipe.warm_up()

    thread = threading.Thread(target=warm, name="specdec-edge warm-up", daemon=True)
    thread.start()
    try:
        yield
    finally:
        thread.join()


def _converse(pipe, sampling: SamplingSettings, start: list[dict], completion: bool) -> None:
    """Chat's loop: read a line, run a command or answer it (streamed), until /exit or the end of input."""
    from specdec_edge.tokenizer import plain_text

    history, last = list(start), None
    while True:
        try:
            line = input(">>> ")
        except EOFError:
            click.echo()
            return
        except KeyboardInterrupt:
            click.echo()
            continue
        except UnicodeDecodeError:
            click.echo("Error: that line is not valid UTF-8 text; type it again.", err=True)
            continue
        problem = line_problem(line)
        if problem:
            click.echo(f"Error: {problem}", err=True)
            continue
        command, *args = line.split() or [""]
        if command in CHAT_COMMANDS and args:
            click.echo(f"Error: {command} takes no arguments; type {command} alone.", err=True)
            continue
        if command == "/exit":
            return
        if command == "/reset":
            history, last = list(start), None
            click.echo("(conversation reset)")
            continue
        if command == "/stats":
            if last and last.stats.by_proposer:
                click.echo(f"proposers: {last.stats.proposer_summary()}")
            click.echo(json.dumps(last.stats.as_dict(), indent=2) if last else "(no answer yet)")
            continue
        if not command:
            continue
        if command.startswith("/") and not args:
            click.echo(f"Unknown command {command}; the commands are /reset, /stats and /exit.", err=True)
            continue
        history.append({"role": "user", "content": line})
        request = plain_text(history) if completion else history
        try:
            stream = sampling.stream(pipe, request)
        except SpecdecError as e:
            history.pop()
            click.echo(f"Error: {e} (/reset starts a new conversation)", err=True)
            continue
        stopped = False
        try:
            for piece in stream:
                click.echo(piece, nl=False)
        except KeyboardInterrupt:
            stopped = True
            click.echo(" [stopped]", nl=False)
        finally:
            stream.close()
        last = stream.result
        if stopped:  # neither the question nor the partial answer stays in the conversation
            history.pop()
        else:
            history.append({"role": "assistant", "content": last.text})
        click.echo()
        click.secho(stats_line(last.stats) + (" (not kept in the conversation)" if stopped else ""), dim=True)


@click.command(context_settings=CONTEXT)
@generation_options
@click.option("--prompt", required=True, help="The prompt text (sent as is, without the chat template).")
@click.option(
    "--chat-template",
    "template",
    is_flag=False,
    flag_value="",
    default=None,
    metavar="[FILE]",
    help="Wrap the prompt as a user message in the bundle's chat template, or in the template of FILE (a Jinja "
    "file or a tokenizer_config.json; what a base model's bundle needs for this).",
)
@click.option(
    "--stop",
    multiple=True,
    help=r"Stop string (repeatable); not included in the output. \n, \t, \r and \\ stand for a newline, a tab, "
    "a carriage return and a backslash.",
)
@click.option("--json", "as_json", is_flag=True, help="Print text, token_ids, stats and finish_reason as JSON.")
def generate(choice: PipelineChoice, sampling: SamplingSettings, prompt, template, stop, as_json):
    """Generate text for one prompt (for scripts).

    \b
    Examples:
      specdec-edge generate bundles/smollm2 --prompt "Once upon a time" --max-new-tokens 64
      specdec-edge generate bundles/smollm2 --prompt "List three colours." --chat-template --json
      specdec-edge generate bundles/pair --prompt "def fib(n):" --stop "\\n\\n" --temperature 0.8 --seed 1
      specdec-edge generate bundles/gemma-base --prompt "Hi" --chat-template my_template.jinja
    """
    from specdec_edge.api.request import check_stops

    sampling.check()
    stops = check_stops([unescape(s) for s in stop])  # and too many or too long --stop strings
    pipe = load(choice, template or None)
    request = [{"role": "user", "content": prompt}] if template is not None else prompt
    stream = sampling.stream(pipe, request, stops)
    with stream:
        for piece in stream:
            if not as_json:
                click.echo(piece, nl=False)
    result = stream.result
    if as_json:
        click.echo(
            json.dumps(
                {
                    "text": result.text,
                    "token_ids": result.token_ids,
                    "stats": result.stats.as_dict(),
                    "finish_reason": result.finish_reason,
                }
            )
        )
    else:
        click.echo()
        click.secho(stats_line(result.stats), dim=True, err=True)
