"""A looped model that writes real text: SmolLM2-135M-Instruct with its middle layers replaced by
one shared block run R times, the block trained to reproduce the replaced layers.

    python -m train_looped.distill --out=checkpoints/smol_loop
        [--prelude_layers=12 --replaced_layers=8 --core_layers=2 --num_loops=4 --out_scale=0.25
         --loop_weights=1,1,1,2 --peak_lr=5e-4 --kl_weight=0] [--minutes=60] [--workdir=...]

    # checkpoints/smol_loop_r2: one layer run twice in place of layers 14-15, the KL at both
    python -m train_looped.distill --out=checkpoints/smol_loop_r2 --prelude_layers=14 \
        --replaced_layers=2 --core_layers=1 --num_loops=2 --out_scale=1 --loop_weights=1,1 \
        --kl_weight=1 --kl_every_depth --minutes=45

    # checkpoints/smol_loop_2x2: two layers run twice in place of layers 14-15, the same loss
    # (round 1), then rounds on its own greedy answers (`--init_from=<the round before>
    # --onpolicy_share=0.5`), later ones with the unlikelihood of its repeats
    # (`--unlikelihood_weight=1 --unlikelihood_cycles --unlikelihood_redefinitions`); the
    # shipped block's six commands (rounds 1, 2, 3, 5, 9 and 10) are in checkpoints/README.md
    python -m train_looped.distill --out=/tmp/smol_loop_2x2_round1 --prelude_layers=14 \
        --replaced_layers=2 --core_layers=2 --num_loops=2 --out_scale=0.5 --loop_weights=1,1 \
        --kl_weight=1 --kl_every_depth --minutes=45

The student (`models.recursive`, family "recursive"): SmolLM2's embedding and its first
`prelude_layers` layers (the prelude, frozen), a block of `core_layers` pre-norm Llama layers run
`num_loops` times (the loop, trained), SmolLM2's remaining last layers (the coda, frozen), its
final norm and tied head. The block replaces the `replaced_layers` layers after the prelude;
it starts as a copy of the first `core_layers` of them with their output projections (attention
`o_proj`, MLP `down_proj`) scaled by `out_scale`, so that R loops of it start near one pass of
the copied layers.

Objective (hidden-state distillation, the teacher being SmolLM2 itself): loop r = 1..R should
reproduce the teacher's residual stream after layer prelude_layers + r * replaced_layers / R.
The loss is the sum over loops of `loop_weights[r]` times the mean squared error of the states,
each dimension divided by the teacher's standard deviation of that dimension at that depth
(measured once on the first batch: the residual stream's few very large dimensions would
otherwise be all the loss measures). With --kl_weight > 0 the loss adds that weight times
KL(teacher || student) of the next-token distributions, the last loop's state read out through
the coda against SmolLM2's own output (`output_kl`): the states are a proxy, the output is what
greedy text is made of. With --kl_every_depth, loop r's readout is held to the teacher's
exit after the r-th span of replaced layers (its state there read out through the same coda):
without it, a trained single pass of the block does nearly all the replaced layers' work and
the later loops add little. Only the block is trained, so only the block is shipped
(`models.recursive` rebuilds the rest from the SmolLM2 GGUF it names by sha256). Without the
KL the coda is not run in training, which makes a step cheap (the teacher's first prelude +
replaced layers without gradient, R loops of the block with it); the KL adds the coda's
forward for the teacher and forward and backward for the student, at each depth it reads.

Data: the offline corpus of `train_looped.corpus` (train split only), each source tokenized
with SmolLM2's tokenizer, the chat pairs (GSM8K train, the Python FAQ) through its chat
template, documents joined by <|endoftext|>; a batch draws `seq_len` windows at offsets fixed
by (--seed, step) from the sources in the proportions `mixture`. Held-out: the corpus's held-out
split, evaluated through the coda at every depth (cross-entropy, and top-1 agreement with the
teacher and with the full depth).

On-policy data: --init_from=<an exported model of the same layout> starts the block from that
model's, and --onpolicy_share=S (with it) draws round(S * batch_size) rows of every batch from
that model's own greedy answers to --onpolicy_prompts prompts of no benchmark set, of the kinds
--onpolicy_mix names (`train_looped.onpolicy`, built into the workdir on first use), so the KL
corrects the student where its greedy decoding goes rather than only on text people wrote.
--seed also picks those prompts, so a second round (--init_from the first round's export,
another --seed) answers prompts the first did not.

Unlikelihood: the KL on the student's own answers cannot take a loop away where the teacher,
given the same repeated text, copies it too (in-context copying is what both models do once a
sentence repeats). --unlikelihood_weight=W (with on-policy rows and the KL) adds W times the
unlikelihood loss of Welleck et al. (2019), -log(1 - p(token)), at the tokens of the on-policy
prose answers (`onpolicy.PROSE_KINDS`) that complete an n-gram the same answer already holds
(--unlikelihood_ngram, default 4; marked when the data is built), read out at the last loop and
summed over the on-policy rows' positions divided by their number. --unlikelihood_cycles also
marks the tokens of every on-policy answer, code and sums included, that end a periodic run
(`onpolicy.periodic_tail`: the same stretch of at most 16 tokens written three times in a row);
--unlikelihood_redefinitions also marks the tokens of every on-policy answer that belong to a
function the answer defines again (`onpolicy.redefinitions`: `def f` then `def f_list` with the
same body, the loop of a bare code answer, whose period is a whole function).

Training saves an Orbax checkpoint to --workdir every few minutes and on Ctrl-C; running the
same command again resumes. --steps larger than the workdir's recorded step count extends the
run (a finished one too), its learning-rate schedule becoming the longer run's. The export is
the block's weights (bfloat16), the model config with the base model's name and sha256, and the
training record (`models.recursive.save`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import sys
import time

from absl import app, flags, logging

from train_looped import onpolicy

FLAGS = flags.FLAGS

SOURCES = ("gsm8k", "pydocs", "stdlib", "pyfaq")
CHAT_SOURCES = ("gsm8k", "pyfaq")


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where the block sits in the teacher: after `prelude_layers`, in place of the next
    `replaced_layers`, `core_layers` layers run `num_loops` times."""
    prelude_layers: int
    replaced_layers: int
    core_layers: int
    num_loops: int


