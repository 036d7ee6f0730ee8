"""train_looped.distill, SmolLM2 made recursive, on a tiny random Llama: the block starts as
a copy of the replaced layers with scaled output projections; the loss is zero for the teacher's
own states; training steps lower it; the student's states are the recursive model's (the
exported model reads out what training measured); settings are validated; chat documents keep
their turns."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from models.config import LlamaConfig
from models.llama import Llama
from models.recursive import from_llama
from train_looped import distill
from train_looped.distill import DistillConfig

CFG = DistillConfig(prelude_layers=1, replaced_layers=4, core_layers=1, num_loops=2,
                    loop_weights=(1.0, 2.0), seq_len=12, batch_size=3)


@pytest.fixture(scope="module")
def teacher():
    cfg = LlamaConfig(vocab_size=53, hidden_size=32, intermediate_size=48, num_layers=6,
                      num_heads=4, num_kv_heads=2, rope_theta=1e4, tie_word_embeddings=True,
                      max_position_embeddings=64, bos_token_id=1, eos_token_ids=(2,))
    return Llama(cfg, rngs=nnx.Rngs(0))


def _tokens(seed=0, b=3, t=12):
    return jnp.asarray(np.random.default_rng(seed).integers(0, 53, (b, t)), jnp.int32)


def _trainer(teacher, graphdef, params, cfg, scale):
    """distill's training step for cfg under clipped Adam, and the optimizer's first state."""
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.scale_by_adam())
    return distill.make_step(teacher, graphdef, cfg, scale, tx), tx.init(params)


def test_settings_validated():
    assert CFG.teacher_depths == [1, 3, 5]
    with pytest.raises(ValueError, match="multiple of num_loops"):
        dataclasses.replace(CFG, replaced_layers=3)
    with pytest.raises(ValueError, match="loop_weights"):
        dataclasses.replace(CFG, loop_weights=(1.0,))
    with pytest.raises(ValueError, match="mixture"):
        dataclasses.replace(CFG, mixture=(0.5, 0.5, 0.5, 0.5))
    with pytest.raises(ValueError, match="kl_weight must be >= 0"):
        dataclasses.replace(CFG, kl_weight=-1.0)
    with pytest.raises(ValueError, match="kl_every_depth needs kl_weight > 0"):
        dataclasses.replace(CFG, kl_every_depth=True)


def test_command_flags_set_the_recipe():
    """--prelude_layers ... --loop_weights set the recipe's shape; a bad one exits with the
    reason."""
    from train_looped.distill import config_from_flags  # noqa: PLC0415
    cfg = config_from_flags({"prelude_layers": 14, "replaced_layers": 4, "core_layers": 1,
                             "num_loops": 4, "out_scale": 0.25, "peak_lr": 1e-3,
                             "loop_weights": ["1", "1", "1", "2"], "steps": None})
    assert (cfg.prelude_layers, cfg.replaced_layers, cfg.core_layers, cfg.num_loops) == (
        14, 4, 1, 4)
    assert cfg.teacher_depths == [14, 15, 16, 17, 18] and cfg.loop_weights == (1, 1, 1, 2)
    assert cfg.peak_lr == 1e-3 and cfg.batch_size == 8  # the rest: the defaults
    kl = config_from_flags({"kl_weight": 1.0, "kl_every_depth": True, "num_loops": 2,
                            "replaced_layers": 2, "loop_weights": ["1", "1"]})
    assert kl.kl_weight == 1.0 and kl.kl_every_depth and kl.teacher_depths == [12, 13, 14]
    with pytest.raises(SystemExit, match="kl_every_depth needs kl_weight > 0"):
        config_from_flags({"kl_every_depth": True})
    with pytest.raises(SystemExit, match="must be a multiple of num_loops"):
        config_from_flags({"replaced_layers": 6, "num_loops": 4})
    with pytest.raises(SystemExit, match="loop_weights has 4 entries, num_loops is 3"):
        config_from_flags({"replaced_layers": 6, "num_loops": 3})


def test_every_recipe_flag_reaches_the_config():
    """Each flag define_flags defines but the run's own (--out, --workdir,
    --max_steps_this_run, --progress) is a DistillConfig field that config_from_flags sets.
    Read from define_flags' source, so that no flag is defined in this process (another test's
    command may define the same names)."""
    import ast  # noqa: PLC0415
    import inspect  # noqa: PLC0415
    from train_looped.distill import FLAG_FIELDS, config_from_flags, define_flags  # noqa: PLC0415
    tree = ast.parse(inspect.getsource(define_flags))
    mine = {call.args[0].value for call in ast.walk(tree) if isinstance(call, ast.Call)
            and isinstance(call.func, ast.Attribute) and call.func.attr.startswith("DEFINE_")}
    run_only = {"out", "workdir", "max_steps_this_run", "progress"}
    assert run_only <= mine and mine - run_only == set(FLAG_FIELDS)
    assert set(FLAG_FIELDS) <= {f.name for f in dataclasses.fields(distill.DistillConfig)}
    assert config_from_flags({"seed": 3}).seed == 3 and config_from_flags({}).seed == 0


def test_chat_documents_keep_their_turns():
    from train_looped.corpus import chat_messages, chat_text  # noqa: PLC0415
    msgs = chat_messages(chat_text("How many legs?\n", "Four.\n\n#### 4"))
    assert msgs == [{"role": "user", "content": "How many legs?"},
                    {"role": "assistant", "content": "Four.\n\n#### 4"}]


def test_init_block_copies_and_scales(teacher):
    block = distill.init_block(teacher, CFG)
    src = teacher.layers[CFG.prelude_layers]
    np.testing.assert_array_equal(block[0].self_attn.q_proj.kernel[...],
                                  src.self_attn.q_proj.kernel[...])
    np.testing.assert_allclose(block[0].mlp.down_proj.kernel[...],
                               CFG.out_scale * src.mlp.down_proj.kernel[...], rtol=1e-6)


def test_resuming_checks_the_recorded_settings():
    """A workdir's run.json config: other settings are named, the time budget is not, and a
    run recorded before a setting existed resumes as if it had the default."""
    old = json.loads(json.dumps(dataclasses.asdict(CFG)))
    assert distill.changed_settings(old, dataclasses.replace(CFG, minutes=5, steps=9)) == []
    assert distill.changed_settings(old, dataclasses.replace(CFG, peak_lr=1e-3)) == ["peak_lr"]
    older = {k: v for k, v in old.items() if k not in ("kl_weight", "kl_every_depth")}
    assert distill.changed_settings(older, CFG) == []
    assert distill.changed_settings(older, dataclasses.replace(CFG, kl_weight=1.0)) == [
        "kl_weight"]


def test_output_kl():
    """KL(teacher || student) of the next-token distributions: zero for equal logits (and
    for logits shifted by a constant), the closed form for two-way distributions, and not
    symmetric."""
    a = jnp.asarray([[[0.0, 1.0], [2.0, -1.0]]])
    assert abs(float(distill.output_kl(a, a))) < 1e-7
    assert abs(float(distill.output_kl(a, a + 3.0))) < 1e-6
    p, q = np.asarray([0.9, 0.1]), np.asarray([0.5, 0.5])
    want = float(np.sum(p * np.log(p / q)))
    got = distill.output_kl(jnp.log(jnp.asarray([[p]])), jnp.log(jnp.asarray([[q]])))
    assert abs(float(got) - want) < 1e-6
    back = distill.output_kl(jnp.log(jnp.asarray([[q]])), jnp.log(jnp.asarray([[p]])))
    assert abs(float(back) - float(np.sum(q * np.log(q / p)))) < 1e-6 and float(back) != want


def test_kl_weight_adds_the_output_kl_and_training_lowers_it(teacher):
    """With kl_weight > 0 the step's terms are the per-loop state losses and the last loop's
    output KL through the coda; the loss is their weighted sum, and steps lower the KL."""
    cfg = dataclasses.replace(CFG, kl_weight=0.5)
    tokens = _tokens(1)
    t = distill.teacher_states(teacher, tokens, cfg.teacher_depths)
    scale = jnp.std(t[1:], axis=(1, 2)) + 1e-3
    block = distill.init_block(teacher, cfg)
    graphdef, params = nnx.split(block, nnx.Param)
    s = distill.student_states(teacher, block, t[0], tokens, cfg.num_loops)
    coda_from = cfg.teacher_depths[-1]
    want_kl = distill.output_kl(distill.readout_logits(teacher, coda_from, t[-1:], tokens)[0],
                                distill.readout_logits(teacher, coda_from, s[-1:], tokens)[0])
    want_state, _ = distill.state_loss(s, t[1:], scale, cfg.loop_weights)
    step, opt = _trainer(teacher, graphdef, params, cfg, scale)
    kls = []
    for i in range(15):
        params, opt, loss, terms = step(params, opt, tokens, jnp.float32(3e-3))
        assert terms.shape == (cfg.num_loops + 1,)
        if i == 0:  # the terms of the parameters before the update
            np.testing.assert_allclose(float(terms[-1]), float(want_kl), rtol=1e-4)
            np.testing.assert_allclose(float(loss), float(want_state + 0.5 * want_kl),
                                       rtol=1e-4)
        kls.append(float(terms[-1]))
    assert float(want_kl) > 0 and kls[-1] < 0.7 * kls[0], kls


def test_kl_every_depth_reads_each_loop_against_the_teachers_exit_there(teacher):
    """kl_every_depth: loop r's readout through the coda against the teacher's state after the
    r-th span of replaced layers read out through the same coda (at r = R the teacher's own
    output); the teacher's states give zero KL at every depth."""
    cfg = dataclasses.replace(CFG, kl_weight=2.0, kl_every_depth=True)
    tokens = _tokens(2)
    t = distill.teacher_states(teacher, tokens, cfg.teacher_depths)  # depths 1, 3, 5
    coda_from = cfg.teacher_depths[-1]
    exit_at = distill.readout_logits(teacher, coda_from, t[1:], tokens)
    _, _, mask = distill._llama_pieces(teacher, tokens)
    full, _ = teacher(tokens, jnp.broadcast_to(jnp.arange(12), (3, 12)), mask)
    np.testing.assert_allclose(np.asarray(exit_at[-1]), np.asarray(full), atol=1e-4)
    scale = jnp.std(t[1:], axis=(1, 2)) + 1e-3
    block = distill.init_block(teacher, cfg)
    graphdef, params = nnx.split(block, nnx.Param)
    s = distill.student_states(teacher, block, t[0], tokens, cfg.num_loops)
    got = distill.readout_logits(teacher, coda_from, s, tokens)
    want = [float(distill.output_kl(exit_at[r], got[r])) for r in range(cfg.num_loops)]
    state, _ = distill.state_loss(s, t[1:], scale, cfg.loop_weights)
    step, opt = _trainer(teacher, graphdef, params, cfg, scale)
    _, _, loss, terms = step(params, opt, tokens, jnp.float32(1e-3))
    assert terms.shape == (2 * cfg.num_loops,) and min(want) > 0
    np.testing.assert_allclose(np.asarray(terms[cfg.num_loops:]), want, rtol=1e-4)
    np.testing.assert_allclose(float(loss), float(state) + 2.0 * sum(want), rtol=1e-4)
    same = [float(distill.output_kl(exit_at[r], exit_at[r])) for r in range(cfg.num_loops)]
    assert max(abs(x) for x in same) < 1e-6


