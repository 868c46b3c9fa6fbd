"""Talk to `specdec-edge serve` with the official OpenAI client (pip install openai).

    specdec-edge serve bundles/smollm2 --method pld          # in another terminal
    python samples/openai_client.py http://127.0.0.1:8000/v1 [API_KEY]

The same code runs against any OpenAI-compatible server (vLLM, llama.cpp, TensorRT-LLM, ...).
"""

import sys

from openai import OpenAI


def main(base_url: str = "http://127.0.0.1:8000/v1", api_key: str = "unused") -> None:
    client = OpenAI(base_url=base_url, api_key=api_key)
    model = client.models.list().data[0].id  # the one model this server serves

    # Streaming chat: the answer arrives as tokens are accepted. temperature=0 is greedy,
    # so the text is exactly what the target model alone would write.
    messages = [{"role": "user", "content": "Write a haiku about caches."}]
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=48, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    for chunk in stream:
        for choice in chunk.choices:
            print(choice.delta.content or "", end="", flush=True)
            if choice.finish_reason:
                stats = chunk.model_extra["specdec_edge"]  # the server's speculative statistics
        if chunk.usage:
            print(f"\n[{chunk.usage.completion_tokens} tokens, {stats['tokens_per_pass']:.2f} per target pass, "
                  f"method {stats['method']}]")  # fmt: skip

    # A plain-text completion with a stop string, not streamed.
    done = client.completions.create(model=model, prompt="Once upon a time", max_tokens=32, stop=["\n\n"], seed=1)
    print(done.choices[0].text, f"[{done.choices[0].finish_reason}]")


if __name__ == "__main__":
    main(*sys.argv[1:3])
