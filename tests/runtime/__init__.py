"""runtime/: the engines (CPU, and the NVIDIA backends' logic without and with a GPU), threads, exactness verdicts,
aarch64."""
