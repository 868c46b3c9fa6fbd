"""export/: the graph builder, GGUF blocks, quantized and tied weights, heads and their training, bundles on real and
full disks, the default model."""
