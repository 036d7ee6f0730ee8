"""train_looped.onpolicy: the prompts of the on-policy distillation data (no model needed)."""

from __future__ import annotations

import numpy as np
import pytest

from train_looped import onpolicy
from train_looped.corpus import Document, chat_text

SOURCE = '''"""A module."""

import os


def join_words(words, sep=" "):
    """Join words with sep.

    More detail.
    """
    return sep.join(words)


def _private(x):
    """Hidden."""
    return x


def no_doc(x):
    return x


class Thing:
    def method(self):
        """Not top-level."""


def typed(a: int,
          b: int) -> int:
    """Add a and b."""
    return a + b
'''


def test_kind_counts_add_up():
    for total in (5, 7, 400, 1001):
        counts = onpolicy.kind_counts(total)
        assert sum(counts.values()) == total and min(counts.values()) >= 1
        assert list(counts) == [k for k, _ in onpolicy.KINDS]
    assert onpolicy.kind_counts(400) == {"gsm8k": 100, "pyfaq": 40, "asked": 140, "code": 60,
                                         "write": 60}
    with pytest.raises(ValueError, match="at least 5 prompts"):
        onpolicy.kind_counts(4)


def test_function_headers_are_public_top_level_functions_with_docstrings():
    got = onpolicy.function_headers(SOURCE)
    assert [(name, sig) for name, sig, _ in got] == [
        ("join_words", 'join_words(words, sep=" ")'), ("typed", "typed(a: int, b: int)")]
    header = got[0][2]
    assert header.startswith("def join_words(") and header.endswith('    """\n')
    assert "return" not in header
    assert onpolicy.first_line(header) == "Join words with sep."
    assert onpolicy.first_line(got[1][2]) == "Add a and b."  # a one-line docstring
    assert onpolicy.function_headers(SOURCE, max_doc_chars=15) == [got[1]]


class _Template:
    """A tokenizer stand-in: characters as ids, a ChatML-like template."""

    def apply_chat_template(self, messages, tokenize=False):
        return "".join(f"<{m['role']}>\n{m['content']}</s>\n" for m in messages)

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


def test_question_prefix_opens_the_users_turn():
    assert "".join(map(chr, onpolicy.question_prefix(_Template()))) == "<user>\n"

    class Hidden(_Template):
        def apply_chat_template(self, messages, tokenize=False):
            return "<user>\n"
    with pytest.raises(ValueError, match="does not show the user's message"):
        onpolicy.question_prefix(Hidden())


def test_corpus_prompts_take_each_kind_from_its_source():
    docs = ([Document(f"gsm8k/{i}", "gsm8k", chat_text(f"Question {i}?", f"Answer {i}."))
             for i in range(10)]
            + [Document(f"pyfaq/{i}", "pyfaq", chat_text(f"Faq {i}?", "Yes."))
               for i in range(3)]
            + [Document("stdlib/m.py", "stdlib", SOURCE), Document("pydocs/x", "pydocs", "Prose")])
    counts = {"gsm8k": 4, "pyfaq": 2, "asked": 0, "code": 1, "write": 1}
    got = onpolicy.corpus_prompts(docs, counts, np.random.default_rng(0))
    assert [k for k, _, _ in got] == ["gsm8k"] * 4 + ["pyfaq"] * 2 + ["code", "write"]
    assert len({t for k, t, _ in got if k == "gsm8k"}) == 4
    assert all(t.startswith("Question ") and t.endswith("?") and chat
               for k, t, chat in got if k == "gsm8k")
    code, write = got[-2], got[-1]
    assert not code[2] and code[1].startswith("def ") and write[2]
    assert write[1].startswith("Write a Python function `") and write[1] != code[1]
    again = onpolicy.corpus_prompts(docs, counts, np.random.default_rng(0))
    assert again == got  # fixed by the seed
