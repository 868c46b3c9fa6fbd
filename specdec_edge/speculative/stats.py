"""Counters and timers of one generation: what the decode loop did and where the time went."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field


@dataclass
class Stats:
    """Filled in by ``decode`` as it runs, so it is valid even after a cancelled generation.

    A "pass" is one target verification pass (a step of the loop); it emits
    ``accepted + 1`` tokens unless generation stops inside it.
    """

    prompt_tokens: int = 0
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

    def as_dict(self) -> dict:
        """Plain JSON-able dict: the counters, the timers and the derived rates."""
        d = asdict(self)
        d["accepted_lengths"] = {str(n): c for n, c in sorted(self.accepted_lengths.items())}
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