def test_loss_is_zero_on_the_teachers_states_and_training_lowers_it(teacher):
    tokens = _tokens()
    t = distill.teacher_states(teacher, tokens, CFG.teacher_depths)
    assert t.shape == (3, 3, 12, 32)
    scale = jnp.std(t[1:], axis=(1, 2)) + 1e-3
    loss, per = distill.state_loss(t[1:], t[1:], scale, CFG.loop_weights)
    assert float(loss) == 0 and per.shape == (2,)
    block = distill.init_block(teacher, CFG)
    graphdef, params = nnx.split(block, nnx.Param)
    step, opt = _trainer(teacher, graphdef, params, CFG, scale)
    losses = []
    for _ in range(15):
        params, opt, loss, _ = step(params, opt, tokens, jnp.float32(3e-3))
        losses.append(float(loss))
    assert losses[-1] < 0.7 * losses[0], losses


def test_student_states_are_the_recursive_models(teacher):
    """The exported model (`from_llama` + the trained block) reads out, at every depth, the
    teacher's coda on the states training computed."""
    cfg = dataclasses.replace(CFG, out_scale=0.5)
    block = distill.init_block(teacher, cfg)
    tokens = _tokens(1, b=2, t=9)
    h0 = distill.teacher_states(teacher, tokens, [cfg.prelude_layers])[0]
    s = distill.student_states(teacher, block, h0, tokens, cfg.num_loops)
    coda_from = cfg.prelude_layers + cfg.replaced_layers
    want = distill.readout_logits(teacher, coda_from, s, tokens)
    model = from_llama(teacher, distill.model_config(cfg.layout, teacher.config))
    nnx.update(model.core_block, nnx.state(block, nnx.Param))
    pos = jnp.broadcast_to(jnp.arange(9, dtype=jnp.int32), (2, 9))
    got, _ = model.loop_logits(tokens, pos)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)
    assert jax.tree.leaves(got)[0].shape[0] == cfg.num_loops


