"""Tokenizers for the models we load: a Hugging Face directory, or the vocabulary in a GGUF file.

For a GGUF file the tokenizer is rebuilt from its metadata as a `tokenizers` byte-level BPE:
`tokenizer.ggml.tokens` (id = position) and `tokenizer.ggml.merges` (rank = position), the
pre-tokenizer llama.cpp uses for the file's `tokenizer.ggml.pre` type, a ByteLevel decoder,
and the control tokens (`token_type` 3, e.g. `<|im_start|>`) added as special tokens so they
are matched whole in text. transformers' own GGUF tokenizer conversion is not used: older
versions got SmolLM2's file wrong (EOS `<|im_start|>`, a SentencePiece-style decoder), and
none applies the digit split of the `smollm` / `starcoder` pre-tokenizer.
"""

from __future__ import annotations

import os
import warnings

from models.config import ConfigError
from models.gguf_loader import GGUFError, gguf_field, open_gguf

# llama.cpp pre-tokenizer types (`tokenizer.ggml.pre`) -> how text is split before BPE.
#  "gpt2": GPT-2's regex (ByteLevel's own).
#  "digits": every digit on its own ("\p{N}"), then GPT-2's regex (llama.cpp's STARCODER group).
#  "llama3": Llama-3's regex.
_PRE_TYPES = {
    None: "gpt2", "default": "gpt2", "gpt2": "gpt2", "mpt": "gpt2", "olmo": "gpt2",
    "jais": "gpt2",
    "smollm": "digits", "starcoder": "digits", "refact": "digits", "command-r": "digits",
    "codeshell": "digits", "exaone": "digits", "minerva-7b": "digits",
    "llama3": "llama3", "llama-v3": "llama3", "llama-bpe": "llama3", "falcon3": "llama3",
    "smaug-bpe": "llama3", "dbrx": "llama3",
}
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

CONTROL = 3  # llama.cpp token type of special (control) tokens
USER_DEFINED = 4


def _pre_tokenizer(pre: str | None, where: str):
    from tokenizers import Regex, pre_tokenizers  # noqa: PLC0415

    kind = _PRE_TYPES.get(pre)
    if kind is None:
        raise ConfigError(f"{where}: pre-tokenizer type {pre!r} is not supported "
                          f"(known: {', '.join(sorted(k for k in _PRE_TYPES if k))})")
    if kind == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if kind == "digits":
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def load_gguf_tokenizer(path: str | os.PathLike):
    """Builds a `transformers.PreTrainedTokenizerFast` from a GGUF file's tokenizer metadata.

    Only byte-level BPE vocabularies (`tokenizer.ggml.model` == "gpt2") are supported. bos /
    eos / unk / pad tokens come from `tokenizer.ggml.*_token_id`, the chat template from
    `tokenizer.chat_template`. When `tokenizer.ggml.add_bos_token` is true, encoding with
    add_special_tokens=True prepends BOS (as llama.cpp does).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors  # noqa: PLC0415
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415


    path, reader = open_gguf(path)
    kind = gguf_field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFError(f"{path}: tokenizer type {kind!r} is not supported (only byte-level BPE, "
                        f"'gpt2'); pass the model's Hugging Face tokenizer directory instead")
    tokens = gguf_field(reader, "tokenizer.ggml.tokens")
    merges = gguf_field(reader, "tokenizer.ggml.merges")
    if not tokens or merges is None:
        raise GGUFError(f"{path}: no tokenizer.ggml.tokens / tokenizer.ggml.merges in the file")
    types = gguf_field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    pairs = []
    for m in merges:
        a, sep, b = m.partition(" ")
        if not sep or not a or not b or " " in b:
            raise GGUFError(f"{path}: malformed merge {m!r} in tokenizer.ggml.merges")
        pairs.append((a, b))
    tk = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    tk.pre_tokenizer = _pre_tokenizer(gguf_field(reader, "tokenizer.ggml.pre"), path)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t, ty in zip(tokens, types) if ty == CONTROL])
    user = [AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types) if ty == USER_DEFINED]
    if user:
        tk.add_tokens(user)

    def token(key: str) -> str | None:
        i = gguf_field(reader, f"tokenizer.ggml.{key}")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    bos = token("bos_token_id")
    if gguf_field(reader, "tokenizer.ggml.add_bos_token", False) and bos is not None:
        tk.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])])
    kw = {name: tok for name, tok in (("bos_token", bos), ("eos_token", token("eos_token_id")),
                                      ("unk_token", token("unknown_token_id")),
                                      ("pad_token", token("padding_token_id"))) if tok}
    template = gguf_field(reader, "tokenizer.chat_template")
    if template:
        kw["chat_template"] = template
    return PreTrainedTokenizerFast(tokenizer_object=tk, clean_up_tokenization_spaces=False, **kw)


def load_tokenizer(path: str | os.PathLike):
    """A tokenizer for `path`: a Hugging Face model/tokenizer directory (loaded with
    `AutoTokenizer`) or a `.gguf` file (rebuilt from its metadata, `load_gguf_tokenizer`)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        from transformers import AutoTokenizer  # noqa: PLC0415
        try:
            with warnings.catch_warnings():
                # AutoTokenizer reads config.json only to find the tokenizer's class; the
                # published looped configs (Ouro's among them) carry "rope_scaling": null, on
                # which transformers warns that the field is deprecated: not the user's concern
                warnings.filterwarnings("ignore", message="`rope_scaling` is deprecated",
                                        category=FutureWarning)
                return AutoTokenizer.from_pretrained(path)
        except Exception as e:  # no tokenizer files, unreadable JSON, ...
            raise ConfigError(f"{path}: cannot load a tokenizer ({type(e).__name__}: {e})"
                              ) from None
    if os.path.isfile(path):
        return load_gguf_tokenizer(path)  # raises GGUFError if it is not a GGUF file
    raise ConfigError(f"{path}: no such tokenizer directory or .gguf file")


def encode_prompt(tok, text: str, chat: bool) -> list[int]:
    """Token ids of a prompt.

    chat: `text` as a single user message through the tokenizer's chat template with
    add_generation_prompt=True (the template renders every special token itself; nothing else
    is added). Otherwise the raw text, with only what the tokenizer adds by default
    (e.g. Llama's BOS; nothing for SmolLM2).
    """
    if chat:
        return encode_messages(tok, [{"role": "user", "content": text}])
    return list(tok.encode(text, add_special_tokens=True))


def encode_messages(tok, messages: list[dict]) -> list[int]:
    """Token ids of a conversation ([{"role": ..., "content": ...}, ...]) through the
    tokenizer's chat template, with the assistant's turn opened (add_generation_prompt)."""
    if not getattr(tok, "chat_template", None):
        raise ConfigError("this tokenizer has no chat template: encode the prompt with "
                          "chat=False")
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tok.encode(rendered, add_special_tokens=False))