@dataclasses.dataclass(frozen=True)
class DistillConfig:
    base: str = "smollm2_135m"         # the teacher's preset (the embedded GGUF)
    prelude_layers: int = 12
    replaced_layers: int = 8           # teacher layers the loop replaces
    core_layers: int = 2
    num_loops: int = 4
    out_scale: float = 0.25            # initial scale of the copied layers' output projections
    loop_weights: tuple[float, ...] = (1.0, 1.0, 1.0, 2.0)
    kl_weight: float = 0.0             # > 0: plus KL(teacher || student) of the full-depth output
    kl_every_depth: bool = False       # the KL at every depth, against the teacher's exit there
    mixture: tuple[float, ...] = (0.35, 0.3, 0.3, 0.05)  # SOURCES' shares of the windows
    tokens_per_source: int = 3_000_000
    seq_len: int = 256
    batch_size: int = 8
    steps: int = 0                     # 0: from minutes, after timing the first steps
    minutes: float = 60.0
    peak_lr: float = 5e-4
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    save_every_minutes: float = 10.0
    eval_rows: int = 24
    init_from: str = ""                # an exported block of the same layout to start from
    onpolicy_share: float = 0.0        # > 0: this share of each batch on-policy
    onpolicy_prompts: int = 400        # its prompts (answered greedily by the init_from model)
    onpolicy_mix: str = "base"         # their kinds' shares (`train_looped.onpolicy.MIXES`)
    unlikelihood_weight: float = 0.0   # > 0: plus unlikelihood of the on-policy prose repeats
    unlikelihood_ngram: int = 4        # n of those repeated n-grams
    unlikelihood_cycles: bool = False  # also every answer's periodic runs
    unlikelihood_redefinitions: bool = False  # also every answer's functions defined again

    def __post_init__(self):
        if self.replaced_layers % self.num_loops:
            raise ValueError(f"replaced_layers ({self.replaced_layers}) must be a multiple of "
                             f"num_loops ({self.num_loops}): loop r stands for replaced_layers "
                             f"/ num_loops of them")
        if len(self.loop_weights) != self.num_loops:
            raise ValueError(f"loop_weights has {len(self.loop_weights)} entries, num_loops is "
                             f"{self.num_loops}")
        if self.kl_weight < 0:
            raise ValueError(f"kl_weight must be >= 0, got {self.kl_weight}")
        if self.kl_every_depth and not self.kl_weight:
            raise ValueError("kl_every_depth needs kl_weight > 0")
        if len(self.mixture) != len(SOURCES) or abs(sum(self.mixture) - 1) > 1e-6:
            raise ValueError(f"mixture: {len(SOURCES)} shares summing to 1 ({SOURCES})")
        if not 0 <= self.onpolicy_share < 1:
            raise ValueError(f"onpolicy_share must be in [0, 1), got {self.onpolicy_share}")
        if self.onpolicy_mix not in onpolicy.MIXES:
            raise ValueError(f"onpolicy_mix must be one of {', '.join(onpolicy.MIXES)}, got "
                             f"{self.onpolicy_mix!r}")
        if self.onpolicy_share and not self.init_from:
            raise ValueError("onpolicy_share needs init_from: the on-policy answers are that "
                             "model's")
        if self.unlikelihood_weight < 0:
            raise ValueError(f"unlikelihood_weight must be >= 0, got {self.unlikelihood_weight}")
        if self.unlikelihood_weight and not (onpolicy_rows(self) and self.kl_weight):
            raise ValueError("unlikelihood_weight needs on-policy rows (onpolicy_share) and the "
                             "last loop's readout (kl_weight > 0)")
        if self.unlikelihood_ngram < 1:
            raise ValueError(f"unlikelihood_ngram must be >= 1, got {self.unlikelihood_ngram}")
        if self.unlikelihood_cycles and not self.unlikelihood_weight:
            raise ValueError("unlikelihood_cycles needs unlikelihood_weight > 0")
        if self.unlikelihood_redefinitions and not self.unlikelihood_weight:
            raise ValueError("unlikelihood_redefinitions needs unlikelihood_weight > 0")

    @property
    def layout(self) -> Layout:
        return Layout(self.prelude_layers, self.replaced_layers, self.core_layers,
                      self.num_loops)

    @property
    def teacher_depths(self) -> list[int]:
        """Teacher layer counts whose output loop r = 0..R stands for."""
        step = self.replaced_layers // self.num_loops
        return [self.prelude_layers + r * step for r in range(self.num_loops + 1)]


# ---- data -----------------------------------------------------------------------------------

def render(tok, doc) -> list[int]:
    """Token ids of one corpus document for SmolLM2: chat pairs through its chat template."""
    from train_looped.corpus import chat_messages  # noqa: PLC0415
    if doc.source in CHAT_SOURCES:
        text = tok.apply_chat_template(chat_messages(doc.text), tokenize=False)
    else:
        text = doc.text
    return list(tok.encode(text, add_special_tokens=False))


