"""LAD training data: the frozen looped model's early-loop states and its own full-depth greedy
continuations.

For every prompt (a `prompt_len`-token chunk): the model continues it greedily at full depth
for `continuation` tokens (plain decoding, no EOS stop, so every sequence has the same
length); then one cache-free causal pass over prompt + continuation keeps, at loop
`draft_depth`, every position's state and the argmax of the readout there (the native
proposal for the next token, the drafter's anchor).

Prompts come from train_looped's corpus (its train split; `prompt_source="corpus"`) or are
random token ids (`"random"`: tests and random-weight models). Splits: a document goes to
confirmation, development or training by sha256 of its id (8% / 8% / the rest), and every
prompt that repeats or nearly repeats an evaluation prompt (GSM8K test, HumanEval, MT-Bench:
exact containment, or a fifth of its word 5-grams found in them) is dropped.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import pathlib
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.config import ConfigError
from train_lad.config import LadConfig, check_base_model

SPLITS = ("train", "dev", "confirm")
EVAL_FILES = ("gsm8k_test.jsonl", "HumanEval.jsonl.gz", "mt_bench_question.jsonl")


def split_of(doc_id: str) -> str:
    h = int.from_bytes(hashlib.sha256(doc_id.encode()).digest()[:8], "big") % 100
    return "confirm" if h < 8 else "dev" if h < 16 else "train"


def _words(text: str) -> list[str]:
    return text.lower().split()


def ngrams(words: Sequence[str], n: int = 5) -> set[tuple[str, ...]]:
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def eval_prompts(data_dir: str | os.PathLike) -> list[str]:
    """The evaluation prompts' texts (GSM8K test questions, HumanEval prompts, MT-Bench turns)."""
    d = pathlib.Path(data_dir)
    out: list[str] = []
    for name in EVAL_FILES:
        path = d / name
        if not path.exists():
            continue
        opener = gzip.open if name.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    continue
                obj = json.loads(line)
                out += [t for t in obj.get("turns", []) if isinstance(t, str)]
                for key in ("question", "prompt"):
                    if isinstance(obj.get(key), str):
                        out.append(obj[key])
    return out


class EvalFilter:
    """Drops texts that contain, or nearly repeat, an evaluation prompt."""

    def __init__(self, prompts: Sequence[str], frac: float = 0.2):
        self.texts = [" ".join(_words(p)) for p in prompts if p.strip()]
        self.grams = set().union(*(ngrams(_words(p)) for p in prompts)) if prompts else set()
        self.frac = frac

    def clean(self, text: str) -> bool:
        norm = " ".join(_words(text))
        if any(t and (t in norm or norm in t) for t in self.texts):
            return False
        grams = ngrams(_words(text))
        return not grams or len(grams & self.grams) < self.frac * len(grams)


def corpus_prompts(tokenizer, docs, prompt_len: int, counts: dict[str, int],
                   eval_filter: EvalFilter) -> dict[str, list[list[int]]]:
    """The first `prompt_len` tokens of each clean document long enough, per split, up to
    counts[split]. docs: objects with `id` and `text`, in a fixed order."""
    out = {s: [] for s in SPLITS}
    for doc in docs:
        s = split_of(doc.id)
        if len(out[s]) >= counts.get(s, 0):
            if all(len(out[k]) >= counts.get(k, 0) for k in SPLITS):
                break
            continue
        ids = tokenizer.encode(doc.text, add_special_tokens=False)
        if len(ids) < prompt_len:
            continue
        chunk = ids[:prompt_len]
        if not eval_filter.clean(tokenizer.decode(chunk)):
            continue
        out[s].append(chunk)
    return out


def random_prompts(vocab: int, prompt_len: int, counts: dict[str, int], seed: int
                   ) -> dict[str, list[list[int]]]:
    rng = np.random.default_rng(seed)
    return {s: rng.integers(2, vocab, (counts.get(s, 0), prompt_len)).tolist() for s in SPLITS}


def depth_readout(model, tokens: jax.Array, depth: int) -> tuple[jax.Array, jax.Array]:
    """tokens [B,T] -> states at loop `depth` [B,T,E] and the readout's logits there [B,T,V]
    (cache-free, causal)."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    _, states = model.loop_states(tokens, positions, loops=depth)
    h = states[-1][0]
    logits, _ = model.readout(h, depth, positions)
    return h, logits


def early_states(model, tokens: jax.Array, depth: int) -> tuple[jax.Array, jax.Array]:
    """tokens [B,T] -> states at loop `depth` [B,T,E] and the readout's argmax there [B,T]."""
    h, logits = depth_readout(model, tokens, depth)
    return h, jnp.argmax(logits, axis=-1).astype(jnp.int32)


