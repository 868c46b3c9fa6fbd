"""Counters and timers of one generation: what the decode loop did and where the time went."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields


@dataclass
class ProposerStats:
    """What one proposer's proposals did (``Stats.by_proposer``): why ``auto`` chose what it chose."""

    steps: int = 0  # target passes that verified its proposal
    proposed: int = 0  # its draft tokens verified
    accepted: int = 0  # of which accepted
    accepted_at: Counter = field(default_factory=Counter)  # depth (1 = first draft token) -> accepted there
    widths: Counter = field(default_factory=Counter)  # draft tokens verified in one pass -> passes

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_pass(self) -> float:
        """Accepted draft tokens + the target's own, per pass."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    def add(self, other: ProposerStats) -> None:
        """Sum ``other`` into this one (several generations)."""
        self.steps += other.steps
        self.proposed += other.proposed
        self.accepted += other.accepted
        self.accepted_at.update(other.accepted_at)
        self.widths.update(other.widths)

    def as_dict(self) -> dict:
        return {
            "steps": self.steps,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "acceptance_rate": self.acceptance_rate,
            "tokens_per_pass": self.tokens_per_pass,
            "accepted_at": {str(d): c for d, c in sorted(self.accepted_at.items())},
            "widths": {str(w): c for w, c in sorted(self.widths.items())},
        }


@dataclass
class Stats:
    """Filled in by ``decode`` as it runs, so it is valid even after a cancelled generation.

    A "pass" is one target verification pass (a step of the loop); it emits
    ``accepted + 1`` tokens unless generation stops inside it.
    """

    prompt_tokens: int = 0
    # of the prompt's tokens before the pending one: kept in the caches from earlier calls (reuse), and computed
    reused_tokens: int = 0
    prefilled_tokens: int = 0
    restored_tokens: int = 0  # of the reused: copied in from the prompt cache's snapshot of an earlier context
    new_tokens: int = 0  # tokens emitted (eos included)
    steps: int = 0  # target verification passes
    proposed: int = 0  # draft tokens verified
    accepted: int = 0  # draft tokens accepted
    accepted_lengths: Counter = field(default_factory=Counter)  # n_accepted -> number of passes
    near_ties: int = 0  # greedy: emitted tokens whose top-2 target logits were closer than NEAR_TIE
    min_logit_gap: float | None = None  # the smallest such top-2 gap (None: no near tie)
    prefill_s: float = 0.0
    draft_s: float = 0.0  # proposer: propose + commit
    verify_s: float = 0.0  # target passes
    total_s: float = 0.0  # prefill + decode, wall clock
    # Per proposer that made the verified proposals ("plain" for steps without one): pld, eagle, ... -- for a
    # combined method (auto, pld-eagle) this shows which proposer ran how often and how well.
    by_proposer: dict[str, ProposerStats] = field(default_factory=dict)
    resumes: int = 0  # times the generation went on after another call had used the engines (prefill again)

    @property
    def decode_s(self) -> float:
        return max(self.total_s - self.prefill_s, 0.0)

    @property
    def other_s(self) -> float:
        """Decode time outside draft and verify: acceptance, sampling, bookkeeping."""
        return max(self.decode_s - self.draft_s - self.verify_s, 0.0)

    @property
    def tokens_per_pass(self) -> float:
        """Mean tokens emitted per target pass (1.0 for plain decoding)."""
        return self.new_tokens / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second over the whole call, prefill included."""
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """New tokens per second after prefill."""
        return self.new_tokens / self.decode_s if self.decode_s > 0 else 0.0

    def record(self, source: str, proposed: int, accepted: int) -> None:
        """Count one verification pass for the proposer ``source`` ("" or "plain": none)."""
        entry = self.by_proposer.get(source or "plain")
        if entry is None:  # (not setdefault: a ProposerStats built every pass costs more than the rest)
            entry = self.by_proposer[source or "plain"] = ProposerStats()
        entry.steps += 1
        entry.proposed += proposed
        entry.accepted += accepted
        entry.widths[proposed] += 1
        for depth in range(1, accepted + 1):
            entry.accepted_at[depth] += 1

    def proposer_summary(self) -> str:
        """One line: each proposer's share of the passes, width, acceptance and tokens per pass."""
        return proposer_summary({name: s.as_dict() for name, s in self.by_proposer.items()})

    def as_dict(self) -> dict:
        """Plain JSON-able dict: the counters, the timers and the derived rates."""
        d = asdict(self)
        d["accepted_lengths"] = {str(n): c for n, c in sorted(self.accepted_lengths.items())}
        d["by_proposer"] = {name: s.as_dict() for name, s in sorted(self.by_proposer.items())}
        for name in (
            "decode_s",
            "other_s",
            "tokens_per_pass",
            "acceptance_rate",
            "tokens_per_s",
            "decode_tokens_per_s",
        ):
            d[name] = getattr(self, name)
        return d


def add_stats(a: Stats, b: Stats) -> Stats:
    """The stats of two runs (of one generation that resumed, or a bench prompt's turns): counters, timers and
    per-proposer stats added, the smallest logit gap kept."""
    out = Stats()
    for f in fields(Stats):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, Counter):
            value = Counter(x)
            value.update(y)
        elif isinstance(x, dict):  # by_proposer: name -> ProposerStats
            value = {}
            for part in (x, y):
                for name, entry in part.items():
                    value.setdefault(name, type(entry)()).add(entry)
        elif f.name == "min_logit_gap":
            value = min((v for v in (x, y) if v is not None), default=None)
        elif isinstance(x, (int, float)) and not isinstance(x, bool):
            value = x + y
        else:
            value = y
        setattr(out, f.name, value)
    return out


def proposer_summary(by_proposer: Mapping[str, Mapping]) -> str:
    """``ProposerStats.as_dict`` rows (``Stats.by_proposer``, or a bench report's) as one line: each proposer's
    share of the passes, width, acceptance and tokens per pass."""
    steps = sum(p["steps"] for p in by_proposer.values()) or 1
    parts = []
    for name, p in sorted(by_proposer.items(), key=lambda kv: -kv[1]["steps"]):
        share = p["steps"] / steps
        if name == "plain":
            parts.append(f"plain {share:.0%} of passes")
            continue
        width = p["proposed"] / p["steps"] if p["steps"] else 0.0
        parts.append(
            f"{name} {share:.0%} (width {width:.1f}, accepted {p['acceptance_rate']:.0%}, "
            f"{p['tokens_per_pass']:.2f} tokens/pass)"
        )
    return "; ".join(parts)
