"""What `specdec-edge info` shows of a bundle: its summary (``summarize``: the manifest's, the methods it can run,
the step costs and exactness verdicts measured so far) and the text rendering of it (``render``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from specdec_edge.api.step_costs import costs_of_bundle
from specdec_edge.bundle.hashes import check_hashes
from specdec_edge.bundle.manifest import read_manifest
from specdec_edge.bundle.schema import Manifest, ModelSpec
from specdec_edge.exactness import Verdict, describe
from specdec_edge.runtime.prefill_choice import cached_choices, describe_choice
from specdec_edge.runtime.verdicts import cached_verdicts
from specdec_edge.speculative.methods import available_methods


def summarize(bundle: str | Path) -> tuple[dict, list]:
    """The JSON-able summary `info --json` prints, and the step costs measured for ``bundle`` on this machine.
    Checks the bundle as loading does (a damaged file is named here too)."""
    manifest = read_manifest(bundle)
    check_hashes(bundle, manifest)
    summary = manifest_summary(manifest)
    summary["methods"] = available_methods(manifest.draft is not None, manifest.heads)
    costs = costs_of_bundle(bundle)
    summary["step_costs"] = [c.to_json() for c in costs]
    summary["verdicts"] = [{**manifest.target.graph.verdict.to_json(), "measured": "at export"}]
    summary["verdicts"] += [
        {**v, "measured": _first_use(v)} for v in cached_verdicts(bundle) if v["graph"] == manifest.target.graph.path
    ]
    keys = ("device", "runtime", "rows", "past", "seconds", "speedups", "errors")
    summary["prefill"] = [{key: record[key] for key in keys if key in record} for record in cached_choices(bundle)]
    return summary, costs


def render(bundle: str | Path, summary: dict, costs: list) -> Iterator[str]:
    """The lines `info` prints for ``summary`` (from ``summarize``)."""
    yield (
        f"bundle {bundle} (schema {summary['schema_version']}, exported by specdec-edge "
        f"{summary['exporter']['version']} on {summary['exporter'].get('created', '?')})"
    )
    for role in ("target", "draft"):
        m = summary[role]
        if m is None:
            continue
        v = m["validation"]
        yield f"  {role}: {m['source']}"
        yield (
            f"    {m['architecture']}, {m['layers']} layers, vocab {m['vocab_size']}, {m['dtype']}, "
            f"{m['flavour']} graph, cache {m['cache_capacity']} tokens"
            + (", hidden states" if m["hidden_states"] else "")
            + (f", features of layers {m['feature_layers']}" if m.get("feature_layers") else "")
            + (", a prefill graph with fp32 activations" if m.get("prefill_graph") else "")
        )
        yield (
            f"    validation vs PyTorch: max rel err {_number(v.get('max_rel_err'), '.2e')} "
            f"(tolerance {v.get('tolerance')}), top-1 agreement {_number(v.get('top1_agreement'), '.0%')}"
        )
        if role == "target":
            for verdict in summary["verdicts"]:
                bounds = verdict["details"].get("boundaries") or []
                device = verdict["device"] if isinstance(verdict["device"], dict) else {}  # any JSON value: formatted
                where = f"{device.get('name', '?')} ({device.get('provider', '?')}, threads "
                where += f"{device.get('threads', '?')}, {verdict['measured']})"
                yield f"    exactness on {where}: {describe(Verdict.from_json(verdict), m['dtype'])}"
                if bounds:
                    yield f"      passes never straddle key counts {bounds} (the kernels round differently there)"
            for record in summary.get("prefill", []):
                yield f"    {describe_choice(record)}"
    for method, h in summary["heads"].items():
        tree = ", ".join(f"{k} {v}" for k, v in h["tree"].items()) or "proposer defaults"
        tokens = f"{h['training_tokens']:,}" if isinstance(h["training_tokens"], int) else "?"
        yield (
            f"  {method} heads: draft vocab {h['draft_vocab']}, tree: {tree}; trained on {tokens} tokens; "
            f"max rel err vs PyTorch {_number(h['max_rel_err'], '.1e')}"
        )
    if summary.get("ngram_table"):
        yield f"  n-gram table: {summary['ngram_table']} (auto drafts from it)"
    if summary["default_method"]:
        yield f"  default method: {summary['default_method']}"
    yield f"  methods: {', '.join(summary['methods'])}"
    template = "yes" if summary["chat_template"] else "no (a base model: plain text; chat runs in completion mode)"
    yield f"  eos ids {summary['eos_token_ids']}, chat template: {template}"
    yield f"  {summary['files']} files, {summary['total_bytes'] / 1e6:.1f} MB"
    if not costs:
        yield "  step costs: not measured on this machine yet (auto measures them on first use, ~seconds)"
    for c in costs:
        key = c.key
        yield f"  step costs on {key['device']} ({key['provider']}, threads {key['threads']}):"
        for line in c.describe().splitlines():
            yield f"    {line}"


def manifest_summary(manifest: Manifest) -> dict:
    """A short JSON-able summary for `specdec-edge info`."""

    def model(m: ModelSpec | None):
        if m is None:
            return None
        g = m.graph
        return {
            "source": m.source,
            "architecture": m.architecture,
            "graph": g.path,
            "flavour": g.flavour,
            "dtype": g.dtype,
            "layers": g.cache.num_layers,
            "cache_capacity": g.cache.capacity,
            "vocab_size": g.vocab_size,
            "hidden_states": g.has_hidden_states,
            "feature_layers": list(g.feature_layers),
            "prefill_graph": g.prefill_path,
            "batch_invariant": g.verdict.batch_invariant,
            "min_pass_width": g.verdict.min_pass_width,
            "tree_invariant": g.verdict.tree_invariant,
            "validation": m.validation,
        }

    return {
        "schema_version": manifest.schema_version,
        "exporter": manifest.exporter,
        "target": model(manifest.target),
        "draft": model(manifest.draft),
        "eos_token_ids": list(manifest.tokenizer.eos_token_ids),
        "chat_template": manifest.tokenizer.chat_template is not None,
        "files": len(manifest.files),
        "total_bytes": sum(e["size"] for e in manifest.files.values()),
        "heads": {
            m: {
                "draft_vocab": h.config.get("draft_vocab"),
                "tree": h.tree,
                "training_tokens": h.training.get("tokens"),
                "max_rel_err": h.validation.get("max_rel_err"),
            }
            for m, h in manifest.heads.items()
        },
        "default_method": manifest.default_method or "auto",
        "ngram_table": manifest.ngram_table,
    }


def _number(x, spec: str) -> str:
    """``x`` formatted with ``spec``, or "?" when the manifest holds no number there."""
    return format(x, spec) if isinstance(x, (int, float)) and not isinstance(x, bool) else "?"


def _first_use(verdict: dict) -> str:
    """How a verdict cached on first use was measured: whole, or its reuse check alone (``verdicts.with_prefiller``)."""
    base = verdict.get("details", {}).get("decode_checks_from")
    return "on first use" if not base else f"on first use; its decode checks are the {base} setting's"
