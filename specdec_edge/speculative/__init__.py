"""Speculative decoding algorithms in pure numpy: proposers, acceptance, trees, the decode loop."""