def source_tokens(tok, docs, limit: int, eos_id: int):
    """Documents' ids joined by eos_id, stopping once `limit` tokens are collected."""
    import numpy as np  # noqa: PLC0415
    out, n = [], 0
    for d in docs:
        ids = render(tok, d) + [eos_id]
        out.append(np.asarray(ids, np.int32))
        n += len(ids)
        if n >= limit:
            break
    return np.concatenate(out)[:limit]


def prepare_data(tok, split: str, cfg: DistillConfig, cache: pathlib.Path, eos_id: int):
    """{source: int32 token stream} of the corpus split, cached in `cache`."""
    import numpy as np  # noqa: PLC0415
    from train_looped import corpus  # noqa: PLC0415
    cache.mkdir(parents=True, exist_ok=True)
    paths = {s: cache / f"{split}_{s}.npy" for s in SOURCES}
    if not all(p.exists() for p in paths.values()):
        docs = corpus.split_documents(split)
        for s in SOURCES:
            mine = [d for d in docs if d.source == s]
            np.save(paths[s], source_tokens(tok, mine, cfg.tokens_per_source, eos_id))
    return {s: np.load(p) for s, p in paths.items()}


def onpolicy_rows(cfg: DistillConfig) -> int:
    """Rows of each batch drawn from the on-policy stream: onpolicy_share of them, rounded."""
    return int(round(cfg.onpolicy_share * cfg.batch_size))


def windows_at(streams: dict, cfg: DistillConfig, step: int) -> list[tuple[str, int]]:
    """The (source, start) of each row of step's batch, fixed by (seed, step): each row's source
    drawn by `mixture`, the last `onpolicy_rows` rows from streams["onpolicy"]."""
    import numpy as np  # noqa: PLC0415
    rng = np.random.default_rng([cfg.seed, step])
    n_on = onpolicy_rows(cfg)
    picks = [SOURCES[s] for s in rng.choice(len(SOURCES), size=cfg.batch_size - n_on,
                                            p=cfg.mixture)]
    return [(s, int(rng.integers(0, streams[s].size - cfg.seq_len - 1)))
            for s in picks + ["onpolicy"] * n_on]


def corpus_only(cfg: DistillConfig) -> DistillConfig:
    """cfg without its on-policy rows (and what needs them): batches of the corpus alone."""
    return dataclasses.replace(cfg, onpolicy_share=0.0, init_from="", unlikelihood_weight=0.0,
                               unlikelihood_cycles=False, unlikelihood_redefinitions=False)


def batch_at(streams: dict, cfg: DistillConfig, step: int):
    """[B, T+1] int32 windows of step's batch (`windows_at`)."""
    import numpy as np  # noqa: PLC0415
    return np.stack([streams[s][start:start + cfg.seq_len + 1]
                     for s, start in windows_at(streams, cfg, step)]).astype(np.int32)


def repeats_at(streams: dict, cfg: DistillConfig, step: int):
    """[B, T] float32: 1 where the target of a position of step's batch (the window's next
    token) is a marked repeat of streams["onpolicy_repeats"] (`train_looped.onpolicy`); 0 in
    the corpus rows."""
    import numpy as np  # noqa: PLC0415
    rows = [streams["onpolicy_repeats"][start + 1:start + cfg.seq_len + 1] if s == "onpolicy"
            else np.zeros(cfg.seq_len, np.uint8) for s, start in windows_at(streams, cfg, step)]
    return np.stack(rows).astype(np.float32)


