"""Openers for self-written requests: the first words of a user's request, which the model then completes.

A small chat model asked to write a request from an empty user turn writes mostly advice and explanations (the
topic spread of ``corpus --report``: 4 in 128 were writing tasks), so heads trained on its answers see little
creative writing, role play, code, translation or arithmetic. With an opener set, each request begins with one of
the openers below, drawn by the request's seed, and the model writes the rest: the same self-written data, spread
over the kinds of task people ask a chat model. The lists are generic task starts written for this project, not
taken from any benchmark (the corpus still drops requests that share half their word 4-grams with Spec-Bench).
"""

from __future__ import annotations

import random

from specdec_edge.errors import ExportError

TASKS = (
    # writing
    "Write a short story about", "Write a poem about", "Write a blog post about", "Write a persuasive essay on",
    "Write a product description for", "Write a speech for", "Write a letter to", "Draft an email to",
    "Write a haiku about", "Rewrite the following paragraph", "Write a dialogue between", "Write a limerick about",
    "Compose a song about", "Write the opening of a novel", "Write a review of", "Write a cover letter for",
    # role play
    "Imagine you are", "Pretend to be", "Act as", "You are a", "Role-play as", "Answer as if you were",
    # reasoning
    "If", "Suppose", "There are", "Which is heavier", "Is it true that", "What comes next in the sequence",
    "Two friends", "A man",
    # arithmetic and math
    "Solve", "Calculate", "Find the", "What is the value of", "Prove that", "How many", "A train", "Simplify",
    # code
    "Write a Python function", "Write a JavaScript function", "Write a SQL query", "Write a C++ program",
    "Fix the bug in this code:", "Explain what this code does:", "Implement", "Write a bash script",
    # extraction
    "Extract", "From the text below,", "List the", "Identify the", "Given the following data,",
    # science and technology
    "Explain how", "What causes", "Describe the process of", "How does", "Why do", "What is the difference between",
    # humanities
    "Discuss", "What were the causes of", "Analyze", "Compare", "What is the significance of", "Evaluate",
    # summaries, translation, questions about a text
    "Summarize the following", "Give a brief summary of", "Translate the following sentence into French:",
    "Translate into Spanish:", "Translate to German:", "How do you say", "Based on the passage below,",
    "Read the text and answer:",
    # questions and requests
    "Who", "When did", "What is", "Where is", "Give me", "Tell me", "Can you", "Help me", "Plan", "Recommend",
)  # fmt: skip

SETS = {"": ("",), "tasks": TASKS}


def check(name: str) -> None:
    """Refuse an unknown opener set by name, listing the known ones."""
    if name not in SETS:
        known = ", ".join(repr(k) for k in SETS)
        raise ExportError(f"unknown opener set {name!r}; use one of {known} ('': the model writes the whole request)")


def opener(name: str, seed: int) -> str:
    """The opener of the request sampled with ``seed`` (the empty string for the set ``''``); the same seed
    gives the same opener on every machine."""
    check(name)
    choices = SETS[name]
    return choices[random.Random(seed).randrange(len(choices))]
