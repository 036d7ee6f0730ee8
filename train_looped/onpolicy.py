"""On-policy chat data for `train_looped.distill`: a student's own greedy answers.

    python -m train_looped.onpolicy --student=checkpoints/smol_loop_r2 --out=/tmp/onpolicy
        [--prompts=400] [--mix=base|broad|code|mbpp] [--batch_size=25] [--seed=0]
        [--max_new_tokens=128] [--repeat_ngram=4] [--mark_cycles] [--mark_redefinitions]

The corpus holds text people wrote; a distilled looped model is judged on its own greedy text,
and a model a few hundredths of a nat behind its teacher can still fall into a loop there that
the teacher would have left (#21's yardstick, `benchmarks.degeneracy`). Distilling on the
student's own outputs puts the teacher's correction where the student's greedy decoding goes
(on-policy distillation, as in GKD). `distill --onpolicy_share` builds this data with the
model it starts from (`--init_from`) and mixes it into every batch.

Prompts (none from a set the benchmarks read; every choice fixed by --seed):
- `gsm8k`: GSM8K *train* questions of the corpus's train split, through the chat template;
- `pyfaq`: the Python FAQ questions of the train split, through the chat template;
- `asked`: questions SmolLM2 itself asks: its chat template's user turn opened and sampled at
  temperature 1 (at most 48 tokens, kept when it ended the turn and has at least 4 words);
- `code`: the header and docstring of a top-level function of the train split's standard
  library files, as raw text (as HumanEval and ClassEval are encoded);
- `write`: "Write a Python function `name(args)`: <the docstring's first line>" as a chat;
- `roleplay` (all mixes but `base`): questions SmolLM2 asks when its user turn is opened with
  one of ROLEPLAY_OPENERS ("Imagine you are", ...), sampled as `asked` ones, the opener kept;
- `class` (all mixes but `base`): a class skeleton of the train split's standard library, raw:
  the module's imports, the class line and docstring, `__init__`'s signature with `pass`, and up to
  CLASS_METHODS public methods' signatures and docstrings without bodies (as ClassEval's);
- `mbpp` (mix `mbpp`): a task of MBPP's *train* split (ids 601-974; the benchmarks read its test
  split) with its asserts, as the benchmarks give MBPP's test tasks, through the chat template.

`--mix` picks the kinds' shares (MIXES): `base`, the first five; `broad`, all but `mbpp`;
`code`, broad's with `write` a third of them; `mbpp`, all eight.

Each prompt's document is the prompt's ids followed by the student's greedy ids (plain
decoding, up to --max_new_tokens, its EOS kept); documents are joined by <|endoftext|>. Writes
`onpolicy.npy` (the int32 stream), `onpolicy_repeats.npy` (uint8, aligned with the stream: 1
where a token of a prose answer, one of PROSE_KINDS, completes an n-gram of --repeat_ngram
tokens that the same answer already holds; `repeated_ngrams`; with --mark_cycles also where
a token of any answer ends a periodic run, `periodic_tail`, and with --mark_redefinitions where
it belongs to a function the answer defines again, `redefinitions`), `onpolicy.jsonl` (every prompt
and answer as text) and `onpolicy.json` (the record: counts per kind, tokens, repeats, seconds,
the student). `distill --unlikelihood_weight` reads the repeats.

Code and worked sums rightly repeat names, numbers and short lines, so their n-gram repeats are
not marked; what marks a loop in them is a run: the same stretch of tokens written three times
in a row (`()()()`, `+ 2 * 2 + 2 * 2 + 2 * 2`, `#### 2000000...`, a two-line function written
over and over). `periodic_tail` marks the tokens where the answer so far ends in one, by the rule
`benchmarks.degeneracy` scores an output's end with (period p <= CYCLE_PERIOD, the last
max(3p, CYCLE_TOKENS) tokens repeating with period p).

A bare code answer (first word `def`, no prose, no fence) has nothing to close, and goes on
past its function by writing it again: `def sort_mixed_list(...)`, then
`def sort_mixed_list_with_list_of_strings(...)` with the same body, and so on to the token
limit. That repeat's period is a whole function, longer than CYCLE_PERIOD, so `periodic_tail`
misses it; `redefinitions` marks it: the tokens of a function defined at column 0 whose name
is, or extends, the name of one the same answer has already defined at column 0.
"""