def heldout_rows(streams: dict, cfg: DistillConfig):
    """A fixed held-out batch [eval_rows, T+1]: evenly spaced windows of each source."""
    import numpy as np  # noqa: PLC0415
    per = max(1, cfg.eval_rows // len(SOURCES))
    rows = []
    for s in SOURCES:
        toks = streams[s]
        for i in range(per):
            start = (toks.size - cfg.seq_len - 1) * i // per
            rows.append(toks[start:start + cfg.seq_len + 1])
    return np.stack(rows).astype(np.int32)


# ---- the computation ------------------------------------------------------------------------

def _llama_pieces(teacher, tokens):
    import jax.numpy as jnp  # noqa: PLC0415
    from models.layers import causal_mask, rope_cos_sin, rope_inv_freq  # noqa: PLC0415
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    mask = causal_mask(jnp.full((b,), t, jnp.int32), t)
    cos, sin = rope_cos_sin(positions, rope_inv_freq(teacher.config))
    return cos, sin, mask


def run_layers(layers, x, cos, sin, mask):
    from models.layers import dot_product_attention  # noqa: PLC0415
    for layer in layers:
        x, _ = layer(x, cos, sin, mask, None, None, dot_product_attention)
    return x


def teacher_states(teacher, tokens, depths: list[int]):
    """The teacher's residual stream after each of `depths` layers: [len(depths), B, T, E]."""
    import jax.numpy as jnp  # noqa: PLC0415
    cos, sin, mask = _llama_pieces(teacher, tokens)
    x = teacher.embed_tokens(tokens)
    out, done = [], 0
    for d in depths:
        x = run_layers(teacher.layers[done:d], x, cos, sin, mask)
        done = d
        out.append(x)
    return jnp.stack(out)


def student_states(teacher, block, h0, tokens, num_loops: int):
    """The states after loops 1..R of `block` from h0: [R, B, T, E]."""
    import jax.numpy as jnp  # noqa: PLC0415
    cos, sin, mask = _llama_pieces(teacher, tokens)
    out, x = [], h0
    for _ in range(num_loops):
        x = run_layers(block, x, cos, sin, mask)
        out.append(x)
    return jnp.stack(out)


def readout_logits(teacher, coda_from: int, h, tokens):
    """Logits of states h [..., B, T, E] through the teacher's layers coda_from.., norm, head."""
    import jax  # noqa: PLC0415
    cos, sin, mask = _llama_pieces(teacher, tokens)

    def one(x):
        x = run_layers(teacher.layers[coda_from:], x, cos, sin, mask)
        return teacher.embed_tokens.attend(teacher.norm(x)).astype("float32")
    return jax.lax.map(one, h)


def state_loss(student, target, scale, weights):
    """sum_r w_r mean(((s_r - t_r) / scale_r)^2): student, target [R,B,T,E]; scale [R,E]."""
    import jax.numpy as jnp  # noqa: PLC0415
    err = jnp.mean(jnp.square((student - target) / scale[:, None, None, :]), axis=(1, 2, 3))
    return jnp.sum(jnp.asarray(weights) * err), err


def layout_mismatch(config: dict, cfg: DistillConfig) -> list[str]:
    """How an exported model's config.json differs from cfg's layout (empty: the same)."""
    replaced = config.get("base_model", {}).get("layers", {}).get("replaced_by_the_block")
    have = {"prelude_layers": config.get("prelude_layers"),
            "core_layers": config.get("core_layers"), "num_loops": config.get("num_loops"),
            "replaced layers": replaced}
    want = {"prelude_layers": cfg.prelude_layers, "core_layers": cfg.core_layers,
            "num_loops": cfg.num_loops,
            "replaced layers": [cfg.prelude_layers, cfg.prelude_layers + cfg.replaced_layers - 1]}
    return [f"{k} {have[k]} (this run: {want[k]})" for k in want if have[k] != want[k]]


def start_block(cfg: DistillConfig):
    """The Param state (float32) of the block exported in cfg.init_from, whose layout must be
    cfg's."""
    from flax import nnx  # noqa: PLC0415

    from lookahead_jax.store.checkpoint import load_model_and_tokenizer  # noqa: PLC0415
    from lookahead_jax.store.presets import load_preset  # noqa: PLC0415
    path = pathlib.Path(cfg.init_from)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"init_from: no exported model at {path}")
    bad = layout_mismatch(json.loads((path / "config.json").read_text()), cfg)
    if bad:
        raise ValueError(f"init_from {path} has another layout: {'; '.join(bad)}")
    model, _, _ = load_model_and_tokenizer(load_preset("hf"), path, "float32")
    return nnx.state(model.core_block, nnx.Param)


def onpolicy_stream(cfg: DistillConfig, data: pathlib.Path):
    """The on-policy token stream (`train_looped.onpolicy`) of cfg.init_from's model, built into
    `data` on first use, and its repeats mask (None where the data predates it)."""
    import numpy as np  # noqa: PLC0415
    if not (data / "onpolicy.npy").exists():
        onpolicy.build(cfg.init_from, data, prompts=cfg.onpolicy_prompts, mix=cfg.onpolicy_mix,
                       seed=cfg.seed, repeat_ngram=cfg.unlikelihood_ngram,
                       mark_cycles=cfg.unlikelihood_cycles,
                       mark_redefinitions=cfg.unlikelihood_redefinitions,
                       log=lambda m: logging.warning("onpolicy: %s", m))
    record = json.loads((data / "onpolicy.json").read_text())
    repeats = data / "onpolicy_repeats.npy"
    if cfg.unlikelihood_weight and (not repeats.exists()
                                    or record.get("repeat_ngram") != cfg.unlikelihood_ngram
                                    or record.get("cycle_marks", False)
                                    != cfg.unlikelihood_cycles
                                    or record.get("redefinition_marks", False)
                                    != cfg.unlikelihood_redefinitions):
        marks = ([f"repeats of {cfg.unlikelihood_ngram}-grams"]
                 + ["periodic runs"] * cfg.unlikelihood_cycles
                 + ["redefinitions"] * cfg.unlikelihood_redefinitions)
        raise SystemExit(f"{data}: on-policy data without the marks this run asks for "
                         f"({', '.join(marks)}; built before, or with other marks); pass "
                         f"another --workdir")
    return np.load(data / "onpolicy.npy"), (np.load(repeats) if repeats.exists() else None)


def init_block(teacher, cfg: DistillConfig):
    """A copy of the first core_layers replaced layers, output projections * out_scale."""
    import jax.numpy as jnp  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415
    from models.llama import DecoderLayer  # noqa: PLC0415
    block = nnx.List([DecoderLayer(teacher.config, dtype=jnp.float32, rngs=nnx.Rngs(0))
                      for _ in range(cfg.core_layers)])
    src = nnx.List([teacher.layers[cfg.prelude_layers + i] for i in range(cfg.core_layers)])
    nnx.update(block, nnx.state(src, nnx.Param))
    scale_outputs(block, cfg.out_scale)
    return block


def scale_outputs(block, factor: float) -> None:
    """Multiplies, in place, each layer's output projections (attention o_proj, MLP down_proj)
    by factor: what a layer adds to the residual stream scales with them."""
    for layer in block:
        for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
            proj.kernel[...] = proj.kernel[...] * factor


def as_shipped(params):
    """params (float32) rounded through bfloat16, the dtype a block is exported in."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    return jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16).astype(jnp.float32), params)


def output_kl(teacher_logits, student_logits):
    """Mean over positions of KL(teacher || student) of the next-token distributions."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    lt = jax.nn.log_softmax(teacher_logits, axis=-1)
    ls = jax.nn.log_softmax(student_logits, axis=-1)
    return jnp.mean(jnp.sum(jnp.exp(lt) * (lt - ls), axis=-1))


