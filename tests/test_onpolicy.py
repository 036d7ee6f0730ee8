"""train_looped.onpolicy: the prompts of the on-policy distillation data (no model needed)."""

from __future__ import annotations

import json

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
        assert list(counts) == [k for k, _ in onpolicy.MIXES["base"]]
    assert onpolicy.kind_counts(400) == {"gsm8k": 100, "pyfaq": 40, "asked": 140, "code": 60,
                                         "write": 60}
    with pytest.raises(ValueError, match="at least 5 prompts"):
        onpolicy.kind_counts(4)
    broad = onpolicy.kind_counts(480, "broad")
    assert broad == {"gsm8k": 96, "pyfaq": 24, "asked": 72, "code": 48, "write": 48,
                     "roleplay": 72, "class": 120}
    assert sum(onpolicy.kind_counts(401, "broad").values()) == 401
    assert onpolicy.kind_counts(480, "code") == {"gsm8k": 48, "pyfaq": 24, "asked": 72,
                                                 "code": 72, "write": 144, "roleplay": 48,
                                                 "class": 72}
    assert onpolicy.kind_counts(480, "mbpp") == {"gsm8k": 48, "pyfaq": 24, "asked": 72,
                                                 "code": 48, "write": 48, "mbpp": 120,
                                                 "roleplay": 48, "class": 72}
    with pytest.raises(ValueError, match="at least 7 prompts"):
        onpolicy.kind_counts(6, "broad")
    with pytest.raises(ValueError, match="unknown mix 'wide'"):
        onpolicy.kind_counts(400, "wide")


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


CLASSES = '''"""A module."""

import os
from collections import (
    deque)


class Store(Base):
    """Keeps things."""

    limit = 3

    def __init__(self, path,
                 size=0):
        self.path = path

    def add(self, item):
        """Add item.

        >>> Store("p").add(1)
        """
        self.items.append(item)

    def _hidden(self):
        """Private."""

    @property
    def size(self):
        """Decorated: left out."""
        return 0

    def clear(self):
        """Drop every item."""
        self.items = []

    def no_doc(self):
        return 1


class NoDoc:
    def a(self):
        """A."""

    def b(self):
        """B."""


class OneMethod:
    """Too few methods."""

    def a(self):
        """A."""
'''


def test_class_skeletons_keep_signatures_and_docstrings_without_bodies():
    got = onpolicy.class_skeletons(CLASSES)
    assert [name for name, _ in got] == ["Store"]
    assert got[0][1] == (
        'import os\nfrom collections import (\n    deque)\n\n'
        'class Store(Base):\n    """Keeps things."""\n\n'
        '    def __init__(self, path,\n                 size=0):\n        pass\n\n'
        '    def add(self, item):\n        """Add item.\n\n        >>> Store("p").add(1)\n'
        '        """\n\n\n'
        '    def clear(self):\n        """Drop every item."""\n\n')
    assert onpolicy.class_skeletons(CLASSES, max_methods=1) == []  # one method is too few
    assert onpolicy.class_skeletons(CLASSES, max_chars=100) == []
    assert onpolicy.class_skeletons("def broken(:\n") == []


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
    with_classes = onpolicy.corpus_prompts(
        docs + [Document("stdlib/c.py", "stdlib", CLASSES)], {**counts, "class": 3},
        np.random.default_rng(0))
    assert [(k, chat) for k, _, chat in with_classes[-1:]] == [("class", False)]
    assert with_classes[-1][1] == onpolicy.class_skeletons(CLASSES)[0][1]