def test_onpolicy_settings_validated():
    with pytest.raises(ValueError, match="onpolicy_share needs init_from"):
        dataclasses.replace(CFG, onpolicy_share=0.5)
    with pytest.raises(ValueError, match=r"onpolicy_share must be in \[0, 1\)"):
        dataclasses.replace(CFG, init_from="x", onpolicy_share=1.0)
    with pytest.raises(ValueError, match="onpolicy_mix must be one of base, broad"):
        dataclasses.replace(CFG, onpolicy_mix="wide")
    old = json.loads(json.dumps(dataclasses.asdict(CFG)))
    older = {k: v for k, v in old.items() if not k.startswith(("onpolicy", "init_from"))}
    assert distill.changed_settings(older, CFG) == []
    assert distill.changed_settings(
        older, dataclasses.replace(CFG, init_from="x", onpolicy_share=0.5)) == [
        "init_from", "onpolicy_share"]
    assert distill.changed_settings(old, dataclasses.replace(CFG, onpolicy_mix="broad")) == [
        "onpolicy_mix"]


def _streams(n=200):
    """Each source's stream holds only its own index (onpolicy: 9), so a row names its source."""
    streams = {s: np.full(n, i, np.int32) for i, s in enumerate(distill.SOURCES)}
    return {**streams, "onpolicy": np.full(n, 9, np.int32)}