from __future__ import annotations

import ast
import json
import pathlib
import re
import sys
import time

from absl import app, flags

FLAGS = flags.FLAGS

# shares of the prompts, in this order; `asked` takes the rounding
MIXES = {
    "base": (("gsm8k", 0.25), ("pyfaq", 0.1), ("asked", 0.35), ("code", 0.15), ("write", 0.15)),
    "broad": (("gsm8k", 0.2), ("pyfaq", 0.05), ("asked", 0.15), ("code", 0.1), ("write", 0.1),
              ("roleplay", 0.15), ("class", 0.25)),
    # broad's kinds with code first: a third of the prompts ask for one short function, as
    # MBPP's tasks do
    "code": (("gsm8k", 0.1), ("pyfaq", 0.05), ("asked", 0.15), ("code", 0.15), ("write", 0.3),
             ("roleplay", 0.1), ("class", 0.15)),
    # broad's kinds and a quarter MBPP train tasks, asserts and all
    "mbpp": (("gsm8k", 0.1), ("pyfaq", 0.05), ("asked", 0.15), ("code", 0.1), ("write", 0.1),
             ("mbpp", 0.25), ("roleplay", 0.1), ("class", 0.15)),
}
# MBPP's train split; the benchmarks read its test split (task ids 11-510)
MBPP_TRAIN_IDS = range(601, 975)
ROLEPLAY_OPENERS = ("Imagine you are", "Pretend you are", "Act as", "You are a",
                    "Role-play as", "Write a story in which you are")
CLASS_METHODS = 6
MAX_CLASS_CHARS = 3000
# answers whose repeated n-grams are marked: prose chats, where a repeated n-gram is the start
# of a loop; code and worked sums (`code`, `write`, `class`, `gsm8k`) repeat names and numbers
# as they should, and the FAQ answers hold code
PROSE_KINDS = ("asked", "roleplay")
# a periodic run (`periodic_tail`): period at most CYCLE_PERIOD tokens, at least
# max(3 periods, CYCLE_TOKENS) tokens long, as benchmarks.degeneracy's cycles
CYCLE_PERIOD = 16
CYCLE_TOKENS = 12
QUESTION_TOKENS = 48
MIN_QUESTION_WORDS = 4
PLACEHOLDER = "\x00QUESTION\x00"

_HEADER = re.compile(r'^def (\w+)\(([^)]*)\)( -> [^:\n]+)?:\n( +)"""(.+?)"""\n',
                     re.MULTILINE | re.DOTALL)


def kind_counts(total: int, mix: str = "base") -> dict[str, int]:
    """Prompts per kind for `total` prompts: the mix's shares, the rounding left to `asked`."""
    if mix not in MIXES:
        raise ValueError(f"unknown mix {mix!r}; one of {', '.join(MIXES)}")
    kinds = MIXES[mix]
    if total < len(kinds):
        raise ValueError(f"at least {len(kinds)} prompts (one per kind), got {total}")
    counts = {k: max(1, int(total * share)) for k, share in kinds}
    counts["asked"] += total - sum(counts.values())
    return counts


def function_headers(text: str, max_doc_chars: int = 600) -> list[tuple[str, str, str]]:
    """(name, signature, header with docstring) of the top-level, public functions of a Python
    source whose docstring is at most max_doc_chars long and not empty."""
    out = []
    for m in _HEADER.finditer(text):
        name, args, doc = m.group(1), m.group(2), m.group(5)
        if name.startswith("_") or not doc.strip() or len(doc) > max_doc_chars:
            continue
        out.append((name, f"{name}({' '.join(args.split())})", m.group(0)))
    return out