def _mbpp_file(path, ids):
    rows = [{"task_id": i, "text": f"Write a function to do task {i}.", "code": "pass",
             "test_list": [f"assert task_{i}(1) == 2", f"assert task_{i}(2) == 3"]} for i in ids]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_mbpp_kind_reads_only_the_train_split_in_the_benchmarks_shape(tmp_path):
    from benchmarks import common
    path = _mbpp_file(tmp_path / "mbpp.jsonl", [3, 11, 80, 510, 600, 601, 700, 974, 975])
    got = onpolicy.mbpp_train_prompts(path, 3, np.random.default_rng(0))
    assert len(set(got)) == 3
    assert {t.split("task ")[1].split(".")[0] for t in got} == {"601", "700", "974"}
    # the benchmarks' prompt of task 11, with the id swapped, is the prompt of train task 601
    bench = common.mbpp_prompts(str(tmp_path), 1)[0]
    assert bench.replace("11", "601") in got
    assert onpolicy.mbpp_train_prompts(path, 3, np.random.default_rng(0)) == got  # by the seed
    with pytest.raises(ValueError, match="4 MBPP train tasks asked for, 3 there"):
        onpolicy.mbpp_train_prompts(path, 4, np.random.default_rng(0))
    with pytest.raises(FileNotFoundError, match="needed by the mbpp kind"):
        onpolicy.mbpp_train_prompts(tmp_path / "none.jsonl", 1, np.random.default_rng(0))
    docs = [Document("stdlib/m.py", "stdlib", SOURCE)]
    counts = {"gsm8k": 0, "pyfaq": 0, "asked": 0, "code": 0, "write": 0, "mbpp": 2}
    items = onpolicy.corpus_prompts(docs, counts, np.random.default_rng(1), mbpp=path)
    assert [(k, chat) for k, _, chat in items] == [("mbpp", True)] * 2
    assert all("Your code should pass these tests:\nassert task_" in t for _, t, _ in items)


class _Asker:
    """An engine stand-in whose model answers every opened user turn with " more words are here"
    and EOS; it records the prompts it was given."""

    tokenizer = _Template()
    eos_ids = (0,)

    def __init__(self):
        self.prompts = []

    def generate_ids(self, prompts, **kwargs):
        self.prompts += prompts
        return type("R", (), {"tokens": [[ord(c) for c in " more words are here"] + [0]
                                         for _ in prompts]})()

    def decode(self, ids):
        return "".join(chr(i) for i in ids if i)


def test_asked_questions_open_the_turn_with_each_opener_in_turn():
    engine = _Asker()
    got = onpolicy.asked_questions(engine, 5, seed=0, batch_size=2, openers=("Act as", "Be"))
    assert got == ["Act as more words are here", "Be more words are here"] * 2 + [
        "Act as more words are here"]
    texts = ["".join(map(chr, p)) for p in engine.prompts]
    assert texts == ["<user>\nAct as", "<user>\nBe"] * 3
    plain = onpolicy.asked_questions(_Asker(), 2, seed=0, batch_size=2)
    assert plain == ["more words are here"] * 2


def test_repeated_ngrams_mark_the_tokens_that_complete_a_seen_ngram():
    from train_looped.onpolicy import repeated_ngrams  # noqa: PLC0415
    ids = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 5]
    assert repeated_ngrams(ids, 3) == [False] * 6 + [True, True, True, True, False]
    assert repeated_ngrams(ids, 1) == [False] * 4 + [True] * 6 + [False]
    assert repeated_ngrams([7, 7, 7, 7], 2) == [False, False, True, True]
    assert not any(repeated_ngrams(list(range(20)), 4))
    assert repeated_ngrams([], 4) == []


def test_periodic_tail_marks_where_the_answer_so_far_ends_in_a_cycle():
    """periodic_tail[j] is benchmarks.degeneracy's cycle rule applied to ids[:j + 1], on
    random token runs (a small vocabulary, so runs occur) and on the loops seen in outputs."""
    from benchmarks.degeneracy import MAX_PERIOD, MIN_CYCLE_TOKENS, ends_in_cycle  # noqa: PLC0415
    from train_looped.onpolicy import CYCLE_PERIOD, CYCLE_TOKENS, periodic_tail  # noqa: PLC0415
    # the twin rules keep the same bounds (training may not import benchmarks)
    assert (CYCLE_PERIOD, CYCLE_TOKENS) == (MAX_PERIOD, MIN_CYCLE_TOKENS)
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, k, size=60).tolist() for k in (1, 2, 3, 5) for _ in range(20)]
    seqs += [[9, 8] + [1, 2, 3] * 10 + [4], [5] * 11 + [6], list(range(40)),
             list(range(7)) + list(range(17)) * 4, []]
    hits = 0
    for ids in seqs:
        got = periodic_tail(ids)
        want = [ends_in_cycle(ids[:j + 1], CYCLE_PERIOD, CYCLE_TOKENS) > 0
                for j in range(len(ids))]
        assert got == want, ids
        hits += sum(got)
    assert hits > 100  # the check saw marks, not only their absence
    # "x () () ()...": marked from the 12th token of the run on, and no longer once it breaks
    ids = [7] + [40, 41] * 10 + [3]
    assert periodic_tail(ids) == [False] * 12 + [True] * 9 + [False]
    assert not any(periodic_tail(list(range(30)) * 1))
    assert periodic_tail([5] * 12) == [False] * 11 + [True]


