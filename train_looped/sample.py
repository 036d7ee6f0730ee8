"""Greedy samples from an exported tiny looped model, by a naive argmax loop over `loop_logits`:

    python -m train_looped.sample --ckpt=checkpoints/tiny_ouro [--depth=1] [--prompt="..."]

No cache: every new token reruns the whole (padded) sequence, so one compiled shape serves the
whole run. --depth reads the next token from that loop's readout (default: full depth).
Without --prompt, three fixed prompts (not from any benchmark set): a chat question, a Python
function header (raw text) and a word problem (chat).
"""

from __future__ import annotations

import sys

import numpy as np
from absl import app, flags, logging

FLAGS = flags.FLAGS

DEFAULT_PROMPTS = (
    ("What is the difference between a list and a tuple in Python?", True),
    ('def count_words(text):\n    """Return a dict mapping each word of text to its count."""\n',
     False),
    ("Tom has 3 boxes with 12 apples in each box. He gives away 10 apples. How many apples "
     "does he have left?", True),
)


def define_flags() -> None:
    if "ckpt" in FLAGS:
        return
    flags.DEFINE_multi_string("ckpt", None, "Exported checkpoint directory (repeatable).")
    flags.DEFINE_multi_string("prompt", None, "Prompt (repeatable; default: three fixed ones).")
    flags.DEFINE_bool("chat", True, "Wrap --prompt in the chat template.")
    flags.DEFINE_integer("depth", None, "Read out at this loop (default: the full depth R).")
    flags.DEFINE_integer("max_new_tokens", 64, "New tokens per prompt.")


def greedy(model, prompt_ids: list[int], max_new_tokens: int, depth: int | None = None,
           eos_ids: tuple[int, ...] = ()) -> list[int]:
    """Greedy continuation of one prompt from the readout at `depth` (1..R; None: R)."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    d = (depth or model.config.num_loops) - 1
    total = len(prompt_ids) + max_new_tokens

    @jax.jit
    def next_token(params, tokens, n):
        m = nnx.merge(graphdef, params, rest)
        positions = jnp.arange(total, dtype=jnp.int32)[None]
        logits, _ = m.loop_logits(tokens, positions)
        return jnp.argmax(logits[d, 0, n - 1])

    buf = np.zeros((1, total), np.int32)
    buf[0, :len(prompt_ids)] = prompt_ids
    out = []
    for n in range(len(prompt_ids), total):
        tok = int(next_token(params, jnp.asarray(buf), n))
        out.append(tok)
        if tok in eos_ids:
            break
        buf[0, n] = tok
    return out


def main(argv) -> int:
    del argv
    logging.set_verbosity(logging.WARNING)  # Orbax logs every checkpoint step at INFO
    from lookahead_jax.store.tokenizer import encode_prompt, load_tokenizer  # noqa: PLC0415
    from train_looped import export  # noqa: PLC0415

    if not FLAGS.ckpt:
        print("error: pass --ckpt=<exported checkpoint directory>", file=sys.stderr)
        return 2
    prompts = [(p, FLAGS.chat) for p in FLAGS.prompt] if FLAGS.prompt else DEFAULT_PROMPTS
    for ckpt in FLAGS.ckpt:
        model, cfg = export.load(ckpt)
        tok = load_tokenizer(ckpt)
        depth = FLAGS.depth or cfg.num_loops
        for text, chat in prompts:
            ids = encode_prompt(tok, text, chat=chat)
            new = greedy(model, ids, FLAGS.max_new_tokens, depth, cfg.eos_token_ids)
            print(f"### {ckpt}, depth {depth}/{cfg.num_loops}, {'chat' if chat else 'raw'}\n")
            print("```\n" + tok.decode(ids, skip_special_tokens=False)
                  + "\u2502" + tok.decode(new, skip_special_tokens=False) + "\n```\n", flush=True)
    return 0


def run() -> None:
    define_flags()
    app.run(main)


if __name__ == "__main__":
    run()