def unlikelihood(logits, targets, mask, denominator: int):
    """sum over positions of mask * -log(1 - p(target)) under logits [B,T,V], divided by
    `denominator`: the unlikelihood loss (Welleck et al., 2019) of the marked targets."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    p = jnp.exp(jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), targets[..., None],
                                    axis=-1)[..., 0])
    return jnp.sum(mask * -jnp.log1p(-jnp.minimum(p, 1 - 1e-6))) / denominator


def make_step(teacher, graphdef, cfg: DistillConfig, scale, tx):
    """The jitted training step (params, opt_state, tokens [B,T], lr[, targets, repeats]) ->
    (params, opt_state, loss, terms): the teacher's states as targets, the block's loops from
    the teacher's prelude output, `state_loss` (terms: its per-loop errors [R]), one optimizer
    update scaled by lr. With kl_weight > 0, plus kl_weight times `output_kl` of the last loop
    read out through the coda against the teacher's output (terms gain it: [R + 1]); with
    kl_every_depth, of every loop r against the teacher's exit after the r-th of the R spans of
    replaced layers, its state then read out through the same coda (the teacher's output at
    r = R; terms [2R]). With unlikelihood_weight > 0, plus that weight times `unlikelihood` of
    the last loop's readout at the marked `repeats` [B,T] of the next tokens `targets` [B,T],
    per position of the on-policy rows (terms gain it last): a repeated n-gram of the student's
    own prose answer made less likely where the teacher's KL alone would keep copying it."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415
    depths = cfg.teacher_depths
    coda_from = depths[-1]
    kl = cfg.kl_weight > 0
    # the depths the KL reads: the teacher's states t [R+1] at depths 1..R (or R), the
    # student's s [R] after loops 1..R (or R)
    t_at, s_at = (slice(1, None), slice(None)) if cfg.kl_every_depth else (slice(-1, None),) * 2

    ul_rows = onpolicy_rows(cfg) * cfg.seq_len

    @jax.jit
    def step_fn(params, opt_state, tokens, lr, targets=None, repeats=None):
        t = teacher_states(teacher, tokens, depths)
        if kl:
            want = jax.lax.stop_gradient(readout_logits(teacher, coda_from, t[t_at], tokens))

        def loss_fn(p):
            s = student_states(teacher, nnx.merge(graphdef, p), t[0], tokens, cfg.num_loops)
            loss, terms = state_loss(s, t[1:], scale, cfg.loop_weights)
            if kl:
                got = readout_logits(teacher, coda_from, s[s_at], tokens)
                div = jax.vmap(output_kl)(want, got)
                loss, terms = loss + cfg.kl_weight * div.sum(), jnp.concatenate([terms, div])
            if cfg.unlikelihood_weight:
                ul = unlikelihood(got[-1], targets, repeats, ul_rows)
                loss = loss + cfg.unlikelihood_weight * ul
                terms = jnp.concatenate([terms, ul[None]])
            return loss, terms

        (loss, per_loop), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = jax.tree.map(lambda p, u: p - lr * u, params, updates)
        return params, opt_state, loss, per_loop

    return step_fn


