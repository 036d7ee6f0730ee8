"""Settings of a lookahead-drafter (LAD) training run, one named config per frozen looped model.

    python -m train_lad.main --config=tiny_ouro

`LadConfig` names the frozen looped model (a preset of `configs/`, optionally another
checkpoint) and the shape it must have (family, hidden size, vocabulary, loops): a checkpoint
of another shape is refused with an error naming the field (`check_base_model`). The named
configs take that shape from their preset (`for_preset`), where each model's shape is written.
"""

from __future__ import annotations

import dataclasses

from models.config import ConfigError


@dataclasses.dataclass(frozen=True)
class LadConfig:
    """One LAD run. Drafter: `num_layers` causal blocks of width `hidden_size` over the frozen
    model's states at loop `draft_depth` plus the anchor token; K tokens after the anchor over
    a draft vocabulary of `draft_vocab` tokens, scored by the drafter's own matrix
    (`head="vocab"`) or by the looped model's output embedding (`head="model"`: the draft
    vocabulary then grows at inference with the prompt's tokens, EOS and the outputs), read
    from K future query positions processed with the context (`arch="queries"`, the paper's
    drafter) or from K linear heads on the drafting position (`arch="heads"`, the ablation).
    Data:
    `prompt_len`-token prompts, each with the model's own full-depth greedy continuation of
    `continuation` tokens; `num_train` / `num_dev` / `num_confirm` prompts per split. The
    model's shape fields (`model_family` ... `model_loops`): `for_preset` takes them from the
    preset."""

    name: str
    model_preset: str  # the frozen looped model: a preset in configs/
    model_family: str  # the shape that model must have
    model_hidden: int
    model_vocab: int
    model_loops: int
    model_ckpt: str | None = None  # None: the preset's checkpoint (checkpoints/<name>)
    draft_depth: int = 1  # R1: the early loop whose states and readout feed the drafter
    K: int = 3
    hidden_size: int = 512
    num_layers: int = 2
    num_heads: int = 8
    draft_vocab: int = 1024
    head: str = "vocab"  # "vocab" | "model": the output head (lookahead_jax.looped.drafter)
    arch: str = "queries"  # "queries" (the paper's: K future query positions) | "heads"
    anchor: str = "table"  # "table" (a trained row per token) | "model" (the model's output
    # embedding's column, projected: no vocabulary-sized table in the drafter file)
    residual: int = 0  # > 0: train only a residual head of this bottleneck width on the
    # states of draft_depth, over the frozen drafter `backbone` (trained on an earlier loop)
    backbone: str | None = None  # a drafter file or train_lad workdir (relative: to the repo)
    prompt_len: int = 48
    continuation: int = 32
    num_train: int = 512
    num_dev: int = 64
    num_confirm: int = 64
    prompt_source: str = "corpus"  # "corpus" (train_looped's text) | "random" (token ids)
    batch_size: int = 16
    steps: int = 300
    lr: float = 1e-3
    warmup: int = 20
    eval_every: int = 50
    seed: int = 0

    def __post_init__(self):
        if not 1 <= self.draft_depth < self.model_loops:
            raise ConfigError(f"lad config {self.name}: draft_depth must be in [1, "
                              f"{self.model_loops}), got {self.draft_depth}")
        for f in ("K", "hidden_size", "num_layers", "num_heads", "draft_vocab", "prompt_len",
                  "continuation", "num_train", "num_dev", "batch_size", "steps", "eval_every"):
            if getattr(self, f) <= 0:
                raise ConfigError(f"lad config {self.name}: {f} must be positive")
        if self.continuation <= self.K + 1:
            raise ConfigError(f"lad config {self.name}: continuation must exceed K + 1")
        if self.head not in ("vocab", "model"):
            raise ConfigError(f"lad config {self.name}: head must be vocab or model")
        if self.arch not in ("queries", "heads"):
            raise ConfigError(f"lad config {self.name}: arch must be queries or heads")
        if self.anchor not in ("table", "model"):
            raise ConfigError(f"lad config {self.name}: anchor must be table or model")
        if self.residual < 0 or bool(self.residual) != bool(self.backbone):
            raise ConfigError(f"lad config {self.name}: a residual head (residual > 0) and a "
                              f"backbone go together (residual {self.residual}, backbone "
                              f"{self.backbone!r})")
        if self.prompt_source not in ("corpus", "random"):
            raise ConfigError(f"lad config {self.name}: prompt_source must be corpus or random")

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.continuation