def teacher_data(model, prompts: list[list[int]], *, continuation: int, draft_depth: int,
                 batch_size: int = 64) -> dict[str, np.ndarray]:
    """Runs the frozen model: full-depth greedy continuations, then early states and native
    proposals. Returns tokens [N,T] int32, states [N,T,E] float16, native [N,T] int32."""
    from lookahead_jax.engine import Engine  # noqa: PLC0415
    engine = Engine(model, eos_ids=())
    graphdef, params = nnx.split(model)
    fn = jax.jit(lambda p, t: early_states(nnx.merge(graphdef, p), t, draft_depth))
    toks, states, native = [], [], []
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i:i + batch_size]
        res = engine.generate_ids(batch, method="ar", max_new_tokens=continuation)
        seqs = np.asarray([p + t for p, t in zip(batch, res.tokens)], np.int32)
        h, nat = fn(params, jnp.asarray(seqs))
        toks.append(seqs)
        states.append(np.asarray(h, np.float16))
        native.append(np.asarray(nat))
    if not toks:
        raise ValueError("no prompts")
    return {"tokens": np.concatenate(toks), "states": np.concatenate(states),
            "native": np.concatenate(native)}


def draft_vocabulary(train_tokens: np.ndarray, prompt_len: int, size: int, vocab: int,
                     always: Sequence[int] = ()) -> np.ndarray:
    """The `size` most frequent tokens of the teacher outputs (continuations of the training
    split), `always` (EOS) included; sorted ids [size'] int32."""
    counts = np.bincount(train_tokens[:, prompt_len:].ravel(), minlength=vocab)
    order = np.argsort(-counts, kind="stable")
    chosen = [int(t) for t in always]
    for t in order:
        if len(chosen) >= size:
            break
        if counts[t] > 0 and int(t) not in chosen:
            chosen.append(int(t))
    return np.asarray(sorted(chosen), np.int32)


def to_draft_ids(vocab_ids: np.ndarray, vocab: int) -> np.ndarray:
    """[vocab] int32: a token's index in the draft vocabulary, -1 outside it."""
    table = np.full((vocab,), -1, np.int32)
    table[vocab_ids] = np.arange(len(vocab_ids), dtype=np.int32)
    return table


# ---- the frozen model and a config's prompts (train_lad.main, train_lad.calibrate) ----

def load_base_model(cfg: LadConfig, ckpt: str | None = None):
    from lookahead_jax.store.checkpoint import load_model_and_tokenizer  # noqa: PLC0415
    from lookahead_jax.store.presets import load_preset  # noqa: PLC0415
    preset = load_preset(cfg.model_preset)
    source = ckpt or cfg.model_ckpt or preset.checkpoint
    if source is not None and source != "random" and not os.path.exists(source):
        raise ConfigError(f"looped-model checkpoint {source} does not exist (train it with "
                          f"train_looped, or pass --ckpt)")
    if source is not None and os.path.isdir(source):
        from models.looped_loader import load_looped_config  # noqa: PLC0415
        check_base_model(cfg, load_looped_config(source), source)
    model, tokenizer, where = load_model_and_tokenizer(preset, source, "float32")
    check_base_model(cfg, model.config, where)
    return model, tokenizer


def split_prompts(cfg: LadConfig, tokenizer) -> dict[str, list[list[int]]]:
    """The config's prompts per split (the same every time)."""
    counts = {"train": cfg.num_train, "dev": cfg.num_dev, "confirm": cfg.num_confirm}
    if cfg.prompt_source == "random" or tokenizer is None:
        return random_prompts(cfg.model_vocab, cfg.prompt_len, counts, cfg.seed)
    from train_looped.corpus import corpus_dir, read_split, shared_data  # noqa: PLC0415
    docs = read_split(corpus_dir() / "train.jsonl")
    filt = EvalFilter(eval_prompts(shared_data()))
    return corpus_prompts(tokenizer, docs, cfg.prompt_len, counts, filt)


def dev_split(cfg: LadConfig, model, tokenizer) -> dict[str, np.ndarray]:
    """The development split's teacher data (tokens, states, native), as training builds it."""
    return teacher_data(model, split_prompts(cfg, tokenizer)["dev"],
                        continuation=cfg.continuation, draft_depth=cfg.draft_depth)
