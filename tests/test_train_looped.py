"""Training tiny looped models: corpus split, tokenizer, per-loop losses, resumable training,
export and the agreement statistics (all on toy sizes; seconds)."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.build import build_looped
from models.config import LoopedConfig
from train_looped import agreement, corpus, export, tokenizer, train

OURO = LoopedConfig(family="ouro", vocab_size=64, hidden_size=32, intermediate_size=64,
                    num_heads=2, num_kv_heads=2, num_layers=1, num_loops=3,
                    tie_word_embeddings=True)
RAVEN = LoopedConfig(family="raven", vocab_size=64, hidden_size=32, intermediate_size=64,
                     num_heads=2, num_kv_heads=2, prelude_layers=1, core_layers=1,
                     coda_layers=1, num_loops=3, tie_word_embeddings=True)
TRAIN = train.TrainConfig(seq_len=16, batch_size=4, steps=6, peak_lr=1e-2, warmup_steps=1,
                          log_every=1, save_every_minutes=1e9)


# ---- corpus ---------------------------------------------------------------------------------

@pytest.fixture
def sources(tmp_path):
    lib = tmp_path / "lib"
    for rel in ("a.py", "pkg/b.py", "pkg/c.py", "test/test_a.py", "encodings/cp1.py",
                "site-packages/x.py"):
        (lib / rel).parent.mkdir(parents=True, exist_ok=True)
        (lib / rel).write_text(f"# {rel}\nx = 1\n")
    docs = tmp_path / "docs"
    (docs / "faq").mkdir(parents=True)
    (docs / "library").mkdir()
    (docs / "library" / "os.rst.txt").write_text("The os module.\n")
    (docs / "faq" / "general.rst.txt").write_text(
        "General FAQ\n===========\n\nWhat is Python?\n---------------\n\nA language.\n\n"
        "Why indentation?\n----------------\n\nFor grouping.\n\nHistory\n-------\n\nLong.\n")
    gsm = tmp_path / "gsm8k_train.jsonl"
    gsm.write_text("".join(json.dumps({"question": f"What is {i}+1?",
                                       "answer": f"{i}+1 = <<{i}+1={i + 1}>>{i + 1}\n#### {i + 1}"})
                           + "\n" for i in range(50)))
    return dict(stdlib_root=lib, docs_sources=docs, gsm8k_train=gsm)


def test_corpus_documents_and_split_are_deterministic_and_disjoint(sources):
    docs = corpus.all_documents(**sources)
    ids = [d.id for d in docs]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert {"stdlib/a.py", "stdlib/pkg/b.py", "pydocs/library/os.rst.txt"} <= set(ids)
    assert not any("test" in i or "encodings" in i or "site-packages" in i for i in ids)
    train_docs, held = corpus.split(docs)
    again_train, again_held = corpus.split(corpus.all_documents(**sources))
    assert [d.id for d in train_docs] == [d.id for d in again_train]
    assert [d.id for d in held] == [d.id for d in again_held]
    assert not {d.id for d in train_docs} & {d.id for d in held}
    assert len(train_docs) + len(held) == len(docs)
    gsm = {d.id: d.text for d in docs if d.source == "gsm8k"}
    assert gsm["gsm8k/3"] == "<|user|>\nWhat is 3+1?\n<|assistant|>\n3+1 = 4\n#### 4"


def test_heldout_split_depends_on_the_id_only():
    ids = [f"gsm8k/{i}" for i in range(20000)]
    frac = np.mean([corpus.is_heldout(i) for i in ids])
    assert abs(frac - corpus.HELDOUT_PER_MILLE / 1000) < 0.005
    assert [corpus.is_heldout(i) for i in ids[:200]] == [corpus.is_heldout(i) for i in ids[:200]]


def test_faq_pairs_take_question_headings_and_their_text(sources):
    text = (sources["docs_sources"] / "faq" / "general.rst.txt").read_text()
    assert corpus.faq_pairs(text) == [("What is Python?", "A language."),
                                      ("Why indentation?", "For grouping.")]


# ---- tokenizer ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bpe():
    texts = ["def add(a, b):\n    return a + b\n", "The quick brown fox jumps over the dog.",
             corpus.chat_text("What is 12 + 30?", "12 + 30 = 42\n#### 42")] * 20
    return tokenizer.train_bpe(texts, vocab_size=300)


def test_tokenizer_round_trips_text_and_keeps_special_ids(bpe):
    for i, t in enumerate(tokenizer.SPECIAL_TOKENS):
        assert bpe.token_to_id(t) == i
    for text in ("def f(x):\n\treturn x ** 2  # squared\n", "naïve café, 東京 😀 12345",
                 "<|user|>\nhi\n<|assistant|>\nhello"):
        ids = bpe.encode(text, add_special_tokens=False).ids
        assert bpe.decode(ids, skip_special_tokens=False) == text
    assert bpe.encode("<|user|>", add_special_tokens=False).ids == [2]
    stream = tokenizer.encode_documents(bpe, ["ab", "cd"])
    assert stream.dtype == np.uint16 and stream[0] == tokenizer.BOS_ID
    assert list(stream).count(tokenizer.EOS_ID) == 2


def test_chat_template_renders_the_training_format(bpe, tmp_path):
    from lookahead_jax.store.tokenizer import encode_prompt, load_tokenizer
    tokenizer.save(bpe, tmp_path)
    tok = load_tokenizer(tmp_path)
    ids = encode_prompt(tok, "What is 12 + 30?", chat=True)
    assert tok.decode(ids, skip_special_tokens=False) == \
        "<|bos|><|user|>\nWhat is 12 + 30?\n<|assistant|>\n"
    assert tok.eos_token_id == tokenizer.EOS_ID


# ---- losses ---------------------------------------------------------------------------------

def test_exit_distribution_sums_to_one_and_follows_the_gate():
    gate = jnp.asarray(np.random.default_rng(0).normal(size=(4, 2, 3)), jnp.float32)
    p = train.exit_distribution(gate)
    np.testing.assert_allclose(p.sum(0), 1.0, rtol=1e-5)
    lam = jax.nn.sigmoid(gate)
    np.testing.assert_allclose(p[1], (1 - lam[0]) * lam[1], rtol=1e-5)
    np.testing.assert_allclose(p[3], (1 - lam[0]) * (1 - lam[1]) * (1 - lam[2]), rtol=1e-5)


def test_loop_cross_entropy_matches_log_softmax():
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(2, 1, 3, 5)), jnp.float32)
    labels = jnp.asarray([[0, 4, 2]])
    ce = train.loop_cross_entropy(logits, labels)
    want = -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[None, :, :, None], -1)[..., 0]
    np.testing.assert_allclose(ce, want, rtol=1e-5)


def test_gate_target_continues_only_where_the_next_loop_helps():
    ce = jnp.asarray([[[2.0, 2.0]], [[1.0, 2.0]]])          # [R=2, B=1, T=2]
    low, high = jnp.full((2, 1, 2), -4.0), jnp.full((2, 1, 2), 4.0)
    loss = lambda c, g: float(train.gate_stage2_loss(c, g, 50, 0.005))  # noqa: E731
    # token 0 improves by 1 nat: continuing (low exit logit) is right, and sharply so
    assert loss(ce[:, :, :1], low[:, :, :1]) < 0.1 < loss(ce[:, :, :1], high[:, :, :1])
    # token 1 does not improve: exiting (high exit logit) is the better answer
    assert loss(ce[:, :, 1:], high[:, :, 1:]) < loss(ce[:, :, 1:], low[:, :, 1:])


def test_consistency_term_is_kl_to_the_last_loop_which_gets_no_gradient():
    rng = np.random.default_rng(2)
    logits = jnp.asarray(rng.normal(size=(3, 1, 2, 6)), jnp.float32)
    kl = train.consistency_kl(logits)
    assert kl.shape == (2, 1, 2)
    p, logq = jax.nn.softmax(logits[-1]), jax.nn.log_softmax(logits[:-1])
    want = jnp.sum(p * (jnp.log(p) - logq), -1)
    np.testing.assert_allclose(kl, want, rtol=1e-5)
    same = jnp.broadcast_to(logits[:1], logits.shape)
    np.testing.assert_allclose(train.consistency_kl(same), 0.0, atol=1e-6)
    # the teacher (last loop) is fixed: the term moves the earlier loops only
    g = jax.grad(lambda x: jnp.sum(train.consistency_kl(x)))(logits)
    assert float(jnp.abs(g[-1]).max()) == 0.0 and float(jnp.abs(g[:-1]).max()) > 0.01
    cfg = dataclasses.replace(TRAIN, consistency_weight=0.5)
    labels = jnp.zeros((1, 2), jnp.int32)
    with_kl, m = train.loop_loss(logits, None, labels, cfg)
    without, _ = train.loop_loss(logits, None, labels, TRAIN)
    np.testing.assert_allclose(with_kl, without + 0.5 * jnp.mean(kl), rtol=1e-5)
    np.testing.assert_allclose(m["loop_kl"], jnp.mean(kl, axis=(1, 2)), rtol=1e-5)
    with pytest.raises(ValueError, match="consistency_weight"):
        train.TrainConfig(consistency_weight=-1.0)


def test_next_loop_consistency_is_kl_between_adjacent_loops_both_trained():
    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.normal(size=(3, 1, 2, 6)), jnp.float32)
    kl = train.consistency_kl(logits, "next")
    p, logq = jax.nn.softmax(logits[1:]), jax.nn.log_softmax(logits[:-1])
    np.testing.assert_allclose(kl, jnp.sum(p * (jnp.log(p) - logq), -1), rtol=1e-5)
    # every loop, the last included, gets a gradient: a loop can agree by changing less
    g = jax.grad(lambda x: jnp.sum(train.consistency_kl(x, "next")))(logits)
    assert all(float(jnp.abs(g[r]).max()) > 0.01 for r in range(3))
    cfg = dataclasses.replace(TRAIN, consistency_weight=2.0, consistency_target="next")
    labels = jnp.zeros((1, 2), jnp.int32)
    with_kl, _ = train.loop_loss(logits, None, labels, cfg)
    without, _ = train.loop_loss(logits, None, labels, TRAIN)
    np.testing.assert_allclose(with_kl, without + 2.0 * jnp.mean(kl), rtol=1e-5)
    with pytest.raises(ValueError, match="consistency_target"):
        train.TrainConfig(consistency_target="first")
    with pytest.raises(ValueError, match="target"):
        train.consistency_kl(logits, "first")


def test_branch_norm_init_scales_only_the_residual_branch_norms():
    model = build_looped(dataclasses.replace(OURO, num_layers=2), rngs=nnx.Rngs(0))
    before = jax.tree.map(np.array, nnx.state(model, nnx.Param))
    train.init_branch_norms(model, 0.25)
    after = jax.tree.map(np.array, nnx.state(model, nnx.Param))
    changed = set()
    for (path, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(before),
                                 jax.tree_util.tree_leaves_with_path(after)):
        if not np.array_equal(np.asarray(a), np.asarray(b)):
            changed.add(jax.tree_util.keystr(path))
            np.testing.assert_array_equal(np.asarray(b), 0.25)
    want = {f"['layers'][{i}]['{n}']['weight']" for i in range(2)
            for n in ("input_layernorm_2", "post_attention_layernorm_2")}
    assert {c.replace(".value", "") for c in changed} == want
    # a loop of the model with smaller branch norms moves the state differently
    x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 3, OURO.hidden_size)), jnp.float32)
    fresh = build_looped(OURO, rngs=nnx.Rngs(0))
    small = build_looped(OURO, rngs=nnx.Rngs(0))
    train.init_branch_norms(small, 0.25)
    pos = train.positions_like(jnp.zeros((1, 3), jnp.int32))
    step = [m.advance(x, x, 0, pos)[0] for m in (fresh, small)]
    assert not np.allclose(np.asarray(step[0]), np.asarray(step[1]), atol=1e-3)
    with pytest.raises(ValueError, match="Ouro"):
        train.init_branch_norms(build_looped(RAVEN, rngs=nnx.Rngs(0)), 0.25)
    with pytest.raises(ValueError, match="branch_norm_init"):
        train.TrainConfig(branch_norm_init=0.0)


# ---- training -------------------------------------------------------------------------------

def _tokens(n=4000, seed=0):
    """A learnable stream: a repeated random 40-token phrase with some noise."""
    rng = np.random.default_rng(seed)
    phrase = rng.integers(5, 64, 40)
    toks = np.tile(phrase, n // 40 + 1)[:n]
    noise = rng.random(n) < 0.05
    toks[noise] = rng.integers(5, 64, noise.sum())
    return toks.astype(np.uint16)


@pytest.mark.parametrize("cfg,loss,kl,target", [
    (OURO, "uniform", 0.0, "last"), (OURO, "ouro", 0.0, "last"), (RAVEN, "uniform", 0.0, "last"),
    (OURO, "uniform", 1.0, "last"), (OURO, "uniform", 1.0, "next")])
def test_train_steps_lower_every_loops_loss(cfg, loss, kl, target):
    tcfg = dataclasses.replace(TRAIN, loss=loss, consistency_weight=kl, consistency_target=target)
    model = build_looped(cfg, rngs=nnx.Rngs(0))
    graphdef, rest, state = train.init_state(model, train.make_optimizer(tcfg))
    batch = jnp.asarray(train.batch_at(_tokens(), 0, 4, 16, 0))
    params, opt_state = state.params, state.opt_state
    first = None
    for _ in range(5):
        params, opt_state, m = train.train_step(params, opt_state, rest, batch, jnp.float32(1e-2),
                                                jnp.int32(1), graphdef=graphdef, cfg=tcfg)
        first = m["loop_ce"] if first is None else first
    assert m["loop_ce"].shape == (cfg.num_loops,)
    assert np.all(np.asarray(m["loop_ce"]) < np.asarray(first) - 0.1)


def test_resumed_training_equals_an_uninterrupted_run(tmp_path):
    toks = _tokens()
    whole = train.train(build_looped(OURO, rngs=nnx.Rngs(0)), TRAIN, toks, tmp_path / "a",
                        progress=False)
    train.train(build_looped(OURO, rngs=nnx.Rngs(0)), TRAIN, toks, tmp_path / "b", progress=False,
                max_steps_this_run=3)
    resumed = train.train(build_looped(OURO, rngs=nnx.Rngs(5)), TRAIN, toks, tmp_path / "b",
                          progress=False)
    assert whole.step == resumed.step == TRAIN.steps
    for a, b in zip(jax.tree.leaves(whole.params), jax.tree.leaves(resumed.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    lines = (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()
    logs = [json.loads(line) for line in lines]
    assert [r["step"] for r in logs if "loss" in r] == list(range(1, TRAIN.steps + 1))


def test_more_steps_extend_a_finished_run_on_the_longer_schedule(tmp_path):
    toks = _tokens()
    done = train.train(build_looped(OURO, rngs=nnx.Rngs(0)), TRAIN, toks, tmp_path,
                       progress=False)
    again = train.train(build_looped(OURO, rngs=nnx.Rngs(0)), TRAIN, toks, tmp_path,
                        progress=False)
    assert again.step == done.step == TRAIN.steps  # the same command: nothing left to run
    longer = dataclasses.replace(TRAIN, steps=TRAIN.steps + 3)
    more = train.train(build_looped(OURO, rngs=nnx.Rngs(0)), longer, toks, tmp_path,
                       progress=False)
    assert more.step == more.total_steps == TRAIN.steps + 3
    assert any(not np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(jax.tree.leaves(done.params), jax.tree.leaves(more.params)))
    logs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    lrs = {r["step"]: r["lr"] for r in logs if "lr" in r}
    assert sorted(lrs) == list(range(1, TRAIN.steps + 4))  # logged at the step it ran
    assert lrs[TRAIN.steps + 1] == pytest.approx(train.lr_at(TRAIN.steps, TRAIN.steps + 3, longer),
                                                 abs=1e-6)
    assert train.planned_total(TRAIN.steps, 0) == train.planned_total(TRAIN.steps, 2) == 6
    assert train.planned_total(0, 4) == 4 and train.planned_total(6, 9) == 9


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    cfg = train.TrainConfig(peak_lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert train.lr_at(0, 100, cfg) == pytest.approx(0.1)
    assert train.lr_at(9, 100, cfg) == pytest.approx(1.0)
    assert train.lr_at(100, 100, cfg) == pytest.approx(0.1)
    assert train.batch_at(_tokens(), 7, 2, 8, 3).tolist() == \
        train.batch_at(_tokens(), 7, 2, 8, 3).tolist()


# ---- export and agreement -------------------------------------------------------------------

@pytest.mark.parametrize("cfg", [OURO, RAVEN])
def test_export_round_trip_gives_the_same_logits(cfg, tmp_path, bpe):
    tokenizer.save(bpe, tmp_path / "tok")
    model = build_looped(cfg, rngs=nnx.Rngs(2))
    _, params, _ = nnx.split(model, nnx.Param, ...)
    export.save(tmp_path / "ck", cfg, params, tokenizer_dir=tmp_path / "tok", dtype="float32")
    loaded, got_cfg = export.load(tmp_path / "ck")
    assert got_cfg == cfg
    toks = jnp.asarray(train.batch_at(_tokens(), 0, 2, 12, 0)[:, :-1])
    pos = train.positions_like(toks)
    np.testing.assert_array_equal(model.loop_logits(toks, pos)[0],
                                  loaded.loop_logits(toks, pos)[0])
    assert (tmp_path / "ck" / "tokenizer.json").exists()


def test_agreement_statistics_on_a_toy_case():
    argmax = np.array([[[1, 2, 3, 4]], [[1, 2, 0, 4]], [[1, 2, 0, 0]]])   # [R=3, B=1, T=4]
    labels = np.array([[1, 2, 0, 9]])
    ce = np.ones((3, 1, 4)) * np.array([3.0, 2.0, 1.0])[:, None, None]
    kl = np.zeros((3, 1, 4)) + np.array([0.0, 0.4, 0.1])[:, None, None]
    kl[1, 0, 0] = 0.8
    stats = agreement.LoopStats(3)
    stats.add(ce, argmax, labels, kl)
    s = stats.summary()
    assert s["kl_prev"] == [0.0, 0.5, 0.1]
    assert s["agreement"] == [0.5, 0.75, 1.0]
    assert s["accuracy"] == [0.5, 0.75, 0.75]
    assert s["loss"] == [3.0, 2.0, 1.0] and s["tokens"] == 4
    w = agreement.windows(np.arange(50), 8, 100)
    assert w.shape == (6, 9) and w[1, 0] == 8 and w[0, -1] == 8


def test_eval_step_reports_each_loops_kl_to_the_previous_loop():
    model = build_looped(OURO, rngs=nnx.Rngs(1))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    batch = jnp.asarray(train.batch_at(_tokens(), 0, 2, 8, 0))
    ce, argmax, kl_prev = train.eval_step(params, rest, batch, graphdef=graphdef)
    logits, _ = model.loop_logits(batch[:, :-1], train.positions_like(batch[:, :-1]))
    np.testing.assert_allclose(ce, train.loop_cross_entropy(logits, batch[:, 1:]), rtol=1e-5)
    np.testing.assert_array_equal(argmax, jnp.argmax(logits, -1))
    assert kl_prev.shape == (OURO.num_loops, 2, 8) and float(jnp.abs(kl_prev[0]).max()) == 0.0
    np.testing.assert_allclose(kl_prev[1:], train.consistency_kl(logits, "next"), rtol=1e-4,
                               atol=1e-6)


def test_bfloat16_export_stays_close(tmp_path, bpe):
    tokenizer.save(bpe, tmp_path / "tok")
    model = build_looped(OURO, rngs=nnx.Rngs(2))
    _, params, _ = nnx.split(model, nnx.Param, ...)
    export.save(tmp_path / "ck", OURO, params, tokenizer_dir=tmp_path / "tok",
                training={"steps": 1})
    loaded, _ = export.load(tmp_path / "ck")
    toks = jnp.asarray(train.batch_at(_tokens(), 0, 2, 12, 0)[:, :-1])
    pos = train.positions_like(toks)
    np.testing.assert_allclose(model.loop_logits(toks, pos)[0], loaded.loop_logits(toks, pos)[0],
                               atol=0.05)
    assert json.loads((tmp_path / "ck" / "config.json").read_text())["training"] == {"steps": 1}


@pytest.mark.parametrize("name", ["tiny_ouro", "tiny_raven"])
def test_shipped_checkpoint_matches_its_preset_and_tokenizer(name):
    import pathlib

    from lookahead_jax.store.tokenizer import encode_prompt, load_tokenizer
    from train_looped import configs
    ckpt = pathlib.Path(__file__).resolve().parent.parent / "checkpoints" / name
    if not ckpt.is_dir():
        pytest.skip(f"{ckpt} not present")
    spec = configs.get(name)
    assert export.load_config(ckpt) == spec.model
    training = json.loads((ckpt / "config.json").read_text())["training"]
    assert training["train_config"] == dataclasses.asdict(spec.train)
    tok = load_tokenizer(ckpt)
    ids = encode_prompt(tok, "Hi", chat=True)
    assert ids[:2] == [tokenizer.BOS_ID, 2] and tok.eos_token_id == tokenizer.EOS_ID
    assert max(ids) < spec.model.vocab_size


@pytest.mark.parametrize("name", ["tiny_ouro", "tiny_raven"])
def test_tiny_model_shape_is_its_presets(name):
    """train_looped trains the shape its preset (configs/<name>.py) gives, written there only;
    the tokenizer built here fits it (vocabulary size, BOS / EOS ids)."""
    from lookahead_jax.store.presets import load_preset
    from train_looped import configs
    spec = configs.get(name)
    preset = load_preset(name).model
    assert spec.model == preset and spec.name == name
    assert preset.vocab_size == tokenizer.DEFAULT_VOCAB
    assert (preset.bos_token_id, preset.eos_token_ids) == (tokenizer.BOS_ID, (tokenizer.EOS_ID,))
    assert spec.description.startswith(f"A tiny {preset.family.capitalize()}-style looped model")
