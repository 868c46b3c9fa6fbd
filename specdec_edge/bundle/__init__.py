"""The on-disk bundle: ``schema`` (the manifest's dataclasses and constants), ``manifest`` (reading and checking
it), ``hashes`` (the files' checksums, checked once per file version), ``write`` (writing output folders safely)
and ``graph_refs`` (the external data files an ONNX graph reads). Light: no onnx, no torch.
"""