def for_preset(name: str, preset: str, **settings) -> LadConfig:
    """A LadConfig for the looped model of `preset` (configs/<preset>.py): the shape it must
    have (family, hidden size, vocabulary, loops) is the preset's model's, and its checkpoint
    the preset's unless settings give `model_ckpt`."""
    from lookahead_jax.store.presets import load_preset  # noqa: PLC0415
    model = load_preset(preset).model
    if not hasattr(model, "num_loops"):
        raise ConfigError(f"lad config {name}: preset {preset} is not a looped model")
    return LadConfig(name=name, model_preset=preset, model_family=model.family,
                     model_hidden=model.hidden_size, model_vocab=model.vocab_size,
                     model_loops=model.num_loops, **settings)


# The tiny models' drafters are 256 wide (the paper's 2 x 512 drafter is for 1.4B+ models;
# the LadConfig defaults). Head "model", so that
# the prompt's tokens, EOS and the outputs join the draft vocabulary at inference; on the
# teacher data it drafts as well as head "vocab" (tiny_ouro, 192 training prompts, 150 steps:
# dev / confirmation accepted prefix 3.41 / 3.46 against 3.42 / 3.46).
_TINY = dict(hidden_size=256, num_heads=4, steps=200, head="model")
# SmolLM2 made recursive: the tiny drafter on loop 1's states (the comment below says why)
_SMOL = dict(draft_depth=1, num_train=256, num_dev=32, num_confirm=32, anchor="model", **_TINY)
CONFIGS = {
    "tiny_ouro": for_preset("tiny_ouro", "tiny_ouro", draft_depth=1, **_TINY),
    "tiny_raven": for_preset("tiny_raven", "tiny_raven", draft_depth=2, **_TINY),
    # SmolLM2 made recursive (135M parameters, 34 layers deep at R = 4): the same 256-wide
    # drafter on loop 1's states, fewer teacher prompts (its continuations cost a real model's
    # decoding on the CPU); anchors embedded through the model's own embedding, so that the
    # drafter file holds no 49,152-row table (8 MB instead of 58 MB)
    "smol_loop": for_preset("smol_loop", "smol_loop", **_SMOL),
    # the same drafter for SmolLM2 with one layer looped twice, and with two (loop-1 states)
    "smol_loop_r2": for_preset("smol_loop_r2", "smol_loop_r2", **_SMOL),
    "smol_loop_2x2": for_preset("smol_loop_2x2", "smol_loop_2x2", **_SMOL),
    # ... and for that block halved and looped four times (R = 4, loop-1 states)
    "smol_loop_2x4": for_preset("smol_loop_2x4", "smol_loop_2x4", **_SMOL),
    # Raven's residual head: the shipped depth-2 drafter, frozen, drafting from loop 4's states
    # (better native proposals) through a 64-wide residual head trained on them
    "tiny_raven_r4": for_preset("tiny_raven_r4", "tiny_raven", draft_depth=4, residual=64,
                                backbone="checkpoints/tiny_raven_lad", **_TINY),
    # ... and on a model that writes real text: smol_loop_2x4's drafter, frozen, drafting
    # from loop 2's states (81% top-1 agreement with SmolLM2 against loop 1's 74%; it drafts
    # 1.22 of 3 right against 1.13 at depth 1, but needs more loops: checkpoints/README.md)
    "smol_loop_2x4_d2": for_preset("smol_loop_2x4_d2", "smol_loop_2x4", residual=64,
                                   backbone="checkpoints/smol_loop_2x4_lad",
                                   **{**_SMOL, "draft_depth": 2}),
}


def get(name: str) -> LadConfig:
    if name not in CONFIGS:
        raise ConfigError(f"unknown lad config {name!r}: available {', '.join(sorted(CONFIGS))}")
    return CONFIGS[name]


def check_base_model(cfg: LadConfig, model_cfg, source: str) -> None:
    """Raises ConfigError naming the first field where the looped model differs from what the
    drafter's config expects."""
    if not hasattr(model_cfg, "num_loops"):
        raise ConfigError(f"lad config {cfg.name}: {source} is not a looped model")
    for want, field in ((cfg.model_family, "family"), (cfg.model_hidden, "hidden_size"),
                        (cfg.model_vocab, "vocab_size"), (cfg.model_loops, "num_loops")):
        got = getattr(model_cfg, field)
        if got != want:
            raise ConfigError(
                f"looped model {source} does not match lad config {cfg.name}: {field} is {got} "
                f"in the checkpoint, {want} in the drafter's config")