def train(cfg: DistillConfig, workdir: pathlib.Path, *, progress: bool = True,
          max_steps_this_run: int | None = None):
    """Trains the block (resuming from workdir) -> (state, block graphdef, teacher, eval)."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415

    from lookahead_jax.store.checkpoint import load_model_and_tokenizer  # noqa: PLC0415
    from lookahead_jax.store.presets import load_preset  # noqa: PLC0415
    from train_looped.train import (Checkpoints, TrainConfig, TrainState,  # noqa: PLC0415
                                    lr_at, make_optimizer, planned_total)

    teacher, tok, _ = load_model_and_tokenizer(load_preset(cfg.base))
    from train_looped.corpus import separator_id  # noqa: PLC0415
    eos = separator_id(tok)
    train_streams = prepare_data(tok, "train", cfg, workdir / "data", eos)
    held = heldout_rows(prepare_data(tok, "heldout", cfg, workdir / "data", eos), cfg)
    opt_cfg = TrainConfig(seq_len=cfg.seq_len, batch_size=cfg.batch_size, steps=cfg.steps,
                          minutes=cfg.minutes, peak_lr=cfg.peak_lr, warmup_steps=cfg.warmup_steps,
                          min_lr_ratio=cfg.min_lr_ratio, weight_decay=cfg.weight_decay,
                          grad_clip=cfg.grad_clip, seed=cfg.seed)
    tx = make_optimizer(opt_cfg)
    if cfg.onpolicy_share:
        train_streams["onpolicy"], train_streams["onpolicy_repeats"] = onpolicy_stream(
            cfg, workdir / "data")
    block = init_block(teacher, cfg)
    if cfg.init_from:
        nnx.update(block, start_block(cfg))
    graphdef, params = nnx.split(block, nnx.Param)
    depths = cfg.teacher_depths

    @jax.jit
    def targets(tokens):
        return teacher_states(teacher, tokens, depths)

    scale_file = workdir / "state_scale.npy"
    if not scale_file.exists():  # from the corpus alone: a run --init_from another keeps its scale
        t = targets(jnp.asarray(batch_at(train_streams, corpus_only(cfg), 0)[:, :-1]))
        np.save(scale_file, np.asarray(jnp.std(t[1:], axis=(1, 2)) + 1e-3))
    scale = jnp.asarray(np.load(scale_file))

    step_fn = make_step(teacher, graphdef, cfg, scale, tx)

    state = TrainState(params, tx.init(params))
    ckpts = Checkpoints(workdir / "orbax")
    restored = ckpts.latest(state)
    if restored is not None:
        state = restored
    total = planned_total(state.total_steps, cfg.steps)
    evaluate = functools.partial(evaluate_block, teacher, graphdef, cfg.layout)
    log = open(workdir / "metrics.jsonl", "a")
    bar = None
    if progress:
        from tqdm import tqdm  # noqa: PLC0415
        bar = tqdm(total=total or None, initial=state.step, unit="step", dynamic_ncols=True)
    timed, ran, last_save = [], 0, time.perf_counter()

    def save():
        nonlocal last_save
        record = {"step": state.step, "event": "save", "elapsed_s": round(state.elapsed_s, 1),
                  **evaluate(state.params, held)}
        ckpts.save(state)
        log.write(json.dumps(record) + "\n")
        log.flush()
        last_save = time.perf_counter()
        return record

    try:
        if state.step == 0:
            init = evaluate(state.params, held)
            log.write(json.dumps({"step": 0, "event": "init", **init}) + "\n")
            log.flush()
        while total == 0 or state.step < total:
            window = batch_at(train_streams, cfg, state.step)
            tokens = jnp.asarray(window[:, :-1])
            extra = ((jnp.asarray(window[:, 1:]),
                      jnp.asarray(repeats_at(train_streams, cfg, state.step)))
                     if cfg.unlikelihood_weight else ())
            lr = lr_at(state.step, total or cfg.warmup_steps + 1, opt_cfg)
            t0 = time.perf_counter()
            params, opt_state, loss, per_loop = step_fn(state.params, state.opt_state, tokens,
                                                        jnp.float32(lr), *extra)
            loss, per_loop = float(loss), np.asarray(per_loop)
            ul = per_loop[-1:] if cfg.unlikelihood_weight else per_loop[:0]
            per_loop, kl = (per_loop[:cfg.num_loops],
                            per_loop[cfg.num_loops:per_loop.size - ul.size])  # KL: 0, 1 or R
            dt = time.perf_counter() - t0
            if not np.isfinite(loss):
                raise FloatingPointError(f"loss is {loss} at step {state.step}")
            state = dataclasses.replace(state, params=params, opt_state=opt_state,
                                        step=state.step + 1, elapsed_s=state.elapsed_s + dt,
                                        tokens_seen=state.tokens_seen + tokens.size)
            ran += 1
            if ran > 1:
                timed.append(dt)
            if total == 0 and len(timed) >= 3:
                total = max(state.step + 1, int(cfg.minutes * 60 / float(np.median(timed))))
                if bar is not None:
                    bar.total = total
                    bar.refresh()
            state = dataclasses.replace(state, total_steps=total)
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(f"loss {loss:.3f} | per loop "
                                    + " ".join(f"{x:.2f}" for x in per_loop)
                                    + (" | kl " if kl.size else "")
                                    + " ".join(f"{x:.3f}" for x in kl)
                                    + "".join(f" | ul {x:.3f}" for x in ul)
                                    + f" | {tokens.size / dt:.0f} tok/s", refresh=False)
            if state.step % 10 == 0:
                log.write(json.dumps({
                    "step": state.step, "lr": round(lr, 7), "loss": round(loss, 4),
                    "per_loop": per_loop.astype(float).round(4).tolist(),
                    **({"kl": kl.astype(float).round(4).tolist()} if kl.size else {}),
                    **({"unlikelihood": round(float(ul[0]), 4)} if ul.size else {}),
                    "tok_s": round(tokens.size / dt)}) + "\n")
                log.flush()
            if time.perf_counter() - last_save > cfg.save_every_minutes * 60:
                save()
            if max_steps_this_run is not None and ran >= max_steps_this_run:
                break
        final = save() if ran else None
    except KeyboardInterrupt:
        save()
        raise
    finally:
        if bar is not None:
            bar.close()
        log.close()
        ckpts.close()
    return state, final, tok


def evaluate_block(teacher, graphdef, cfg: Layout, params, rows) -> dict:
    """Held-out figures of the block `params` on rows [N, T+1]: per-depth cross-entropy, top-1
    agreement with the teacher and with the full depth, and the teacher's own cross-entropy."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415

    coda_from = cfg.prelude_layers + cfg.replaced_layers

    @jax.jit
    def one(params, row):
        tokens, labels = row[None, :-1], row[None, 1:]
        t = teacher_states(teacher, tokens, [cfg.prelude_layers, coda_from])
        s = student_states(teacher, nnx.merge(graphdef, params), t[0], tokens, cfg.num_loops)
        logits = readout_logits(teacher, coda_from, jnp.concatenate([s, t[1:]]), tokens)
        lp = jax.nn.log_softmax(logits, axis=-1)
        ce = -jnp.take_along_axis(lp, labels[None, ..., None], axis=-1)[..., 0]  # [R+1,1,T]
        top = jnp.argmax(logits, axis=-1)
        return (jnp.mean(ce, axis=(1, 2)), jnp.mean(top[:-1] == top[-1], axis=(1, 2)),
                jnp.mean(top[:-1] == top[-2], axis=(1, 2)))

    ce, agree_teacher, agree_full = (np.mean(np.stack(x), axis=0, dtype=np.float64)
                                     for x in zip(*(one(params, jnp.asarray(r)) for r in rows)))
    return {"heldout_loop_ce": ce[:-1].round(4).tolist(), "teacher_ce": round(float(ce[-1]), 4),
            "agree_teacher": agree_teacher.round(4).tolist(),
            "agree_full_depth": agree_full.round(4).tolist()}


