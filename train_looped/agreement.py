"""How well each loop's readout stands in for the full-depth readout, on held-out text:

    python -m train_looped.agreement --ckpt=checkpoints/tiny_ouro --ckpt=checkpoints/tiny_raven

For every depth d = 1..R, over all held-out sources: next-token loss, top-1 accuracy, top-1
agreement of the depth-d readout's argmax with the depth-R (full-depth) argmax, and the mean
KL(p_d || p_{d-1}) of the next-token distribution to the previous depth's (how much loop d
still changes the prediction); and the agreement per source (stdlib code, Python-docs prose,
FAQ chats, GSM8K-train chats). Windows are non-overlapping `seq_len + 1` token slices of each
held-out stream, at most `windows` per source. Prints one Markdown table per model and writes
JSON (`--json_out`, default `<ckpt>/agreement.json`).
"""

from __future__ import annotations

import json
import pathlib
import sys

import numpy as np
from absl import app, flags, logging

FLAGS = flags.FLAGS


def define_flags() -> None:
    if "ckpt" in FLAGS:
        return
    flags.DEFINE_multi_string("ckpt", None, "Exported checkpoint directory (repeatable).")
    flags.DEFINE_integer("seq_len", 512, "Tokens per window.")
    flags.DEFINE_integer("windows", 32, "At most this many windows per held-out source.")
    flags.DEFINE_integer("batch_size", 8, "Windows per forward pass.")
    flags.DEFINE_integer("num_loops", None, "Full depth R to evaluate at (default: trained R).")
    flags.DEFINE_string("json_out", None, "JSON output (default <ckpt>/agreement.json; with "
                        "several --ckpt, one file holding all).")


class LoopStats:
    """Running per-depth sums: cross-entropy, correct top-1, agreement with the last depth,
    KL to the previous depth."""

    def __init__(self, num_loops: int):
        self.ce = np.zeros(num_loops)
        self.correct = np.zeros(num_loops, np.int64)
        self.agree = np.zeros(num_loops, np.int64)
        self.kl_prev = np.zeros(num_loops)
        self.n = 0

    def add(self, ce: np.ndarray, argmax: np.ndarray, labels: np.ndarray,
            kl_prev: np.ndarray) -> None:
        """ce, argmax, kl_prev [R, ...]; labels [...] (same trailing shape)."""
        r = ce.shape[0]
        self.ce += ce.reshape(r, -1).sum(-1)
        self.kl_prev += kl_prev.reshape(r, -1).sum(-1)
        self.correct += (argmax == labels[None]).reshape(r, -1).sum(-1)
        self.agree += (argmax == argmax[-1:]).reshape(r, -1).sum(-1)
        self.n += labels.size

    def merge(self, other: "LoopStats") -> "LoopStats":
        out = LoopStats(len(self.ce))
        for k in ("ce", "correct", "agree", "kl_prev"):
            setattr(out, k, getattr(self, k) + getattr(other, k))
        out.n = self.n + other.n
        return out

    def summary(self) -> dict:
        n = max(self.n, 1)
        return {"tokens": self.n, "loss": (self.ce / n).round(4).tolist(),
                "accuracy": (self.correct / n).round(4).tolist(),
                "agreement": (self.agree / n).round(4).tolist(),
                "kl_prev": (self.kl_prev / n).round(5).tolist()}


def windows(tokens: np.ndarray, seq_len: int, limit: int) -> np.ndarray:
    """[N, seq_len+1] int32 non-overlapping slices from the start of `tokens`, N <= limit."""
    n = min(limit, (tokens.size - 1) // seq_len)
    idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None]
    return tokens[idx].astype(np.int32)


def evaluate(ckpt: str, data_dir: pathlib.Path, seq_len: int, limit: int, batch_size: int,
             num_loops: int | None = None) -> dict:
    """Per-source and overall LoopStats summaries of one exported checkpoint."""
    import jax.numpy as jnp  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415

    from train_looped import export, train  # noqa: PLC0415

    model, cfg = export.load(ckpt, num_loops=num_loops)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    per_source, total = {}, LoopStats(cfg.num_loops)
    for f in sorted(data_dir.glob("heldout_*.npy")):
        source = f.stem.removeprefix("heldout_")
        batch_all = windows(np.load(f), seq_len, limit)
        if not len(batch_all):
            continue
        stats = LoopStats(cfg.num_loops)
        for i in range(0, len(batch_all), batch_size):
            batch = batch_all[i:i + batch_size]
            n = len(batch)  # the last batch is padded to batch_size (one compiled shape)
            padded = np.concatenate([batch, np.repeat(batch[-1:], batch_size - n, axis=0)])
            ce, argmax, kl = train.eval_step(params, rest, jnp.asarray(padded),
                                             graphdef=graphdef)
            stats.add(np.asarray(ce)[:, :n], np.asarray(argmax)[:, :n], batch[:, 1:],
                      np.asarray(kl)[:, :n])
        per_source[source] = stats.summary()
        total = total.merge(stats)
    return {"ckpt": ckpt, "num_loops": cfg.num_loops, "family": cfg.family,
            "seq_len": seq_len, "all": total.summary(), "sources": per_source}


def markdown(result: dict) -> str:
    """One table: a row per depth, overall loss / accuracy / agreement / KL to the previous
    depth, agreement per source."""
    sources = list(result["sources"])
    r = result["num_loops"]
    head = ["depth", "held-out loss", "top-1 acc", f"agree w/ depth {r}", "KL to depth d-1",
            *[f"agree ({s})" for s in sources]]
    lines = [f"{result['ckpt']} ({result['family']}, {result['all']['tokens']:,} held-out tokens, "
             f"windows of {result['seq_len']})", "",
             "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    a = result["all"]
    for d in range(r):
        cells = [str(d + 1), f"{a['loss'][d]:.3f}", f"{100 * a['accuracy'][d]:.1f}%",
                 f"{100 * a['agreement'][d]:.1f}%", "" if d == 0 else f"{a['kl_prev'][d]:.4f}",
                 *[f"{100 * result['sources'][s]['agreement'][d]:.1f}%" for s in sources]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv) -> int:
    del argv
    logging.set_verbosity(logging.WARNING)  # Orbax logs every checkpoint step at INFO
    from train_looped import export, tokenizer  # noqa: PLC0415

    if not FLAGS.ckpt:
        print("error: pass --ckpt=<exported checkpoint directory>", file=sys.stderr)
        return 2
    results = []
    for ckpt in FLAGS.ckpt:
        vocab = export.load_config(ckpt).vocab_size
        data = tokenizer.prepare(vocab)
        result = evaluate(ckpt, data, FLAGS.seq_len, FLAGS.windows, FLAGS.batch_size,
                          FLAGS.num_loops)
        print(markdown(result) + "\n", flush=True)
        results.append(result)
        if FLAGS.json_out is None:
            suffix = "" if FLAGS.num_loops is None else f"_R{FLAGS.num_loops}"
            path = pathlib.Path(ckpt) / f"agreement{suffix}.json"
            path.write_text(json.dumps(result, indent=1) + "\n")
    if FLAGS.json_out is not None:
        pathlib.Path(FLAGS.json_out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


def run() -> None:
    define_flags()
    app.run(main)


if __name__ == "__main__":
    run()
