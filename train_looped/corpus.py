"""The tiny looped models' training text, built deterministically from offline sources.

Recipe (`python -m train_looped.corpus`), every source read in sorted path order:

  stdlib   every `.py` file of the running Python's standard library
           (`sysconfig.get_paths()["stdlib"]`), except site-packages, test suites (`test/`,
           `tests/`, `idle_test/`), generated tables (`encodings/`, `pydoc_data/`,
           `_sysconfigdata*`, `config-*`) and files over 400 kB. One document per file.
  pydocs   the reST sources of the Python documentation, `html/_sources/**/*.rst.txt` of the
           Debian package `python3.11-doc` (English prose with code examples), except the
           changelog. Taken from /usr/share/doc when the package is installed, else fetched
           once with `apt-get download` and unpacked with `dpkg-deb -x` into the cache.
           One document per file.
  pyfaq    the Python FAQ pages again, as chat pairs: each question heading becomes a user
           turn and the text under it the assistant turn.
  gsm8k    GSM8K *train* (`../shared/data/gsm8k_train.jsonl`) as chat pairs, with the
           calculator annotations `<<48/2=24>>` removed. GSM8K test, MT-Bench, HumanEval,
           MBPP and ClassEval (the evaluation prompts) are never read.

Held-out split: a document is held out when the first 8 bytes of sha256(its id), as an
integer, modulo 1000 are below `HELDOUT_PER_MILLE`. Ids are source-relative names
(`stdlib/json/decoder.py`, `gsm8k/17`), so the split does not depend on file contents or
on the machine. Output (in `corpus_dir()`): `train.jsonl`, `heldout.jsonl` (one
{"id", "source", "text"} per line, documents in id order) and `manifest.json` (counts,
characters and sha256 of each split).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import re
import subprocess
import sys
import sysconfig
from typing import Iterator

from lookahead_jax.store.model_store import default_cache_dir

HELDOUT_PER_MILLE = 30
DOCS_PACKAGE = "python3.11-doc"
MAX_FILE_BYTES = 400_000
STDLIB_SKIP_DIRS = {"site-packages", "test", "tests", "idle_test", "encodings", "pydoc_data",
                    "__pycache__"}
DOCS_SKIP = {"whatsnew/changelog.rst.txt"}
SOURCES = ("stdlib", "pydocs", "pyfaq", "gsm8k")

# The chat format the tokenizer's template renders (see train_looped.tokenizer).
USER, ASSISTANT = "<|user|>", "<|assistant|>"


@dataclasses.dataclass(frozen=True)
class Document:
    id: str       # source-relative name, e.g. "stdlib/json/decoder.py"
    source: str   # one of SOURCES
    text: str


def corpus_dir() -> pathlib.Path:
    """$LOOKAHEAD_JAX_CACHE/looped_corpus (default ~/.cache/lookahead_jax/looped_corpus)."""
    return default_cache_dir() / "looped_corpus"


def is_heldout(doc_id: str) -> bool:
    """The fixed held-out split: sha256(id)[:8] as an integer, mod 1000, < HELDOUT_PER_MILLE."""
    h = int.from_bytes(hashlib.sha256(doc_id.encode()).digest()[:8], "big")
    return h % 1000 < HELDOUT_PER_MILLE


def chat_text(user: str, assistant: str) -> str:
    """One single-turn chat as training text (BOS/EOS are added at tokenization)."""
    return f"{USER}\n{user.strip()}\n{ASSISTANT}\n{assistant.strip()}"


def stdlib_documents(root: str | os.PathLike | None = None) -> Iterator[Document]:
    """The standard library's `.py` files (tests and generated tables excluded), sorted."""
    root = pathlib.Path(root or sysconfig.get_paths()["stdlib"])
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames
                             if d not in STDLIB_SKIP_DIRS and not d.startswith("config-"))
        for name in filenames:
            if name.endswith(".py") and not name.startswith("_sysconfigdata"):
                paths.append(pathlib.Path(dirpath) / name)
    for path in sorted(paths, key=lambda p: p.relative_to(root).as_posix()):
        if path.stat().st_size > MAX_FILE_BYTES:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if text.strip():
            yield Document(f"stdlib/{path.relative_to(root).as_posix()}", "stdlib", text)


def python_docs_sources(package: str = DOCS_PACKAGE) -> pathlib.Path:
    """The `html/_sources` directory of the Debian Python docs package, fetched if needed."""
    version = package.removeprefix("python").removesuffix("-doc")
    rel = pathlib.Path(f"usr/share/doc/python{version}/html/_sources")
    installed = pathlib.Path("/") / rel
    if installed.is_dir():
        return installed
    unpacked = default_cache_dir() / package
    if (unpacked / rel).is_dir():
        return unpacked / rel
    unpacked.mkdir(parents=True, exist_ok=True)
    print(f"fetching the Debian package {package} into {unpacked}", file=sys.stderr)
    try:
        subprocess.run(["apt-get", "download", package], cwd=unpacked, check=True,
                       capture_output=True)
        debs = sorted(unpacked.glob(f"{package}_*.deb"))
        subprocess.run(["dpkg-deb", "-x", str(debs[-1]), str(unpacked)], check=True)
    except (OSError, subprocess.CalledProcessError, IndexError) as e:
        raise RuntimeError(
            f"cannot get the Python docs ({package}): install it (apt-get install {package}) "
            f"or unpack its .deb into {unpacked} ({type(e).__name__}: {e})") from None
    return unpacked / rel


