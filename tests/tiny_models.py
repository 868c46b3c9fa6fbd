"""Tiny random-weight models and a real trained BPE tokenizer, built from configs (no network)."""

from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Speculative decoding proposes tokens and verifies them in one pass.",
    "héllo wörld, naïve café — 日本語のテキスト 🙂🚀 emoji and accents.",
    "def add(a, b):\n    return a + b\n",
    "Summarize the following article in three sentences.",
]
VOCAB = 320


def make_tokenizer(folder: Path, vocab_size: int = VOCAB, chat_template: bool = True):
    """Train a byte-level BPE on a small corpus and save it as a transformers fast tokenizer
    (with ``CHAT_TEMPLATE``, or none: a base model's tokenizer)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return fast


def make_model(
    folder: Path,
    kind: str = "llama",
    layers: int = 2,
    seed: int = 0,
    vocab_size: int = VOCAB,
    chat_template: bool = True,
    **overrides,
):
    """Save a random-weight causal LM (safetensors + config + tokenizer) into ``folder``.

    Gemma 3 ties its LM head to the embedding (as the real ones do); ``chat_template=False`` makes
    a base model's tokenizer, without a chat template."""
    import torch
    from transformers import (
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    common.update(overrides)
    torch.manual_seed(seed)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif kind == "mistral":
        model = MistralForCausalLM(MistralConfig(**common, sliding_window=None))
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    elif kind == "gemma3":
        types = ["sliding_attention", "full_attention"] * layers
        model = Gemma3ForCausalLM(Gemma3TextConfig(**common, head_dim=16, sliding_window=6, layer_types=types[:layers]))
    else:
        raise ValueError(kind)
    with torch.no_grad():  # larger logits than the default init, so greedy choices are not near-ties
        model.lm_head.weight.mul_(1.0) if model.lm_head.weight is not model.model.embed_tokens.weight else None
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    make_tokenizer(folder, vocab_size, chat_template)
    return folder


# A base model like Gemma-3-270M: Gemma 3 layers (sliding window, tied embeddings), no chat template.
BASE_GEMMA3 = dict(kind="gemma3", layers=2, seed=5, chat_template=False)


# train-draft settings for heads on the tiny models: seconds, yet enough to beat chance.
TRAIN = dict(
    max_prompts=8,
    answer_tokens=24,
    draft_vocab=200,
    epochs=12,
    lr=1e-2,
    batch_tokens=96,
    save_every=2,
    capacity=256,
    threads=1,
    progress=False,
)


# What ``chatty_model`` teaches the tiny model to write in its user turn (tests/conftest.py ``chatty_dir``).
CHAT_REQUESTS = [
    f"{verb} the {noun} in three sentences."
    for verb in ("Summarize", "Explain", "Rewrite", "Describe")
    for noun in ("article", "fox", "dog", "code", "text")
]


def chatty_model(folder, source):
    """A copy of the tiny model at ``source`` taught (a few hundred steps) to write ``CHAT_REQUESTS`` in its user
    turn and answer them: a chat model whose self-written requests are real sentences."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    shutil.copytree(source, folder, dirs_exist_ok=True)
    model, tok = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    chats = [
        tok.apply_chat_template(
            [{"role": "user", "content": r}, {"role": "assistant", "content": "The quick brown fox jumps."}],
            tokenize=False,
        )
        for r in CHAT_REQUESTS
    ]
    batch = tok(chats, return_tensors="pt", padding=True)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(300):
        loss = model(**batch, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval().save_pretrained(folder)
    return folder