def test_repeat_marks_add_every_kinds_periodic_runs_when_asked():
    from train_looped.onpolicy import repeat_marks  # noqa: PLC0415
    prompt, code = [5, 6], [3] + [1, 2] * 7  # 1 2 1 2 ...: marked from its 12th token on
    plain = repeat_marks(["code"], [prompt], [code], 4)
    assert not plain.any()
    marks = repeat_marks(["code", "asked"], [prompt] * 2, [code] * 2, 4, cycles=True)
    code_marks = [0, 0] + [0] * 12 + [1] * 3 + [0]
    prose = [0, 0] + [0] * 6 + [1] * 9 + [0]  # (1, 2, 1, 2) seen again at the 7th token
    assert marks.tolist() == code_marks + prose


def test_repeat_marks_follow_the_stream_and_mark_prose_answers_only():
    from train_looped.onpolicy import repeat_marks  # noqa: PLC0415
    prompt, answer = [5, 6], [1, 2, 1, 2, 1]  # 2-grams (1, 2) and (2, 1) seen again at 3 and 4
    marks = repeat_marks(["asked", "code", "roleplay"], [prompt] * 3, [answer] * 3, 2)
    doc = [0, 0] + [0, 0, 0, 1, 1] + [0]  # prompt, answer, separator
    assert marks.dtype == np.uint8
    assert marks.tolist() == doc + [0] * len(doc) + doc


def test_redefinitions_mark_a_function_written_again_under_its_name_or_a_longer_one():
    """The loop of a bare code answer (a function, then the same function again under a longer
    name, to the token limit) is marked from each redefinition's `def` line to the next line at
    column 0; a helper of another name, nested defs and the first definition are not."""
    from train_looped.onpolicy import redefinitions  # noqa: PLC0415
    text = ("def sort_list(xs):\n    return sorted(xs)\n\n"
            "def helper(x):\n    def sort_list(y):\n        return y\n    return x\n\n"
            "def sort_list_of_strings(xs):\n    return sorted(xs)\n\n"
            "print(sort_list([2, 1]))\n"
            "def sort_list(xs):\n    return xs")
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]  # tokens of three characters
    marks = redefinitions(pieces)
    assert len(marks) == len(pieces)
    first = text.index("def sort_list_of_strings")
    stop = text.index("print(")
    last = text.rindex("def sort_list(")
    want = [(a < stop and a + 3 > first) or a + 3 > last for a in range(0, len(text), 3)]
    assert marks == want
    assert any(marks) and not all(marks)
    # no earlier definition of the name, or prose: nothing marked; empty tokens (EOS) are not
    assert not any(redefinitions(["def f(x):\n", "    return x\n", "def g(x):\n", "  pass"]))
    assert not any(redefinitions(["The answer is ", "def", "initely yes.\ndef", "ault"]))
    assert redefinitions(["def f():\n  pass\n", "def f():", "\n  pass", ""]) == [
        False, True, True, False]


def test_repeat_marks_add_every_kinds_redefinitions_given_the_pieces():
    from train_looped.onpolicy import repeat_marks  # noqa: PLC0415
    pieces = ["def f", "(x):\n", "  return x\n", "def f", "2(x):\n", "  return x\n"]
    answer = [11, 12, 13, 11, 14, 13]
    marks = repeat_marks(["code", "asked"], [[5]] * 2, [answer] * 2, 4,
                         answer_pieces=[pieces] * 2)
    assert marks.tolist() == ([0] + [0, 0, 0, 1, 1, 1] + [0]) * 2
    assert not repeat_marks(["code"], [[5]], [answer], 4).any()
    with pytest.raises(ValueError, match="5 pieces for 6 tokens"):
        repeat_marks(["code"], [[5]], [answer], 4, answer_pieces=[pieces[:5]])
