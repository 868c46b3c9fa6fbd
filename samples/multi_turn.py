"""A scripted multi-turn chat: the history goes through the bundle's chat template each turn.

python samples/multi_turn.py bundles/smollm2 [MAX_NEW_TOKENS]
"""

import sys

from specdec_edge import Pipeline

QUESTIONS = ["Name a planet.", "How far is it from the sun?", "Thanks! Summarize our chat in one line."]


def main(bundle: str, max_new_tokens: int = 48) -> None:
    pipe = Pipeline.load(bundle)
    history = [{"role": "system", "content": "You are a concise assistant."}]
    for question in QUESTIONS:
        history.append({"role": "user", "content": question})
        result = pipe.generate(history, max_new_tokens=max_new_tokens, temperature=0.7, top_p=0.9, seed=0)
        history.append({"role": "assistant", "content": result.text})
        print(f"user: {question}\nassistant: {result.text}")
        print(f"  ({result.stats.tokens_per_pass:.2f} tokens per target pass, finish: {result.finish_reason})\n")


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:3]))