def first_line(docstring_header: str) -> str:
    """The first non-empty line of the docstring in a header from `function_headers`."""
    doc = docstring_header.split('"""')[1]
    return next((line.strip() for line in doc.splitlines() if line.strip()), "")


def class_skeletons(text: str, max_methods: int = CLASS_METHODS,
                    max_chars: int = MAX_CLASS_CHARS) -> list[tuple[str, str]]:
    """(class name, skeleton) of the top-level classes of a Python source that have a
    docstring and at least two public methods with docstrings: the module's imports, the class
    line and docstring, `__init__`'s signature with `pass`, and the first max_methods such
    methods' signatures and docstrings, bodies left out; skeletons over max_chars are left out.
    A source that does not parse gives none."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines()
    span = lambda a, b: "\n".join(lines[a - 1:b])  # noqa: E731  (1-based, inclusive)
    imports = [span(n.lineno, n.end_lineno) for n in tree.body
               if isinstance(n, (ast.Import, ast.ImportFrom))][:6]
    out = []
    for node in tree.body:
        if not isinstance(node, ast.ClassDef) or node.name.startswith("_"):
            continue
        if not ast.get_docstring(node) or node.decorator_list:
            continue
        funcs = [f for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
        methods = [f for f in funcs if not f.name.startswith("_") and ast.get_docstring(f)
                   and not f.decorator_list][:max_methods]
        if len(methods) < 2:
            continue
        doc = node.body[0]
        parts = ([*imports, ""] if imports else []) + [span(node.lineno, doc.end_lineno), ""]
        init = next((f for f in funcs if f.name == "__init__"), None)
        if init is not None:
            indent = " " * (init.body[0].col_offset)
            parts += [span(init.lineno, init.body[0].lineno - 1), f"{indent}pass", ""]
        for f in methods:
            parts += [span(f.lineno, f.body[0].end_lineno), "", ""]
        skeleton = "\n".join(parts).rstrip() + "\n\n"
        if len(skeleton) <= max_chars:
            out.append((node.name, skeleton))
    return out


def question_prefix(tok) -> list[int]:
    """Ids of the chat template up to where the user's question begins."""
    rendered = tok.apply_chat_template([{"role": "user", "content": PLACEHOLDER}],
                                       tokenize=False)
    if PLACEHOLDER not in rendered:
        raise ValueError("the chat template does not show the user's message")
    return list(tok.encode(rendered.split(PLACEHOLDER)[0], add_special_tokens=False))


