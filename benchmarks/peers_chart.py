"""The chart of a `benchmarks/peers.py` run: whole-call tokens/s per runtime, plain beside its speculation,
each bar annotated with its fidelity (docs/PERFORMANCE.md shows it).

Usage:
  python benchmarks/peers_chart.py peers.json peers.png     # or: peers.py ... --json peers.json --plot peers.png

Per runtime (a group of bars): plain and its speculative method, tokens/s over whole calls incl. prefill (the
table's first column). Above each bar: its method, the mean common prefix with the fp32 model's greedy tokens ("fp32
prefix"), and for a speculative bar how many outputs equal the runtime's own plain output ("= plain").
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def groups(table: list[dict]) -> list[tuple[str, dict, dict | None]]:
    """(runtime, plain entry, speculative entry or None) in the table's order."""
    out: dict[str, list] = {}
    for e in table:
        slot = out.setdefault(e["runtime"], [None, None])
        slot[0 if e["method"] == "plain" else 1] = e
    return [(name, plain, spec) for name, (plain, spec) in out.items() if plain is not None]


def label(entry: dict, speculative: bool) -> str:
    """The note above one bar: fidelity to fp32, and for speculation its agreement with its own plain."""
    lines = [entry["method"]]
    if speculative:
        lines.append(f"= plain {entry['identical']}")
    if "common_prefix_with_fp32" in entry:
        lines.append(f"fp32 prefix {entry['common_prefix_with_fp32']:.1f}")
    return "\n".join(lines)


def plot_peers(report: dict, out: str | Path) -> None:
    """Write the PNG for a peers report (``{"meta": ..., "table": [...]}``) to ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = groups(report["table"])
    meta = report.get("meta", {})
    fig, ax = plt.subplots(figsize=(max(7.0, 1.6 * len(rows) + 2), 4.8))
    width, labelled = 0.38, set()
    top = max(e["tokens_per_s"] for _, p, s in rows for e in (p, s) if e) if rows else 1.0
    for i, (_, plain, spec) in enumerate(rows):
        for j, (entry, color, kind) in enumerate(((plain, "#9aa5b1", "plain"), (spec, "#2b6cb0", "speculative"))):
            if entry is None:
                continue
            x = i + (j - 0.5) * width
            ax.bar(x, entry["tokens_per_s"], width, color=color, label=None if kind in labelled else kind)
            labelled.add(kind)
            ax.text(x, entry["tokens_per_s"] + top * 0.01, label(entry, j == 1), ha="center", va="bottom", fontsize=6.5)
    names = [name.replace(" (", "\n(", 1) for name, _, _ in rows]
    ax.set_xticks(range(len(rows)), names, fontsize=7)
    ax.set_ylabel("tokens/s, whole calls incl. prefill")
    ax.set_ylim(0, top * 1.22)
    ax.legend(fontsize=8, loc="upper right")
    prompts = len(meta.get("prompts", []))
    when = str(meta.get("started", ""))[:10]
    ax.set_title(
        f"SmolLM2-135M-Instruct, {prompts} prompts, {meta.get('max_new_tokens', '?')} new tokens, greedy, "
        f"{meta.get('threads', '?')} threads\n{meta.get('machine', '')} {when}".strip(),
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(out, dpi=120, format="png")
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", type=Path, help="a peers.py --json report")
    ap.add_argument("png", type=Path)
    args = ap.parse_args()
    plot_peers(json.loads(args.json.read_text()), args.png)


if __name__ == "__main__":
    main()
