"""Session benchmark (`specdec-edge bench --sessions`): multi-turn sessions, every turn timed on its own.

    from specdec_edge import Pipeline
    from specdec_edge.bench.sessions import build_sessions, run_sessions, sessions_markdown
    pipe = Pipeline.load("bundles/smollm2", method="plain", threads=2)
    print(sessions_markdown(run_sessions(pipe, ["plain", "auto"], build_sessions(n=1))))

Sessions, built from the shipped Spec-Bench prompts and generic follow-ups (``build_sessions``):
Spec-Bench's two-turn questions; a five-turn conversation over a long document (summarize, list facts,
rewrite, title, quote); a code-editing loop (each turn asks for a change to the code the previous turn
wrote, the whole program again); an agent-like loop whose every request repeats the earlier tool output
and adds more (fresh requests, not a conversation).

Rows: each method in each mode of ``MODES`` -- today's behaviour (no reuse, no history), KV prefix reuse
across calls, history (drafting from earlier calls), both. Plain decoding does not draft, so it runs the
modes without history only. Every row of a session gets the same requests: those of plain decoding
without reuse (the reference, run first; conversation turns carry its answers), and every turn's output
is compared with the reference's token for token. A row starts with a fresh history store, after an
unrelated call that does not reuse, and with the prompt cache emptied (so nothing cached by the row before
is reused: a row reuses only what its own turns left, ``Pipeline.stream(reuse=...)``). Per turn: time to
the first text, decode tokens/s, prefill, reused and prefilled prompt tokens (``Stats.reused_tokens`` and
``Stats.prefilled_tokens``: the prompt's tokens before the pending one, which the first pass computes); per
session the whole time. Report: JSON, Markdown (``sessions_markdown``)
and a PNG (``plot_sessions``), written as ``bench`` writes its own. Light imports only.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

from tqdm import tqdm

from specdec_edge.bench.spec_bench import (
    BenchSettings,
    load_average,
    load_prompts,
    machine,
    machine_line,
    model_name,
    plot_bars,
    versions,
)
from specdec_edge.errors import SpecdecError
from specdec_edge.speculative.history import DEFAULT_HISTORY_MB, HistoryStore
from specdec_edge.speculative.methods import METHODS

# mode -> (reuse the KV prefix across calls, draft from history)
MODES = {"none": (False, False), "reuse": (True, False), "history": (False, True), "reuse+history": (True, True)}
REFERENCE = ("plain", "none")
BASES = ("plain none", "auto none")  # the rows speedups are over (a report without auto has none over auto)
KINDS = ("spec-bench", "document", "code-edit", "agent")
DOCUMENT_TURNS = (
    "List the facts the document states, one per line.",
    "Rewrite your summary for a ten-year-old.",
    "Give the document a short title.",
    "Quote the sentence of the document that matters most, word for word.",
)
CODE_TURNS = (
    "Add type hints to the code. Reply with the whole program.",
    "Add a docstring to every function. Reply with the whole program.",
    "Give the variables longer, clearer names. Reply with the whole program.",
    "Add a main guard that runs the program on an example. Reply with the whole program.",
)
AGENT_SYSTEM = "You are a research agent. Each step you get the tool output so far; answer with your next step."


@dataclass(frozen=True)
class Session:
    name: str
    kind: str  # one of KINDS
    turns: tuple[str, ...]  # the user messages (agent: each turn's whole request text)
    conversation: bool = True  # False: every turn is a fresh request (system + that text), not a reply
    system: str | None = None


@dataclass
class Turn:
    """One timed call of a session."""

    token_ids: list[int]
    wall_s: float  # the whole call: template, prefill, decode, detokenize
    first_s: float  # time to the first streamed text
    prefill_s: float
    new_tokens: int
    decode_s: float  # after prefill
    decode_tokens_per_s: float
    prompt_tokens: int
    reused_tokens: int  # of the prompt's tokens before the pending one: kept from earlier calls
    prefilled_tokens: int  # and computed by this call's prefill
    by_proposer: dict = field(default_factory=dict)  # proposer -> [passes, proposed, accepted]


def build_sessions(path: str | Path | None = None, n: int = 1) -> list[Session]:
    """``n`` sessions of each kind (``KINDS``) from a Spec-Bench style file (default: the packaged copy)."""
    rows = load_prompts(path, None, 10**6)
    two = [r for r in rows if len(r.turns) == 2]
    by_cat = {}
    for r in two:
        by_cat.setdefault(r.category, []).append(r)
    picked = [group[i] for i in range(n) for group in by_cat.values() if i < len(group)][:n]
    docs = sorted((r for r in rows if r.category == "summarization"), key=lambda r: len(r.turns[0]))
    docs = docs[len(docs) // 2 :][:n]  # long documents, not the longest
    code = by_cat.get("coding", [])[:n]
    rag = [r for r in rows if r.category == "rag"][:n]
    if not (picked and docs and code and rag):
        raise SpecdecError("the prompts file needs two-turn, coding, summarization and rag prompts for --sessions.")
    sessions = [Session(f"spec-bench-{r.question_id}", "spec-bench", r.turns) for r in picked]
    for r in docs:
        text = r.turns[0].split(":", 1)[1].strip() if r.turns[0].startswith("Summarize:") else r.turns[0]
        first = f"Here is a document.\n\n{text}\n\nSummarize it in three sentences."
        sessions.append(Session(f"document-{r.question_id}", "document", (first, *DOCUMENT_TURNS)))
    for r in code:
        sessions.append(Session(f"code-edit-{r.question_id}", "code-edit", (r.turns[0], *CODE_TURNS)))
    for r in rag:
        sessions.append(Session(f"agent-{r.question_id}", "agent", agent_requests(r.turns[0]), False, AGENT_SYSTEM))
    return sessions


def agent_requests(prompt: str, steps: int = 4) -> tuple[str, ...]:
    """Requests of an agent loop over a retrieval prompt: its passages come back as tool output, one more per
    step, every earlier one repeated."""
    lines = [line for line in prompt.splitlines() if line.strip()]
    question, passages = lines[-1], lines[:-1] or lines
    per = max(1, len(passages) // steps)
    out = []
    for step in range(1, steps + 1):
        shown = "\n".join(passages[: per * step])
        out.append(f"Task: {question}\n\nTool output (search results so far):\n{shown}\n\nStep {step}: what next?")
    return tuple(out)


def rows_for(methods: list[str], modes: list[str]) -> list[tuple[str, str]]:
    """(method, mode) rows, the reference first."""
    rows = [REFERENCE]
    for m in methods:
        for mode in modes:
            if (m, mode) == REFERENCE or (m, mode) in rows:
                continue
            if MODES[mode][1] and not METHODS[m].speculative:
                continue  # plain drafts nothing: history changes nothing
            rows.append((m, mode))
    return rows


def label(row: tuple[str, str]) -> str:
    return f"{row[0]} {row[1]}"


def _flush(pipe) -> None:
    """An unrelated short call that reuses nothing, and an empty prompt cache: the caches then hold nothing of
    the row that ran before (its snapshots would hand the next row the same session's context)."""
    pipe.generate("Hello.", max_new_tokens=1, reuse=False, history=False)
    if pipe.engines.prompt_cache is not None:
        pipe.engines.prompt_cache.clear()


def _call(pipe, request, max_new_tokens: int, kw: dict) -> tuple[Turn, str]:
    start = time.perf_counter()
    first = None
    stream = pipe.stream(request, max_new_tokens=max_new_tokens, **kw)
    with stream:
        for _ in stream:
            if first is None:
                first = time.perf_counter() - start
    wall = time.perf_counter() - start
    result = stream.result
    s = result.stats
    by = {name: [p.steps, p.proposed, p.accepted] for name, p in s.by_proposer.items()}
    turn = Turn(
        list(result.token_ids),
        wall,
        wall if first is None else first,
        s.prefill_s,
        s.new_tokens,
        s.decode_s,
        s.decode_tokens_per_s,
        s.prompt_tokens,
        s.reused_tokens,
        s.prefilled_tokens,
        by,
    )
    return turn, result.text


def run_session(pipe, session: Session, mode: str, max_new_tokens: int, requests: list | None = None):
    """One row on one session: its turns, and the requests it sent (built from its own answers when
    ``requests`` is None: the reference run)."""
    reuse, history = MODES[mode]
    store = (pipe.new_history() or HistoryStore.of_mb(DEFAULT_HISTORY_MB)) if history else False  # a fresh one
    kw = {"reuse": reuse, "history": store}
    _flush(pipe)
    return play(session, lambda request: _call(pipe, request, max_new_tokens, kw), requests)


def play(session: Session, call, requests: list | None = None) -> tuple[list, list]:
    """A session's turns through ``call(request) -> (turn, answer text)``: each turn's request is the given one,
    or (``requests`` None) the system message, the conversation so far with the answers ``call`` gave, and the
    user's turn (an agent session: the system message and that turn's text, every time). The turns and the
    requests sent."""
    turns, sent, messages = [], [], [] if session.system is None else [{"role": "system", "content": session.system}]
    for i, text in enumerate(session.turns):
        request = requests[i] if requests is not None else [*messages, {"role": "user", "content": text}]
        turn, answer = call(request)
        turns.append(turn)
        sent.append(request)
        if session.conversation and requests is None:
            messages = [*request, {"role": "assistant", "content": answer}]
    return turns, sent


def run_sessions(
    pipeline,
    methods: list[str],
    sessions: list[Session],
    settings: BenchSettings | None = None,
    *,
    modes: list[str] | None = None,
    meta: dict | None = None,
    progress: bool = True,
    requests: dict | None = None,
    **keywords,
) -> dict:
    """Every row (method x mode) on every session, the reference first on each; the report. Of ``settings``
    (``BenchSettings``, or its fields as ``keywords``), ``max_new_tokens``, ``k`` and ``options`` (method -> its
    options, as ``run_bench`` takes them) apply, to every method's pipeline;
    ``requests`` (session name -> the requests of each turn, e.g. an earlier report's ``requests``) makes every
    row, the reference too, send those instead of building the conversation from the reference's answers (the
    same prompts on another bundle). The report's ``requests`` holds what each session's rows sent."""
    s = replace(settings or BenchSettings(), **keywords)
    load_start = load_average()
    max_new_tokens, k, options = s.max_new_tokens, s.k, s.options
    if not pipeline.tokenizer.has_chat_template:
        raise SpecdecError("--sessions needs a bundle with a chat template (sessions are conversations).")
    modes = list(modes or ["none", "reuse", "reuse+history"])
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise SpecdecError(f"unknown mode {unknown[0]!r}; choose from {', '.join(MODES)}.")
    rows = rows_for(list(dict.fromkeys(["plain", *methods])), modes)
    pipes = {m: pipeline.with_method(m, k=k, **(options or {}).get(m, {})) for m in dict.fromkeys(r[0] for r in rows)}
    results: dict[str, dict] = {label(r): {} for r in rows}
    bar = tqdm(total=len(rows) * len(sessions), desc="sessions", unit="row", file=sys.stderr, disable=not progress)
    ran, skipped_sessions, sent = [], {}, {}
    for session in sessions:
        given = (requests or {}).get(session.name)
        try:
            reference, sent[session.name] = run_session(pipes["plain"], session, "none", max_new_tokens, given)
        except SpecdecError as e:  # e.g. longer than the KV cache
            skipped_sessions[session.name] = str(e)
            bar.update(len(rows))
            continue
        ran.append(session)
        results[label(REFERENCE)][session.name] = _session_result(reference, reference)
        bar.update()
        for row in rows[1:]:
            turns, _ = run_session(pipes[row[0]], session, row[1], max_new_tokens, sent[session.name])
            results[label(row)][session.name] = _session_result(turns, reference)
            bar.update()
    bar.close()
    if not ran:
        first = next(iter(skipped_sessions.values()), "no sessions were given")
        raise SpecdecError(f"no session could run ({first}); give shorter prompts or a bundle with a larger cache.")
    info = {
        "methods": list(pipes),
        "modes": modes,
        "rows": [label(r) for r in rows],
        "max_new_tokens": max_new_tokens,
        "k": {m: p.k for m, p in pipes.items() if METHODS[m].speculative},
        "method_options": {m: p.options for m, p in pipes.items() if p.options},
        "exactness": pipeline.describe_exactness(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "load_average_start_end": [load_start, load_average()],
        "versions": versions(),
        **(meta or {}),
    }
    report = {
        "meta": info,
        "sessions": [{"name": s.name, "kind": s.kind, "turns": len(s.turns)} for s in ran],
        "results": results,
        "skipped_sessions": skipped_sessions,
        "requests": {s.name: sent[s.name] for s in ran},
    }
    report["summary"] = summarize(report)
    return report


def _session_result(turns: list[Turn], reference: list[Turn]) -> dict:
    return session_result(turns, [t.token_ids == r.token_ids for t, r in zip(turns, reference)])


def session_result(turns: list[Turn], same: list[bool]) -> dict:
    """One row's result on one session as the report holds it; ``same``: each turn equals its reference's."""
    return {
        "total_s": sum(t.wall_s for t in turns),
        "new_tokens": sum(t.new_tokens for t in turns),
        "identical_turns": sum(same),
        "turns": [{**asdict(t), "identical": ok} for t, ok in zip(turns, same)],
    }


def summarize(report: dict) -> dict:
    """Per row and session kind: whole-session time and speedups, time to first text on turn 1 and after
    (and after as a share of the same turns without reuse), decode tok/s after turn 1, reused and prefilled
    tokens, identical turns."""
    kinds = {s["name"]: s["kind"] for s in report["sessions"]}
    out: dict[str, dict] = {}
    for row, by_session in report["results"].items():
        method = row.split(" ")[0]
        for kind in dict.fromkeys(kinds.values()):
            names = [n for n in by_session if kinds[n] == kind]
            if not names:
                continue
            turns = [t for n in names for t in by_session[n]["turns"]]
            later = [t for n in names for t in by_session[n]["turns"][1:]]
            total = sum(by_session[n]["total_s"] for n in names)
            decode_s = sum(t["decode_s"] for t in later)
            base = {r: sum(report["results"].get(r, {}).get(n, {}).get("total_s", 0.0) for n in names) for r in BASES}
            same_method_none = report["results"].get(f"{method} none", {})
            later_none = [t for n in names for t in same_method_none.get(n, {}).get("turns", [])[1:]]
            first_later = sum(t["first_s"] for t in later)
            first_none = sum(t["first_s"] for t in later_none)
            out.setdefault(row, {})[kind] = {
                "sessions": len(names),
                "total_s": total,
                "speedup_vs_plain": base["plain none"] / total if total and base["plain none"] else None,
                "speedup_vs_auto": base["auto none"] / total if total and base["auto none"] else None,
                "first_s_turn1": sum(by_session[n]["turns"][0]["first_s"] for n in names) / len(names),
                "first_s_later": first_later / len(later) if later else None,
                "first_later_vs_no_reuse": first_later / first_none if later and first_none else None,
                "decode_tokens_per_s_later": sum(t["new_tokens"] for t in later) / decode_s if decode_s > 0 else None,
                "reused_tokens": sum(t["reused_tokens"] for t in turns),
                "prefilled_tokens": sum(t["prefilled_tokens"] for t in turns),
                "identical_turns": sum(t["identical"] for t in turns),
                "turns": len(turns),
            }
    return out


def _f(x, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def sessions_markdown(report: dict) -> str:
    """The summary table (one row per session kind and row), then each turn of the first session of each kind."""
    meta = report["meta"]
    lines = [
        f"Sessions on {model_name(meta)} ({meta.get('dtype', '?')}), greedy, {meta['max_new_tokens']} new tokens "
        f"max per turn, threads={meta.get('threads', '?')}, {meta['date']}; k: "
        + ", ".join(f"{m} {k}" for m, k in meta["k"].items())
        + ". Whole = the session's calls end to end; first text = time to the first streamed text; decode tok/s "
        "and first text 'later' are over turns 2+; 'vs none' = turns 2+'s first text over the same method's "
        "without reuse.",
        *filter(None, [machine_line(meta)]),
        "",
        "| session | row | whole s | vs plain | vs auto | first text t1 s | later s | vs none | decode tok/s "
        "later | reused / prefilled | identical |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    kinds = list(dict.fromkeys(s["kind"] for s in report["sessions"]))
    for kind in kinds:
        for row, by_kind in report["summary"].items():
            if kind not in by_kind:  # a row that did not run this kind (a peer that could not)
                continue
            r = by_kind[kind]
            lines.append(
                f"| {kind} ({r['sessions']}) | {row} | {r['total_s']:.2f} | {_f(r['speedup_vs_plain'], '.2f')}x | "
                f"{_f(r['speedup_vs_auto'], '.2f')}x | {r['first_s_turn1']:.3f} | {_f(r['first_s_later'], '.3f')} | "
                f"{_f(r['first_later_vs_no_reuse'], '.0%')} | {_f(r['decode_tokens_per_s_later'], '.1f')} | "
                f"{r['reused_tokens']} / {r['prefilled_tokens']} | {r['identical_turns']}/{r['turns']} |"
            )
    lines += ["", "Per turn (the first session of each kind):", ""]
    lines += ["| session | row | turn | first text s | decode tok/s | new | reused | prefilled | history acc. |"]
    lines += ["|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for kind in kinds:
        name = next(s["name"] for s in report["sessions"] if s["kind"] == kind)
        for row, by_session in report["results"].items():
            for i, t in enumerate(by_session.get(name, {}).get("turns", []), 1):
                accepted = t["by_proposer"].get("history", [0, 0, 0])[2]
                lines.append(
                    f"| {name} | {row} | {i} | {t['first_s']:.3f} | {t['decode_tokens_per_s']:.1f} | "
                    f"{t['new_tokens']} | {t['reused_tokens']} | {t['prefilled_tokens']} | {accepted} |"
                )
    if meta.get("exactness"):
        lines.append(f"\nExactness on this device: {meta['exactness']}.")
    for name, reason in report["skipped_sessions"].items():
        lines.append(f"\nSkipped session {name}: {reason}")
    compared_with = meta.get("compared_with", {})  # row -> the row it was compared with (default: plain none)
    for row, by_session in report["results"].items():
        for name, r in by_session.items():
            bad = [i + 1 for i, t in enumerate(r["turns"]) if not t["identical"]]
            if bad:
                ref = compared_with.get(row, "plain")
                lines.append(f"\nDIVERGENCE: {row} differs from {ref} on {name} turn(s) {bad}.")
    return "\n".join(lines) + "\n"


def plot_sessions(report: dict, out: str | Path) -> None:
    """A PNG: whole-session speedup vs plain without reuse, per session kind, one bar per row."""
    rows = [r for r in report["summary"] if r != label(REFERENCE)]
    kinds = list(dict.fromkeys(s["kind"] for s in report["sessions"]))
    bars = {row: [report["summary"][row].get(k, {}).get("speedup_vs_plain") or 0.0 for k in kinds] for row in rows}
    title = f"{model_name(report['meta'])} sessions, greedy"
    ylabel = "whole-session speedup vs plain, no reuse"
    plot_bars(out, kinds, bars, ylabel, title, group_width=1.2, rotate=False, legend_size=8)
