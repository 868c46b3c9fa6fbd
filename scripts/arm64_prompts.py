"""The prompts of scripts/arm64_check.sh (32-64 tokens each; read on the host and inside the arm64 root)."""

MAX_NEW_TOKENS = 32  # emulation is slow: short answers

_TINY = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick",
    "Speculative decoding proposes tokens and verifies them in one pass. Summarize the following article.",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return",
    "héllo wörld, naïve café — 日本語のテキスト 🙂🚀 emoji and accents. héllo wörld",
]


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


_REAL = [
    _user("Repeat this list exactly, one item a line: apples, pears, plums, cherries, grapes, lemons, limes, figs."),
    _user("Add type hints to this Python function and keep the rest as it is:\ndef add(a, b):\n    return a + b\n"),
]

PROMPTS = {"tiny": _TINY, "smollm2-gguf": _REAL, "smollm2-fp32-eagle": _REAL}
