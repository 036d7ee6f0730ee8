"""A small byte-level BPE for the tiny looped models, trained on the corpus' train split.

Special tokens (ids 0-4): `<|bos|>`, `<|eos|>`, `<|user|>`, `<|assistant|>`, `<|pad|>`. Digits are
split one per token (as SmolLM2 does) before GPT-2's byte-level regex. The chat format is

    <|bos|><|user|>\\n{question}\\n<|assistant|>\\n{answer}<|eos|>

which the saved tokenizer's chat template renders, so `lookahead_jax.store.tokenizer.load_tokenizer`
(and `encode_prompt(..., chat=True)`) work on a checkpoint directory. Every corpus document is
tokenized as `<|bos|> text <|eos|>`; the token streams are saved as uint16 `.npy` files.

    python -m train_looped.tokenizer            # corpus (if missing), tokenizer, token arrays
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

import numpy as np

from train_looped import corpus

BOS, EOS, USER, ASSISTANT, PAD = "<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>", "<|pad|>"
SPECIAL_TOKENS = (BOS, EOS, USER, ASSISTANT, PAD)
BOS_ID, EOS_ID = 0, 1
DEFAULT_VOCAB = 4096
CHAT_TEMPLATE = (
    "{{ '<|bos|>' }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}{{ '<|user|>\n' + m['content'] | trim + '\n' }}"
    "{% elif m['role'] == 'assistant' %}{{ '<|assistant|>\n' + m['content'] | trim + '<|eos|>' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}")


def data_dir(vocab_size: int = DEFAULT_VOCAB) -> pathlib.Path:
    """Where the tokenizer and token arrays of one vocabulary size live (in the corpus dir)."""
    return corpus.corpus_dir() / f"bpe{vocab_size}"


def train_bpe(texts, vocab_size: int = DEFAULT_VOCAB):
    """A `tokenizers.Tokenizer` (byte-level BPE, digits split, SPECIAL_TOKENS at ids 0-4)."""
    from tokenizers import (Tokenizer, decoders, models, pre_tokenizers,  # noqa: PLC0415
                            processors, trainers)

    tk = Tokenizer(models.BPE(fuse_unk=False))
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(texts, trainer=trainer)
    tk.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, BOS_ID)])
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tk.token_to_id(t) == i, (t, tk.token_to_id(t))
    return tk


def to_transformers(tk):
    """Wraps a `tokenizers.Tokenizer` as a PreTrainedTokenizerFast with BOS/EOS/PAD and chat."""
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415

    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=BOS, eos_token=EOS,
                                   pad_token=PAD, chat_template=CHAT_TEMPLATE,
                                   clean_up_tokenization_spaces=False)


def save(tk, out_dir: str | os.PathLike) -> None:
    """Writes tokenizer.json, tokenizer_config.json (and chat template) into `out_dir`."""
    to_transformers(tk).save_pretrained(os.fspath(out_dir))


def load_raw(path: str | os.PathLike):
    """The `tokenizers.Tokenizer` of a directory holding tokenizer.json (or the file itself)."""
    from tokenizers import Tokenizer  # noqa: PLC0415

    path = pathlib.Path(path)
    return Tokenizer.from_file(os.fspath(path / "tokenizer.json" if path.is_dir() else path))


def encode_documents(tk, texts) -> np.ndarray:
    """uint16 [N] token stream: `<|bos|> text <|eos|>` for each text, concatenated."""
    texts = list(texts)
    encs = tk.encode_batch(texts, add_special_tokens=False) if texts else []
    parts = [np.asarray([BOS_ID, *e.ids, EOS_ID], np.uint16) for e in encs]
    return np.concatenate(parts) if parts else np.zeros((0,), np.uint16)


def prepare(vocab_size: int = DEFAULT_VOCAB, quiet: bool = False) -> pathlib.Path:
    """Builds what is missing: the corpus, the tokenizer, train.npy and heldout_<source>.npy."""
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, file=sys.stderr))
    cdir = corpus.corpus_dir()
    if not (cdir / "manifest.json").exists():
        say(f"building the corpus in {cdir}")
        corpus.build(cdir)
    out = data_dir(vocab_size)
    out.mkdir(parents=True, exist_ok=True)
    train_docs = None
    if not (out / "tokenizer.json").exists():
        say(f"training a {vocab_size}-token byte-level BPE on {cdir / 'train.jsonl'}")
        train_docs = corpus.read_split(cdir / "train.jsonl")
        save(train_bpe((d.text for d in train_docs), vocab_size), out)
    if not (out / "train.npy").exists():
        tk = load_raw(out)
        train_docs = train_docs or corpus.read_split(cdir / "train.jsonl")
        held = corpus.read_split(cdir / "heldout.jsonl")
        stats = {}
        for source in corpus.SOURCES:
            toks = encode_documents(tk, (d.text for d in held if d.source == source))
            np.save(out / f"heldout_{source}.npy", toks)
            stats[f"heldout_{source}"] = int(toks.size)
        toks = encode_documents(tk, (d.text for d in train_docs))
        stats["train"] = int(toks.size)
        stats["train_chars_per_token"] = round(
            sum(len(d.text) for d in train_docs) / toks.size, 3)
        np.save(out / "train.npy", toks)
        (out / "tokens.json").write_text(json.dumps(stats, indent=1) + "\n")
        say(f"tokens: {stats}")
    return out


def main(argv=None) -> int:
    import argparse  # noqa: PLC0415
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab_size", type=int, default=DEFAULT_VOCAB)
    args = p.parse_args(argv)
    print(prepare(args.vocab_size))
    return 0


if __name__ == "__main__":
    sys.exit(main())
