"""EAGLE trained with a training-time test (``--ttt-steps``): the unrolled steps are the run-time chain, and a
head trained so exports and decodes exactly like any EAGLE head."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from specdec_edge.errors import ExportError
from specdec_edge.export.head_losses import eagle_loss, eagle_unroll
from specdec_edge.export.head_modules import EagleHead, FrozenTarget
from specdec_edge.export.head_recipes import RECIPES
from tests.tiny_models import TRAIN


def small_head(steps: int) -> tuple[EagleHead, dict]:
    rng = np.random.default_rng(0)
    V, H, T, start = 96, 32, 14, 6
    vocab_ids = np.arange(0, V, 2)
    cfg = RECIPES["eagle"].config(H, V, len(vocab_ids), 2, 8, 0)
    cfg.ttt_steps = steps
    torch.manual_seed(0)
    head = EagleHead(cfg, FrozenTarget(rng.standard_normal((V, H)), rng.standard_normal((V, H)), vocab_ids)).eval()
    with torch.no_grad():
        for p in (head.input_norm, head.post_norm):
            p.add_(0.3 * torch.randn_like(p))
    seq = {
        "ids": rng.integers(0, V, T),
        "features": rng.standard_normal((T, H)).astype(np.float16),
        "answer_start": start,
    }
    return head, seq


def test_the_unrolled_steps_are_the_run_time_chain():
    """Step s's prediction at slot i is the head's when run as EagleProposer runs it: committed slots 0..i with
    the target's features in its cache, then a chain feeding each predicted feature back with the next token at
    position i+s, attending to the committed slots and its own ancestors. Labels are f[i+1+s]."""
    head, seq = small_head(3)
    x, f = seq["ids"], torch.as_tensor(seq["features"]).float()
    T, start, cfg = len(x), seq["answer_start"], head.cfg
    with torch.no_grad():
        steps = list(eagle_unroll(head, [seq], 64))
        assert len(steps) == 3 and len(steps[0][0]) == T - 1 and all(len(s[0]) == T - start for s in steps[1:])
        for i in (1, start - 1, start + 2, T - 3):
            bias = torch.zeros(1, 1, i + 1, i + 1).masked_fill(torch.ones(i + 1, i + 1).triu(1).bool(), float("-inf"))
            empty = torch.zeros(1, 0, cfg.num_kv_heads, cfg.head_dim)
            out, keys, values = head(f[None, : i + 1], torch.as_tensor(x[1 : i + 2])[None], torch.arange(i + 1)[None],
                                     empty, empty, bias)  # fmt: skip
            h = out[:, -1:]
            for s in range(cfg.ttt_steps):
                if s:
                    if i + s > T - 2:
                        break  # no token x[i+1+s] left in the sequence
                    ids = torch.as_tensor(x[i + 1 + s : i + 2 + s])[None]
                    bias = torch.zeros(1, 1, 1, keys.shape[1] + 1)  # committed slots 0..i and its ancestors
                    h, k, v = head(h, ids, torch.tensor([[i + s]]), keys, values, bias)
                    keys, values = torch.cat([keys, k], 1), torch.cat([values, v], 1)
                if s and i < start - 1:
                    break  # step 0 scores every slot, the deeper steps the answer's
                row = i if s == 0 else i - (start - 1)
                pred, label, valid = steps[s][0][row], steps[s][1][row], steps[s][2][row]
                assert valid and torch.allclose(pred, h[0, -1], atol=1e-5), (i, s)
                assert torch.equal(label, f[i + 1 + s]), (i, s)
        assert not steps[2][2][-1] and steps[1][2][-2]  # rows whose label would lie past the sequence are marked


def test_one_step_is_eagles_loss_and_more_steps_add_to_it():
    head, seq = small_head(1)
    with torch.no_grad():
        one, agree = eagle_loss(head, [seq], 64)
        head.cfg.ttt_steps = 3
        three, agree3 = eagle_loss(head, [seq], 64)
    assert agree == agree3 and float(three) > float(one) > 0


def test_an_eagle_head_trained_with_unrolled_steps_exports_and_decodes_exactly(
    trained, prompts_file, tiny_llama_dir, tmp_path
):
    from specdec_edge import Pipeline
    from specdec_edge.export.exporter import export_bundle
    from specdec_edge.export.train_draft import train_draft
    from tests.speculative.test_methods import assert_greedy_equals_plain

    target = str(trained / "target-bundle")
    folder = train_draft("eagle", target, tmp_path / "w", prompts=prompts_file, **dict(TRAIN, epochs=3), ttt_steps=2)
    config = json.loads((folder / "config.json").read_text())
    assert config["ttt_steps"] == 2 and config["training"]["final_loss"] < config["training"]["first_loss"]
    bundle = export_bundle(str(tiny_llama_dir), tmp_path / "b", capacity=256, heads=(folder,), progress=False)
    plain = Pipeline.load(bundle, method="plain", threads=1)
    assert_greedy_equals_plain(plain, plain.with_method("eagle"))
    with pytest.raises(ExportError, match="--ttt-steps trains EAGLE and EAGLE-3 heads, not medusa"):
        train_draft("medusa", target, tmp_path / "m", prompts=prompts_file, **TRAIN, ttt_steps=2)


def test_answer_top1_counts_the_answers_slots_only():
    """The per-epoch check's answer top-1: the first step's agreement over the slots drafting reads at run time
    (slot i >= answer start - 1), and over every slot where the whole sequence is answer (the loss's figure)."""
    from specdec_edge.export.head_losses import answer_top1

    head, seq = small_head(2)
    T, start = len(seq["ids"]), seq["answer_start"]
    with torch.no_grad():
        pred, f_next, _ = next(eagle_unroll(head, [seq], 64))
        agree = (head.target.logits(pred).argmax(-1) == head.target.logits(f_next).argmax(-1)).numpy()
        assert answer_top1(head, [seq], 64) == (int(agree[start - 1 :].sum()), T - start)
        everything = {**seq, "answer_start": 1}
        hits, slots = answer_top1(head, [everything], 64)
        assert slots == T - 1 and hits / slots == pytest.approx(eagle_loss(head, [everything], 64)[1])
        # a sequence cut to its last 10 tokens keeps its answer's slots, now counted from the cut
        assert answer_top1(head, [seq], 10)[1] == 10 - 1 - (start - (T - 10) - 1)
