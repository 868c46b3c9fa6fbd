"""api/: the Python API (Pipeline, streams, sharing, KV reuse, the prompt cache), the samples and the soak run."""
