"""`specdec-edge bench`'s work, apart from its command: ``spec_bench`` (speculative methods against plain greedy
decoding per Spec-Bench category) and ``sessions`` (multi-turn sessions, every turn timed), each with its
reports (JSON, Markdown, PNG). Clients of ``Pipeline``; light imports only (matplotlib only to plot).
"""