# ---- the command ----------------------------------------------------------------------------

def define_flags() -> None:
    if "workdir" in FLAGS:
        return
    flags.DEFINE_string("out", "checkpoints/smol_loop", "Export directory.")
    flags.DEFINE_string("workdir", None, "Orbax checkpoints, token caches and metrics.jsonl "
                        "(default $LOOKAHEAD_JAX_CACHE/distill/smol_loop).")
    flags.DEFINE_integer("steps", None, "Optimizer steps (default: from --minutes; more than a "
                         "workdir recorded: extends its run).")
    flags.DEFINE_float("minutes", None, "Wall-clock training budget (default 60).")
    flags.DEFINE_integer("batch_size", None, "Windows per step (default 8).")
    flags.DEFINE_integer("prelude_layers", None, "Teacher layers kept before the loop "
                         "(default 12).")
    flags.DEFINE_integer("replaced_layers", None, "Teacher layers the loop replaces (default 8).")
    flags.DEFINE_integer("core_layers", None, "Layers in the looped block (default 2).")
    flags.DEFINE_integer("num_loops", None, "Loops R (default 4).")
    flags.DEFINE_float("out_scale", None, "Initial scale of the copied output projections "
                       "(default 0.25).")
    flags.DEFINE_list("loop_weights", None, "Per-loop loss weights (default 1,1,1,2).")
    flags.DEFINE_float("peak_lr", None, "Peak learning rate (default 5e-4).")
    flags.DEFINE_bool("kl_every_depth", None, "The KL at every loop, against the teacher's exit "
                      "after the same share of the replaced layers (default: the last loop).")
    flags.DEFINE_float("kl_weight", None, "Weight of KL(teacher || student) of the last loop's "
                       "output through the coda (default 0: hidden states only).")
    flags.DEFINE_string("init_from", None, "An exported model of the same layout whose block "
                        "the run starts from (default: a copy of the replaced layers).")
    flags.DEFINE_float("onpolicy_share", None, "Share of each batch from the --init_from "
                       "model's own greedy answers (`train_looped.onpolicy`; default 0).")
    flags.DEFINE_integer("onpolicy_prompts", None, "Prompts of the on-policy data (default 400).")
    flags.DEFINE_string("onpolicy_mix", None, "Kinds of those prompts: base (default), broad "
                        "(adds role-play questions and class skeletons), code (broad's kinds, "
                        "a third of them short functions) or mbpp (broad's and MBPP train "
                        "tasks; `train_looped.onpolicy.MIXES`).")
    flags.DEFINE_float("unlikelihood_weight", None, "Weight of the unlikelihood of the repeated "
                       "n-grams of the on-policy prose answers, read out at the last loop "
                       "(default 0).")
    flags.DEFINE_integer("unlikelihood_ngram", None, "n of those n-grams (default 4).")
    flags.DEFINE_bool("unlikelihood_cycles", None, "Also the unlikelihood of the tokens of every "
                      "on-policy answer, code and sums too, that end a periodic run (default "
                      "off).")
    flags.DEFINE_bool("unlikelihood_redefinitions", None, "Also the unlikelihood of the tokens "
                      "of every on-policy answer that belong to a function it defines again "
                      "(default off).")
    flags.DEFINE_integer("seed", None, "Fixes the batches' windows and the on-policy prompts "
                         "(default 0).")
    flags.DEFINE_integer("max_steps_this_run", None, "Stop after this many steps (resumable).")
    flags.DEFINE_bool("progress", True, "Show a progress bar.")


FLAG_FIELDS = ("steps", "minutes", "batch_size", "prelude_layers", "replaced_layers",
               "core_layers", "num_loops", "out_scale", "loop_weights", "peak_lr", "kl_weight",
               "kl_every_depth", "init_from", "onpolicy_share", "onpolicy_prompts",
               "onpolicy_mix", "unlikelihood_weight", "unlikelihood_ngram",
               "unlikelihood_cycles", "unlikelihood_redefinitions", "seed")


def config_from_flags(values: dict) -> DistillConfig:
    """The DistillConfig of the command's flags (None: the default); a bad combination exits
    with the reason."""
    overrides = {k: v for k, v in values.items() if v is not None}
    if "loop_weights" in overrides:
        overrides["loop_weights"] = tuple(float(w) for w in overrides["loop_weights"])
    try:
        return DistillConfig(**overrides)
    except (ValueError, TypeError) as e:
        raise SystemExit(f"distill: {e}") from None


def changed_settings(old: dict, cfg: DistillConfig) -> list[str]:
    """The settings in which cfg differs from a workdir's recorded config `old` (its run.json),
    the time budget aside; a setting that `old` predates counts as its default."""
    as_json = lambda c: json.loads(json.dumps(dataclasses.asdict(c)))  # noqa: E731
    mine, default = as_json(cfg), as_json(DistillConfig())
    return [k for k in mine
            if k not in ("steps", "minutes") and old.get(k, default[k]) != mine[k]]