def pydocs_documents(sources: pathlib.Path) -> Iterator[Document]:
    """The docs' reST sources, one document per page, sorted by path."""
    for path in sorted(sources.rglob("*.rst.txt"), key=lambda p: p.relative_to(sources).as_posix()):
        rel = path.relative_to(sources).as_posix()
        if rel in DOCS_SKIP:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if text.strip():
            yield Document(f"pydocs/{rel}", "pydocs", text)


_HEADING_RULE = re.compile(r"^([-=~^*+#])\1{3,}\s*$")


def faq_pairs(text: str) -> list[tuple[str, str]]:
    """(question, answer) pairs of a FAQ page: headings ending in '?' and the text under them."""
    lines = text.splitlines()
    heads = [i for i in range(len(lines) - 1)
             if lines[i].strip() and _HEADING_RULE.match(lines[i + 1])
             and len(lines[i + 1].rstrip()) >= len(lines[i].rstrip())]
    pairs = []
    for n, i in enumerate(heads):
        end = heads[n + 1] if n + 1 < len(heads) else len(lines)
        question, answer = lines[i].strip(), "\n".join(lines[i + 2:end]).strip()
        if question.endswith("?") and answer:
            pairs.append((question, answer))
    return pairs


def pyfaq_documents(sources: pathlib.Path) -> Iterator[Document]:
    """The FAQ pages' questions and answers as single-turn chats."""
    for path in sorted((sources / "faq").glob("*.rst.txt")):
        text = path.read_text(encoding="utf-8", errors="replace")
        for n, (q, a) in enumerate(faq_pairs(text)):
            yield Document(f"pyfaq/{path.name}#{n}", "pyfaq", chat_text(q, a))


_CALCULATOR = re.compile(r"<<[^<>]*>>")


def gsm8k_documents(path: str | os.PathLike) -> Iterator[Document]:
    """GSM8K train problems as single-turn chats, calculator annotations removed."""
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f):
            if line.strip():
                item = json.loads(line)
                answer = _CALCULATOR.sub("", item["answer"])
                yield Document(f"gsm8k/{n}", "gsm8k", chat_text(item["question"], answer))


def shared_data(name: str = "") -> pathlib.Path:
    """The file `name` of `../shared/data` beside the repository (shared/data/SOURCES.md); the
    folder itself without a name."""
    return pathlib.Path(__file__).resolve().parent.parent.parent / "shared" / "data" / name


def default_gsm8k_train() -> pathlib.Path:
    return shared_data("gsm8k_train.jsonl")


def all_documents(stdlib_root=None, docs_sources=None, gsm8k_train=None) -> list[Document]:
    """Every document of the recipe, sorted by id."""
    docs_sources = pathlib.Path(docs_sources) if docs_sources else python_docs_sources()
    docs = [*stdlib_documents(stdlib_root), *pydocs_documents(docs_sources),
            *pyfaq_documents(docs_sources),
            *gsm8k_documents(gsm8k_train or default_gsm8k_train())]
    return sorted(docs, key=lambda d: d.id)


def split(docs: list[Document]) -> tuple[list[Document], list[Document]]:
    """(train, heldout) by `is_heldout` of each id."""
    train = [d for d in docs if not is_heldout(d.id)]
    heldout = [d for d in docs if is_heldout(d.id)]
    return train, heldout


def write_split(path: pathlib.Path, docs: list[Document]) -> str:
    """Writes one JSON document per line; returns the file's sha256."""
    data = "".join(json.dumps(dataclasses.asdict(d), ensure_ascii=False) + "\n" for d in docs)
    path.write_text(data, encoding="utf-8")
    return hashlib.sha256(data.encode()).hexdigest()


def chat_messages(text: str) -> list[dict]:
    """A single-turn chat text of `chat_text` as messages."""
    user, _, assistant = text.partition(f"\n{ASSISTANT}\n")
    return [{"role": "user", "content": user.removeprefix(USER).strip()},
            {"role": "assistant", "content": assistant.strip()}]


def read_split(path: str | os.PathLike) -> list[Document]:
    with open(path, encoding="utf-8") as f:
        return [Document(**json.loads(line)) for line in f if line.strip()]


def split_documents(split: str) -> list[Document]:
    """The documents of the corpus's `split` ("train" | "heldout"), building the corpus first
    when it is not there."""
    path = corpus_dir() / f"{split}.jsonl"
    if not path.exists():
        build()
    return read_split(path)


def separator_id(tok) -> int:
    """The token between documents in SmolLM2's token streams: <|endoftext|>."""
    return tok.convert_tokens_to_ids("<|endoftext|>")


def build(out_dir: str | os.PathLike | None = None, **sources) -> dict:
    """Builds the corpus into `out_dir` (default `corpus_dir()`); returns the manifest."""
    out = pathlib.Path(out_dir or corpus_dir())
    out.mkdir(parents=True, exist_ok=True)
    train, heldout = split(all_documents(**sources))
    manifest = {"python": sys.version.split()[0], "docs_package": DOCS_PACKAGE,
                "heldout_per_mille": HELDOUT_PER_MILLE}
    for name, docs in (("train", train), ("heldout", heldout)):
        manifest[name] = {
            "sha256": write_split(out / f"{name}.jsonl", docs),
            "documents": {s: sum(d.source == s for d in docs) for s in SOURCES},
            "characters": {s: sum(len(d.text) for d in docs if d.source == s) for s in SOURCES},
        }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def main(argv=None) -> int:
    import argparse  # noqa: PLC0415
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="output directory (default: the cache)")
    p.add_argument("--gsm8k_train", default=None)
    args = p.parse_args(argv)
    manifest = build(args.out, gsm8k_train=args.gsm8k_train)
    print(json.dumps(manifest, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