def mbpp_train_prompts(path: str | pathlib.Path, n: int, rng) -> list[str]:
    """n tasks of MBPP's train split (MBPP_TRAIN_IDS) in the shape `benchmarks.degeneracy` and
    the suite give its test tasks: the task, "Your code should pass these tests:", the asserts
    one per line."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: MBPP (mbpp.jsonl, shared/data/SOURCES.md) is needed by "
                                f"the mbpp kind")
    tasks = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            obj = json.loads(line) if line.strip() else None
            if isinstance(obj, dict) and obj.get("task_id") in MBPP_TRAIN_IDS:
                tests = "\n".join(str(t) for t in obj["test_list"])
                tasks.append(f"{obj['text']}\nYour code should pass these tests:\n{tests}")
    if len(tasks) < n:
        raise ValueError(f"{path}: {n} MBPP train tasks asked for, {len(tasks)} there")
    return [tasks[i] for i in rng.permutation(len(tasks))[:n]]


def corpus_prompts(docs, counts: dict[str, int], rng,
                   mbpp: str | pathlib.Path | None = None) -> list[tuple[str, str, bool]]:
    """(kind, text, chat) prompts of the corpus documents `docs` (and of MBPP's train split, at
    `mbpp` or shared/data's mbpp.jsonl) for every kind but `asked` and `roleplay`."""
    from train_looped.corpus import chat_messages, shared_data  # noqa: PLC0415
    out = []
    for kind in ("gsm8k", "pyfaq"):
        mine = [d for d in docs if d.source == kind]
        for i in rng.permutation(len(mine))[:counts[kind]]:
            out.append((kind, chat_messages(mine[i].text)[0]["content"], True))
    stdlib = [d for d in docs if d.source == "stdlib"]
    headers = [h for d in stdlib for h in function_headers(d.text)]
    order = rng.permutation(len(headers))
    for i in order[:counts["code"]]:
        out.append(("code", headers[i][2], False))
    for i in order[counts["code"]:counts["code"] + counts["write"]]:
        name_sig, header = headers[i][1], headers[i][2]
        out.append(("write", f"Write a Python function `{name_sig}`: {first_line(header)}",
                    True))
    if counts.get("class"):
        classes = [c for d in stdlib for c in class_skeletons(d.text)]
        for i in rng.permutation(len(classes))[:counts["class"]]:
            out.append(("class", classes[i][1], False))
    if counts.get("mbpp"):
        out += [("mbpp", t, True)
                for t in mbpp_train_prompts(mbpp or shared_data("mbpp.jsonl"), counts["mbpp"], rng)]
    return out


def asked_questions(engine, n: int, seed: int, batch_size: int,
                    openers: tuple[str, ...] = ("",)) -> list[str]:
    """n questions the engine's model asks when its chat template's user turn is opened (with
    the openers in turn, each question starting with its opener), sampled at temperature 1;
    those that end the turn with at least MIN_QUESTION_WORDS words."""
    from lookahead_jax.sampling import Sampling  # noqa: PLC0415
    tok = engine.tokenizer
    prefix = question_prefix(tok)
    starts = [prefix + list(tok.encode(o, add_special_tokens=False)) for o in openers]
    eos = set(engine.eos_ids)
    out, round_ = [], 0
    while len(out) < n:
        if round_ > 20:
            raise RuntimeError(f"only {len(out)} of {n} questions after {round_} rounds")
        which = [(round_ * batch_size + i) % len(openers) for i in range(batch_size)]
        res = engine.generate_ids([starts[w] for w in which], method="ar",
                                  sampling=Sampling(temperature=1.0),
                                  max_new_tokens=QUESTION_TOKENS, seed=seed * 1000 + round_)
        for w, ids in zip(which, res.tokens):
            text = (openers[w] + engine.decode(ids)).strip()
            if ids and ids[-1] in eos and len(text.split()) >= MIN_QUESTION_WORDS:
                out.append(text)
        round_ += 1
    return out[:n]


def repeated_ngrams(ids, n: int) -> list[bool]:
    """Per token of `ids`: whether it completes an n-gram (the n tokens ending there) that
    already ended at an earlier position of `ids`."""
    seen, out = set(), []
    for j in range(len(ids)):
        gram = tuple(ids[j - n + 1:j + 1]) if j >= n - 1 else None
        out.append(gram in seen)
        if gram is not None:
            seen.add(gram)
    return out


def periodic_tail(ids, max_period: int = CYCLE_PERIOD,
                  min_tokens: int = CYCLE_TOKENS) -> list[bool]:
    """Per token j of `ids`: whether ids[:j + 1] ends in a periodic run, that is for some
    period p <= max_period its last max(3p, min_tokens) tokens repeat with period p
    (ids[i] == ids[i - p] over them). One pass: for each p, the count of consecutive positions
    up to j where ids[i] == ids[i - p]."""
    runs = [0] * (max_period + 1)
    out = []
    for j in range(len(ids)):
        hit = False
        for p in range(1, max_period + 1):
            runs[p] = runs[p] + 1 if j >= p and ids[j] == ids[j - p] else 0
            # a tail of L = max(3p, min_tokens) tokens repeats when its last L - p do
            hit = hit or (j + 1 >= max(3 * p, min_tokens)
                          and runs[p] >= max(3 * p, min_tokens) - p)
        out.append(hit)
    return out


_DEF_LINE = re.compile(r"def\s+([A-Za-z_]\w*)")


def redefinitions(pieces) -> list[bool]:
    """Per token of an answer, given each token's decoded text (`pieces`): whether it belongs
    to a redefinition, a function defined at column 0 whose name is, or extends, the name of a
    function the answer has already defined at column 0 (`def f` again, or `def f_list` after
    `def f`). A redefinition runs from the start of its `def` line to the next non-blank line at
    column 0 or the answer's end; a token belongs to it when its text overlaps it."""
    text = "".join(pieces)
    names: list[str] = []
    spans, start, offset = [], None, 0
    for line in text.split("\n"):
        if line[:1] not in ("", " ", "\t"):  # a non-blank line at column 0 ends a function
            if start is not None:
                spans.append((start, offset))
                start = None
            m = _DEF_LINE.match(line)
            if m:
                if any(m.group(1).startswith(name) for name in names):
                    start = offset
                names.append(m.group(1))
        offset += len(line) + 1
    if start is not None:
        spans.append((start, len(text)))
    marks, end = [], 0
    for piece in pieces:
        begin, end = end, end + len(piece)
        marks.append(any(begin < b and end > a for a, b in spans))
    return marks


def repeat_marks(kinds, prompts, answers, n: int, cycles: bool = False, answer_pieces=None):
    """uint8 marks aligned with the stream of documents prompt + answer + separator: 1 at the
    answer tokens of a PROSE_KINDS document that repeat an n-gram of the same answer
    (`repeated_ngrams`), with `cycles` at the answer tokens of any document that end a periodic
    run of the answer (`periodic_tail`), and, given `answer_pieces` (per answer, its tokens'
    decoded texts), at the answer tokens of any document that belong to a redefinition
    (`redefinitions`); 0 elsewhere."""
    import numpy as np  # noqa: PLC0415
    docs = []
    for i, (k, p, a) in enumerate(zip(kinds, prompts, answers)):
        marks = repeated_ngrams(a, n) if k in PROSE_KINDS else [False] * len(a)
        if cycles:
            marks = [m or c for m, c in zip(marks, periodic_tail(a))]
        if answer_pieces is not None:
            if len(answer_pieces[i]) != len(a):
                raise ValueError(f"answer {i}: {len(answer_pieces[i])} pieces for {len(a)} tokens")
            marks = [m or r for m, r in zip(marks, redefinitions(answer_pieces[i]))]
        docs.append(np.asarray([False] * len(p) + marks + [False], np.uint8))
    return np.concatenate(docs)


def build(student: str, out: pathlib.Path, *, prompts: int = 400, mix: str = "base",
          max_new_tokens: int = 128, batch_size: int = 25, seed: int = 0,
          repeat_ngram: int = 4, mark_cycles: bool = False, mark_redefinitions: bool = False,
          log=lambda m: None) -> dict:
    """Writes onpolicy.npy / .jsonl / .json into `out` (see the module doc) -> the record."""
    import numpy as np  # noqa: PLC0415

    from lookahead_jax.engine import Engine  # noqa: PLC0415
    from train_looped import corpus  # noqa: PLC0415

    t0 = time.perf_counter()
    counts = kind_counts(prompts, mix)
    rng = np.random.default_rng(seed)
    items = corpus_prompts(corpus.split_documents("train"), counts, rng)
    teacher = Engine.from_preset("smollm2_135m", dtype="float32")
    items += [("asked", q, True)
              for q in asked_questions(teacher, counts["asked"], seed, batch_size)]
    if counts.get("roleplay"):
        items += [("roleplay", q, True)
                  for q in asked_questions(teacher, counts["roleplay"], seed + 1, batch_size,
                                           ROLEPLAY_OPENERS)]
    log(f"{len(items)} prompts in {time.perf_counter() - t0:.0f} s")
    del teacher
    engine = Engine.from_preset("hf", ckpt=student, dtype="float32")
    encoded = [engine.encode(text, chat=chat) for _, text, chat in items]
    order = sorted(range(len(items)), key=lambda i: len(encoded[i]))  # similar lengths batched
    answers: dict[int, list[int]] = {}
    for b in range(0, len(order), batch_size):
        idx = order[b:b + batch_size]
        res = engine.generate_ids([encoded[i] for i in idx], method="ar",
                                  max_new_tokens=max_new_tokens)
        answers.update(zip(idx, res.tokens))
        log(f"answered {min(b + batch_size, len(order))}/{len(order)}")
    answered = [list(answers[i]) for i in range(len(items))]  # in the prompts' order
    sep = corpus.separator_id(engine.tokenizer)
    stream = np.concatenate([np.asarray(e + a + [sep], np.int32)
                             for e, a in zip(encoded, answered)])
    pieces = [[engine.decode([t]) for t in a] for a in answered] if mark_redefinitions else None
    repeats = repeat_marks([kind for kind, _, _ in items], encoded, answered, repeat_ngram,
                           cycles=mark_cycles, answer_pieces=pieces)
    out.mkdir(parents=True, exist_ok=True)
    np.save(out / "onpolicy.npy", stream)
    np.save(out / "onpolicy_repeats.npy", repeats)
    with open(out / "onpolicy.jsonl", "w") as f:
        for i, (kind, text, chat) in enumerate(items):
            f.write(json.dumps({"kind": kind, "chat": chat, "prompt": text,
                                "answer": engine.decode(answered[i])}) + "\n")
    record = {"student": str(student), "mix": mix, "prompts": counts,
              "max_new_tokens": max_new_tokens,
              "seed": seed, "tokens": int(stream.size),
              "answer_tokens": int(sum(len(a) for a in answered)),
              "repeat_ngram": repeat_ngram, "prose_kinds": list(PROSE_KINDS),
              "cycle_marks": mark_cycles, "redefinition_marks": mark_redefinitions,
              "repeated_tokens": int(repeats.sum()),
              "seconds": round(time.perf_counter() - t0, 1)}
    (out / "onpolicy.json").write_text(json.dumps(record, indent=1))
    return record


def main(argv) -> int:
    del argv
    record = build(FLAGS.student, pathlib.Path(FLAGS.out), prompts=FLAGS.prompts, mix=FLAGS.mix,
                   max_new_tokens=FLAGS.max_new_tokens, batch_size=FLAGS.batch_size,
                   seed=FLAGS.seed, repeat_ngram=FLAGS.repeat_ngram,
                   mark_cycles=FLAGS.mark_cycles, mark_redefinitions=FLAGS.mark_redefinitions,
                   log=lambda m: print(m, file=sys.stderr, flush=True))
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    flags.DEFINE_string("student", None, "Exported looped model directory.", required=True)
    flags.DEFINE_string("out", None, "Output directory.", required=True)
    flags.DEFINE_integer("prompts", 400, "Prompts in all.")
    flags.DEFINE_enum("mix", "base", list(MIXES), "The kinds' shares (MIXES).")
    flags.DEFINE_integer("max_new_tokens", 128, "Longest answer.")
    flags.DEFINE_integer("batch_size", 25, "Prompts decoded together.")
    flags.DEFINE_integer("seed", 0, "Fixes every choice.")
    flags.DEFINE_integer("repeat_ngram", 4, "n of the repeated n-grams marked in prose answers.")
    flags.DEFINE_bool("mark_cycles", False, "Also mark the tokens of any answer that end a "
                      "periodic run (`periodic_tail`).")
    flags.DEFINE_bool("mark_redefinitions", False, "Also mark the tokens of any answer that "
                      "belong to a function it defines again (`redefinitions`).")
    app.run(main)
