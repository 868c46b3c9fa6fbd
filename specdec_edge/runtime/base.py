"""What every engine shares: the host-held valid length of its fixed-capacity KV cache."""

from __future__ import annotations


class CacheLength:
    """Mixin for engines: ``length`` committed slots; rollback moves it back and copies nothing.

    The engine sets ``self.graph`` (a ``GraphSpec``) and ``self.length``.
    """

    graph: object
    length: int = 0

    @property
    def vocab_size(self) -> int:
        return self.graph.vocab_size

    def reset(self) -> None:
        self.length = 0

    def rollback(self, length: int) -> None:
        """Forget every cache slot from ``length`` on (nothing is copied)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"rollback to {length} outside 0..{self.length}")
        self.length = length
