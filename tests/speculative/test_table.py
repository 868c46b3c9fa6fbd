"""The n-gram table of the model's own text and its proposer (pure numpy)."""

from __future__ import annotations

import numpy as np
import pytest

from specdec_edge.errors import SpecdecError
from specdec_edge.speculative.table import NgramTable, TableProposer

THE, CAT, SAT, RAN, DOG = 1, 2, 3, 4, 5


def example() -> NgramTable:
    return NgramTable.build([[THE, CAT, SAT], [THE, CAT, RAN], [THE, CAT, SAT], [DOG]], vocab=10, min_count=2)


def test_the_most_frequent_next_token_after_the_longest_known_context():
    table = example()
    assert table.lookup([THE]) == (CAT, 1.0)
    token, share = table.lookup([DOG, THE, CAT])  # (dog, the, cat) unseen, (the, cat) seen 3 times
    assert token == SAT and share == pytest.approx(2 / 3, abs=1e-3)
    assert table.lookup([DOG]) is None  # seen once: below min_count
    assert table.lookup([]) is None


def test_ties_go_to_the_lowest_token_and_counts_are_exact():
    table = NgramTable.build([[7, 9], [7, 8], [7, 9], [7, 8], [7, 6]], vocab=10, min_count=1)
    assert table.lookup([7]) == (8, pytest.approx(0.4, abs=1e-3))


def test_the_proposer_drafts_a_chain_with_falling_confidence():
    proposal = TableProposer(example()).propose([DOG, THE], k=4)
    assert proposal.tokens.tolist() == [CAT, SAT]  # nothing known after "sat"
    assert proposal.confidence.tolist() == pytest.approx([1.0, 2 / 3], abs=1e-3)
    assert proposal.source == "table" and proposal.parents is None
    assert len(TableProposer(example()).propose([DOG], k=4).tokens) == 0
    assert len(TableProposer(example()).propose([THE], k=0).tokens) == 0


def test_a_saved_table_reads_back_and_a_damaged_one_is_refused(tmp_path):
    table = example()
    table.save(tmp_path / "t.npz")
    back = NgramTable.load(tmp_path / "t.npz")
    assert back.vocab == 10 and back.entries == table.entries
    for n, arrays in table.orders.items():
        for a, b in zip(arrays, back.orders[n]):
            np.testing.assert_array_equal(a, b)
    (tmp_path / "bad.npz").write_bytes(b"not a table")
    with pytest.raises(SpecdecError, match="damaged"):
        NgramTable.load(tmp_path / "bad.npz")
    keys, nxt, share = table.orders[1]
    with open(tmp_path / "big.npz", "wb") as f:  # a token id outside the vocabulary
        np.savez(f, vocab=np.array(10), keys1=keys, next1=nxt + 100, share1=share)
    with pytest.raises(SpecdecError, match="do not fit"):
        NgramTable.load(tmp_path / "big.npz")
    with open(tmp_path / "pickle.npz", "wb") as f:  # an object array would need a pickle to read
        np.savez(f, vocab=np.array(10), keys1=np.array([object()], dtype=object), next1=nxt, share1=share)
    with pytest.raises(SpecdecError, match="damaged"):
        NgramTable.load(tmp_path / "pickle.npz")


def test_a_larger_vocabulary_packs_three_tokens_without_collisions():
    vocab = 262_144  # Gemma 3's
    rng = np.random.default_rng(0)
    seqs = [rng.integers(vocab - 3, vocab, size=50) for _ in range(20)]  # few distinct ids: many repeats
    table = NgramTable.build(seqs, vocab=vocab, min_count=1)
    context = seqs[0][:3].tolist()
    token, _ = table.lookup(context)
    follows = [s[i + 3] for s in seqs for i in range(len(s) - 3) if s[i : i + 3].tolist() == context]
    counts = np.bincount(np.array(follows) - (vocab - 3), minlength=3)
    assert token == vocab - 3 + int(np.argmax(counts))