def test_batches_draw_the_onpolicy_share_from_its_stream():
    cfg = dataclasses.replace(CFG, batch_size=8, init_from="x", onpolicy_share=0.5)
    assert distill.onpolicy_rows(cfg) == 4
    for step in range(5):
        rows = distill.batch_at(_streams(), cfg, step)
        assert rows.shape == (8, cfg.seq_len + 1)
        assert (rows[4:] == 9).all() and (rows[:4] < len(distill.SOURCES)).all()
        np.testing.assert_array_equal(rows, distill.batch_at(_streams(), cfg, step))
    plain = dataclasses.replace(cfg, init_from="", onpolicy_share=0.0)
    rows = np.stack([distill.batch_at(_streams(), plain, s) for s in range(20)])
    assert (rows < len(distill.SOURCES)).all()  # no on-policy row without the share
    # without the share a batch is drawn as before the option existed: the mixture's first
    # choice, then one offset per row, from the generator of (seed, step)
    rng = np.random.default_rng([plain.seed, 3])
    picks = rng.choice(len(distill.SOURCES), size=plain.batch_size, p=plain.mixture)
    np.testing.assert_array_equal(distill.batch_at(_streams(), plain, 3)[:, 0], picks)


def test_unlikelihood_settings_validated():
    on = dataclasses.replace(CFG, init_from="x", onpolicy_share=0.5, kl_weight=1.0)
    assert dataclasses.replace(on, unlikelihood_weight=1.0).unlikelihood_weight == 1.0
    with pytest.raises(ValueError, match="unlikelihood_weight must be >= 0"):
        dataclasses.replace(on, unlikelihood_weight=-1.0)
    with pytest.raises(ValueError, match="unlikelihood_weight needs on-policy rows"):
        dataclasses.replace(on, onpolicy_share=0.0, init_from="", unlikelihood_weight=1.0)
    with pytest.raises(ValueError, match="unlikelihood_weight needs on-policy rows"):
        dataclasses.replace(on, kl_weight=0.0, unlikelihood_weight=1.0)
    with pytest.raises(ValueError, match="unlikelihood_ngram must be >= 1"):
        dataclasses.replace(on, unlikelihood_ngram=0)
    assert dataclasses.replace(on, unlikelihood_weight=1.0,
                               unlikelihood_cycles=True).unlikelihood_cycles
    with pytest.raises(ValueError, match="unlikelihood_cycles needs unlikelihood_weight > 0"):
        dataclasses.replace(on, unlikelihood_cycles=True)
    assert dataclasses.replace(on, unlikelihood_weight=1.0,
                               unlikelihood_redefinitions=True).unlikelihood_redefinitions
    with pytest.raises(ValueError, match="unlikelihood_redefinitions needs unlikelihood_weight"):
        dataclasses.replace(on, unlikelihood_redefinitions=True)
    # the state scale is measured on corpus rows alone, a valid setting of its own
    alone = distill.corpus_only(dataclasses.replace(on, unlikelihood_weight=1.0,
                                                    unlikelihood_cycles=True,
                                                    unlikelihood_redefinitions=True))
    assert distill.onpolicy_rows(alone) == 0 and alone.unlikelihood_weight == 0
    assert not alone.unlikelihood_cycles and not alone.unlikelihood_redefinitions
    old = json.loads(json.dumps(dataclasses.asdict(on)))
    older = {k: v for k, v in old.items() if not k.startswith("unlikelihood")}
    assert distill.changed_settings(older, on) == []
    assert distill.changed_settings(older, dataclasses.replace(on, unlikelihood_weight=1.0)) == [
        "unlikelihood_weight"]