def main(argv) -> int:
    del argv
    logging.set_verbosity(logging.WARNING)
    from lookahead_jax.store.model_store import default_cache_dir  # noqa: PLC0415
    cfg = config_from_flags({k: getattr(FLAGS, k) for k in FLAG_FIELDS})
    out_name = pathlib.Path(FLAGS.out).name
    workdir = pathlib.Path(FLAGS.workdir or default_cache_dir() / "distill" / out_name)
    workdir.mkdir(parents=True, exist_ok=True)
    run_file = workdir / "run.json"
    if run_file.exists():
        changed = changed_settings(json.loads(run_file.read_text())["config"], cfg)
        if changed:
            raise SystemExit(f"{workdir} was trained with other settings ({', '.join(changed)});"
                             f" pass another --workdir")
    run_file.write_text(json.dumps({"config": dataclasses.asdict(cfg), "argv": sys.argv}, indent=1))
    state, final, _ = train(cfg, workdir, progress=FLAGS.progress,
                            max_steps_this_run=FLAGS.max_steps_this_run)
    if final is not None:
        print(json.dumps(final), file=sys.stderr)
    if state.step < state.total_steps:
        print(f"stopped at step {state.step} of {state.total_steps}; run the same command again "
              f"to resume", file=sys.stderr)
        return 0
    out = export(cfg, state, workdir, pathlib.Path(FLAGS.out))
    print(f"exported {out} ({sum(f.stat().st_size for f in out.iterdir()) / 1e6:.1f} MB) after "
          f"{state.step} steps, {state.tokens_seen:,} tokens, {state.elapsed_s / 60:.1f} min",
          file=sys.stderr)
    return 0


def model_config(cfg: Layout, teacher_cfg):
    """The recursive model's LoopedConfig: the teacher's shape, cfg's stages."""
    from models.config import LoopedConfig  # noqa: PLC0415
    t = teacher_cfg
    return LoopedConfig(
        family="recursive", vocab_size=t.vocab_size, hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size, num_heads=t.num_heads,
        num_kv_heads=t.num_kv_heads, head_dim=t.head_dim, prelude_layers=cfg.prelude_layers,
        core_layers=cfg.core_layers,
        coda_layers=t.num_layers - cfg.prelude_layers - cfg.replaced_layers,
        num_loops=cfg.num_loops, rope_theta=t.rope_theta,
        rms_norm_eps=float(f"{t.rms_norm_eps:.6g}"),
        tie_word_embeddings=t.tie_word_embeddings,
        max_position_embeddings=t.max_position_embeddings, bos_token_id=t.bos_token_id,
        eos_token_ids=t.eos_token_ids)


def export(cfg: DistillConfig, state, workdir: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    """Writes the block (bfloat16) over the base GGUF, the training record with the held-out
    table of the shipped (bfloat16-rounded) block, and the training log. No tokenizer files:
    the loader takes SmolLM2's tokenizer from the base GGUF
    (`lookahead_jax.store.checkpoint.load_model_and_tokenizer`)."""
    import shutil  # noqa: PLC0415

    import ml_dtypes  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415

    from lookahead_jax.store.checkpoint import load_model_and_tokenizer  # noqa: PLC0415
    from lookahead_jax.store.model_store import smollm2_gguf  # noqa: PLC0415
    from lookahead_jax.store.presets import load_preset  # noqa: PLC0415
    from models.looped_loader import file_sha256, save_hf_looped  # noqa: PLC0415
    from models.recursive import from_llama  # noqa: PLC0415
    from train_looped import corpus  # noqa: PLC0415

    teacher, tok, _ = load_model_and_tokenizer(load_preset(cfg.base))
    rounded = as_shipped(state.params)
    block = init_block(teacher, cfg)
    graphdef, _ = nnx.split(block, nnx.Param)
    from train_looped.corpus import separator_id  # noqa: PLC0415
    held = heldout_rows(prepare_data(tok, "heldout", cfg, workdir / "data", separator_id(tok)),
                        cfg)
    table = evaluate_block(teacher, graphdef, cfg.layout, rounded, held)
    model = from_llama(teacher, model_config(cfg.layout, teacher.config))
    nnx.update(model.core_block, rounded)
    gguf = smollm2_gguf()
    manifest = json.loads((corpus.corpus_dir() / "manifest.json").read_text())
    training = {
        "recipe": "python -m train_looped.distill", "config": dataclasses.asdict(cfg),
        "steps": state.step, "tokens_seen": state.tokens_seen,
        "train_seconds": round(state.elapsed_s, 1),
        "corpus_sha256": {"train": manifest["train"]["sha256"],
                          "heldout": manifest["heldout"]["sha256"]},
        "heldout": table,
    }
    if cfg.init_from:  # where the run started: that model's own training record
        start = json.loads((pathlib.Path(cfg.init_from) / "config.json").read_text())
        training["init_from_training"] = {k: start.get("training", {}).get(k) for k in
                                          ("recipe", "config", "steps", "tokens_seen",
                                           "train_seconds", "heldout")}
    if cfg.onpolicy_share:
        training["onpolicy"] = json.loads((workdir / "data" / "onpolicy.json").read_text())
    base = {"name": "SmolLM2-135M-Instruct", "store": "smollm2", "file": gguf.name,
            "sha256": file_sha256(gguf),
            "layers": {"prelude": [0, cfg.prelude_layers - 1],
                       "coda": [cfg.prelude_layers + cfg.replaced_layers,
                                teacher.config.num_layers - 1],
                       "replaced_by_the_block": [cfg.prelude_layers,
                                                 cfg.prelude_layers + cfg.replaced_layers - 1]}}
    if out.exists():
        shutil.rmtree(out)
    save_hf_looped(model, out, base_model=base, dtype=ml_dtypes.bfloat16,
                   extra={"torch_dtype": "bfloat16", "training": training})
    shutil.copyfile(workdir / "metrics.jsonl", out / "metrics.jsonl")
    return out


def run() -> None:
    define_flags()
    app.run(main)


if __name__ == "__main__":
    run()
