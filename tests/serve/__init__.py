"""serve/: the OpenAI-compatible server, driven by the official client."""