def test_onpolicy_data_must_hold_the_marks_the_run_asks_for(tmp_path):
    """A workdir's on-policy data is reused only when its marks are the run's: the n-gram size
    and whether periodic runs and redefinitions were marked (data from before those fields
    counts as unmarked)."""
    on = dataclasses.replace(CFG, init_from="x", onpolicy_share=0.5, kl_weight=1.0,
                             unlikelihood_weight=1.0)
    np.save(tmp_path / "onpolicy.npy", np.arange(10, dtype=np.int32))
    np.save(tmp_path / "onpolicy_repeats.npy", np.zeros(10, np.uint8))
    (tmp_path / "onpolicy.json").write_text(json.dumps({"repeat_ngram": 4}))
    stream, repeats = distill.onpolicy_stream(on, tmp_path)
    assert stream.tolist() == list(range(10)) and repeats.shape == (10,)
    cycles = dataclasses.replace(on, unlikelihood_cycles=True)
    with pytest.raises(SystemExit, match="4-grams, periodic runs;"):
        distill.onpolicy_stream(cycles, tmp_path)
    with pytest.raises(SystemExit, match="pass another --workdir"):
        distill.onpolicy_stream(dataclasses.replace(on, unlikelihood_ngram=3), tmp_path)
    (tmp_path / "onpolicy.json").write_text(json.dumps({"repeat_ngram": 4, "cycle_marks": True}))
    assert distill.onpolicy_stream(cycles, tmp_path)[1].shape == (10,)
    with pytest.raises(SystemExit, match="pass another --workdir"):
        distill.onpolicy_stream(on, tmp_path)
    redefs = dataclasses.replace(cycles, unlikelihood_redefinitions=True)
    with pytest.raises(SystemExit, match="periodic runs, redefinitions;"):
        distill.onpolicy_stream(redefs, tmp_path)
    (tmp_path / "onpolicy.json").write_text(json.dumps(
        {"repeat_ngram": 4, "cycle_marks": True, "redefinition_marks": True}))
    assert distill.onpolicy_stream(redefs, tmp_path)[1].shape == (10,)
    with pytest.raises(SystemExit, match="pass another --workdir"):
        distill.onpolicy_stream(cycles, tmp_path)


def test_repeat_masks_follow_the_batch_targets():
    """repeats_at marks, in the on-policy rows only, the targets (window[:, 1:]) whose stream
    position is marked: the mask at row r, position t is the stream's mark of the token that
    position t predicts."""
    n = 300
    streams = {s: np.full(n, i, np.int32) for i, s in enumerate(distill.SOURCES)}
    streams["onpolicy"] = np.arange(n, dtype=np.int32)  # a token is its own stream position
    marks = (np.arange(n) % 7 == 3).astype(np.uint8)
    streams["onpolicy_repeats"] = marks
    cfg = dataclasses.replace(CFG, batch_size=6, init_from="x", onpolicy_share=0.5)
    for step in range(4):
        window = distill.batch_at(streams, cfg, step)
        mask = distill.repeats_at(streams, cfg, step)
        assert mask.shape == (6, cfg.seq_len) and mask.dtype == np.float32
        assert (mask[:3] == 0).all()
        np.testing.assert_array_equal(mask[3:], marks[window[3:, 1:]])
        assert mask[3:].sum() > 0


