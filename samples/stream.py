"""Stream a completion token by token, then print the speed.

python samples/stream.py bundles/smollm2 "Write a haiku about the sea."
"""

import sys

from specdec_edge import Pipeline


def main(bundle: str, prompt: str = "Write a haiku about the sea.") -> None:
    pipe = Pipeline.load(bundle)
    stream = pipe.stream([{"role": "user", "content": prompt}], max_new_tokens=64)
    for piece in stream:
        print(piece, end="", flush=True)
    stats = stream.result.stats
    print(
        f"\n[{stream.result.finish_reason}: {stats.new_tokens} tokens, {stats.tokens_per_s:.1f} tok/s, "
        f"{stats.tokens_per_pass:.2f} tokens per target pass]"
    )


if __name__ == "__main__":
    main(*sys.argv[1:3])