def test_unlikelihood_makes_the_marked_repeats_less_likely(teacher):
    """The unlikelihood term is -log(1 - p) at the marked targets per on-policy position; with
    it, steps lower the student's probability of the marked targets, where the KL alone keeps
    them; no mark, no term."""
    cfg = dataclasses.replace(CFG, init_from="x", onpolicy_share=0.5, kl_weight=1.0,
                              kl_every_depth=True, batch_size=4)
    # the tiny teacher is nearly uniform (p ~ 0.03), where -log(1 - p) is about p: a large weight
    ul_cfg = dataclasses.replace(cfg, unlikelihood_weight=100.0)
    tokens = _tokens(5, b=4)
    t = distill.teacher_states(teacher, tokens, cfg.teacher_depths)
    coda_from = cfg.teacher_depths[-1]
    # the targets the teacher likes most (as a loop's next token is): the KL keeps them likely
    targets = jnp.argmax(distill.readout_logits(teacher, coda_from, t[-1:], tokens)[0], -1)
    repeats = np.zeros((4, cfg.seq_len), np.float32)
    repeats[2:, 6:] = 1.0  # the on-policy rows' later targets
    repeats = jnp.asarray(repeats)
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(4, cfg.seq_len, 53)), jnp.float32)
    p = jax.nn.softmax(logits)[jnp.arange(4)[:, None], jnp.arange(cfg.seq_len), targets]
    want = float(jnp.sum(repeats * -jnp.log(1 - p)) / (2 * cfg.seq_len))
    np.testing.assert_allclose(float(distill.unlikelihood(logits, targets, repeats,
                                                          2 * cfg.seq_len)), want, rtol=1e-5)
    assert float(distill.unlikelihood(logits, targets, 0 * repeats, 2 * cfg.seq_len)) == 0

    scale = jnp.std(t[1:], axis=(1, 2)) + 1e-3

    def marked_p(params, graphdef):
        s = distill.student_states(teacher, nnx.merge(graphdef, params), t[0], tokens,
                                   cfg.num_loops)
        lp = jax.nn.log_softmax(distill.readout_logits(teacher, coda_from, s[-1:], tokens)[0])
        got = jnp.exp(jnp.take_along_axis(lp, targets[..., None], axis=-1)[..., 0])
        return float(jnp.sum(repeats * got) / jnp.sum(repeats))

    finals = {}
    for name, c in (("kl", cfg), ("ul", ul_cfg)):
        graphdef, params = nnx.split(distill.init_block(teacher, c), nnx.Param)
        before = marked_p(params, graphdef)
        step, opt = _trainer(teacher, graphdef, params, c, scale)
        extra = (targets, repeats) if c.unlikelihood_weight else ()
        for _ in range(12):
            params, opt, loss, terms = step(params, opt, tokens, jnp.float32(3e-3), *extra)
            assert terms.shape == (2 * c.num_loops + bool(c.unlikelihood_weight),)
        finals[name] = marked_p(params, graphdef)
    assert finals["ul"] < 0.85 * finals["kl"] and finals["ul"] < before, (before, finals)


def test_init_from_checks_the_layout():
    shipped = {"prelude_layers": 14, "core_layers": 1, "num_loops": 2,
               "base_model": {"layers": {"replaced_by_the_block": [14, 15]}}}
    r2 = dataclasses.replace(CFG, prelude_layers=14, replaced_layers=2, core_layers=1,
                             num_loops=2)
    assert distill.layout_mismatch(shipped, r2) == []
    bad = distill.layout_mismatch(shipped, dataclasses.replace(r2, replaced_layers=4))
    assert bad == ["replaced layers [14, 15] (this run: [14, 17])"]
    with pytest.raises(FileNotFoundError, match="no exported model"):
        distill.start_block(dataclasses.replace(r2, init_from="/nonexistent/model"))


def test_init_from_loads_the_shipped_block():
    """--init_from=checkpoints/smol_loop_r2 starts from exactly the shipped layer (float32)."""
    import pathlib  # noqa: PLC0415
    ckpt = pathlib.Path(__file__).parent.parent / "checkpoints" / "smol_loop_r2"
    r2 = dataclasses.replace(CFG, prelude_layers=14, replaced_layers=2, core_layers=1,
                             num_loops=2, init_from=str(ckpt))
    from lookahead_jax.store.model_store import smollm2_gguf  # noqa: PLC0415
    from models.config import ConfigError  # noqa: PLC0415
    try:
        smollm2_gguf(download=False)
    except ConfigError as e:
        pytest.skip(f"SmolLM2 not available ({e})")
    from lookahead_jax.engine import Engine  # noqa: PLC0415
    engine = Engine.from_preset("smol_loop_r2")
    got = distill.start_block(r2)
    want = nnx.state(nnx.merge(engine.graphdef, engine.params).core_block, nnx.Param)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.dtype == jnp.float32
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="another layout: num_loops 2 "):
        distill.start_block(dataclasses.replace(r2, num_loops=1, replaced_layers=2,
                                                loop_weights=(1.0,)))
