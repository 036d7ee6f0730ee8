"""LoopAhead (greedy) on tiny random looped models (Ouro, Raven): output equals plain
full-depth greedy token for token with native proposals only, with feedback scheduling on and
off, with a budget, with a real (untrained) lookahead drafter, with an oracle drafter that
knows the answer (then whole chains commit in one step and loops per token fall far below
LoopSpec's) and with a drafter that is always wrong; the benchmark's ablations (drafter off,
scheduling off); the sampling path at a near-zero temperature. (Sampling's distribution:
tests/test_loopahead_sampling.py.)"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lookahead_jax.engine import Engine
from lookahead_jax.generation import Output
from lookahead_jax.looped.drafter import LadDrafter
from lookahead_jax.looped.loopahead import LoopAhead, priority_rank, request_tokens
from lookahead_jax.looped.tree import LoopTree
from lookahead_jax.looped.loopspec import LoopSpec
from lookahead_jax.sampling import Sampling
from models.build import build_looped
from test_looped import CONFIGS, _perturb_norms  # noqa: E402
from test_loopspec import FACTOR, PROMPTS, agreeable  # noqa: E402
from lookahead_jax.looped.drafter import DrafterShape, LookaheadDrafter

NEW = 24


@pytest.fixture(scope="module", params=list(CONFIGS))
def engine(request) -> Engine:
    fam = request.param
    model = agreeable(_perturb_norms(build_looped(CONFIGS[fam], rngs=nnx.Rngs(3))), FACTOR[fam])
    return Engine(model, eos_ids=())


@pytest.fixture(scope="module")
def plain(engine):
    return engine.generate_ids(PROMPTS, method="ar", max_new_tokens=NEW).tokens


class TableDrafter:
    """Drafts from a fixed table of tokens per row: position p gets table[b, p + 2 + k]."""

    def __init__(self, table: np.ndarray, K: int):
        self.params = {"table": jnp.asarray(table, jnp.int32)}
        self.K = K

    def draft(self, params, states, anchors, positions, mask, **_):
        t = params["table"]
        idx = positions[:, -1:] + 2 + jnp.arange(self.K)[None]
        return jnp.take_along_axis(t, jnp.clip(idx, 0, t.shape[1] - 1), axis=1)


def oracle(plain) -> TableDrafter:
    width = max(len(p) for p in PROMPTS) + NEW + 8
    table = np.zeros((len(PROMPTS), width), np.int32)
    for i, (p, out) in enumerate(zip(PROMPTS, plain)):
        table[i, : len(p) + len(out)] = p + out
    return TableDrafter(table, K=3)


def run(engine, method):
    res = engine.generate_ids(PROMPTS, method=method, max_new_tokens=NEW)
    print(f"\n{engine.config.family} {method.__class__.__name__}: {res.stats.extra}")
    return res


@pytest.mark.parametrize("kw", [dict(r2=0), dict(r2=2), dict(r2=2, scheduling=False),
                                dict(r2=2, max_active=2)],
                         ids=["r1", "feedback", "no_scheduling", "budget2"])
def test_native_only_equals_plain(engine, plain, kw):
    res = run(engine, LoopAhead(r1=1, **kw))
    assert res.tokens == plain
    assert res.stats.extra["loops_per_token"] < engine.config.num_loops


def untrained(cfg, head: str = "vocab", arch: str = "heads") -> LadDrafter:
    net = LookaheadDrafter(DrafterShape(cfg.hidden_size, cfg.vocab_size, 32, 1, 2, 3, 50,
                                        head=head, arch=arch), rngs=nnx.Rngs(0))
    return LadDrafter(net, np.arange(0, 97, 2)[:50])


@pytest.mark.parametrize("head,arch,kw", [("vocab", "heads", {}), ("model", "queries", {}),
                                         ("model", "queries", dict(max_active=4, lad_calls=2))],
                         ids=["heads", "queries", "queries_budget4_calls2"])
def test_untrained_drafter_equals_plain(engine, plain, head, arch, kw):
    """Head "model" also drafts from the request's own tokens (prompt, outputs, EOS); arch
    "queries" is the paper's drafter (K future query positions); a budget of 4 nodes per step
    with two drafter calls per row and step."""
    drafter = untrained(engine.config, head, arch)
    res = run(engine, LoopAhead(r1=1, r2=2, drafter=drafter, window=8, **kw))
    assert res.tokens == plain
    assert res.stats.extra["drafter_arch"] == arch


def test_residual_head_drafter_at_a_deeper_loop_equals_plain(engine, plain):
    """A drafter with a residual head (Raven's: a backbone trained on one loop drafting from a
    deeper loop's states) at r1 = 2, its head not zero (so it changes the drafts): output
    still equals plain greedy; the registry takes r1 from its draft depth."""
    cfg = engine.config
    net = LookaheadDrafter(DrafterShape(cfg.hidden_size, cfg.vocab_size, 32, 1, 2, 3, 50,
                                        head="model", arch="queries", residual=8),
                           rngs=nnx.Rngs(1))
    net.residual_up.kernel[...] = 0.5 * jnp.ones_like(net.residual_up.kernel[...])
    drafter = LadDrafter(net, np.arange(0, 97, 2)[:50], draft_depth=2, backbone_depth=1)
    assert (drafter.residual, drafter.backbone_depth) == (8, 1)
    res = run(engine, LoopAhead(r1=2, r2=3 if cfg.num_loops > 3 else 0, drafter=drafter,
                                window=8))
    assert res.tokens == plain
    from lookahead_jax.registry import build_method  # noqa: PLC0415
    assert build_method("loopahead", lad=drafter, model_config=cfg).r1 == 2


def test_request_tokens():
    """The drafter's extra vocabulary: the prompt's tokens, the outputs so far, EOS."""
    out = Output(jnp.asarray([[7, 8, 0, 0], [9, 0, 0, 0]]), jnp.asarray([2, 1]),
                 jnp.asarray([False, False]))
    prompt = jnp.asarray([[5, 6, -1], [4, 3, 2]])
    assert request_tokens(prompt, out, (1, 2)).tolist() == [[5, 6, -1, 7, 8, -1, -1, 1, 2],
                                                           [4, 3, 2, 9, -1, -1, -1, 1, 2]]
    assert request_tokens(prompt, out, ()).shape == (2, 7)


WRONG_DRAFTER = TableDrafter((np.arange(64)[None] * 7 + np.arange(3)[:, None]) % 97, K=3)


def test_wrong_drafter_and_ablations_equal_plain(engine, plain):
    """A drafter that is always wrong, and the benchmark's ablations: scheduling off (no
    suspension, no r2 proposal) with that drafter, and the drafter off (native proposals
    only), all give plain greedy's tokens; without suspension more candidate advances go to
    the wrong drafter's branches."""
    on = run(engine, LoopAhead(r1=1, r2=2, drafter=WRONG_DRAFTER, window=8))
    off = run(engine, LoopAhead(r1=1, r2=2, drafter=WRONG_DRAFTER, window=8, scheduling=False))
    nodrafter = run(engine, LoopAhead(r1=1, r2=2, drafter=None))
    assert on.tokens == plain and off.tokens == plain and nodrafter.tokens == plain
    assert on.stats.extra["K"] == 3 and off.stats.extra["scheduling"] is False
    assert off.stats.extra["advances"] > on.stats.extra["advances"]
    # the wrong branches are thrown away: with suspension after fewer loops
    r_full = engine.config.num_loops
    for res in (on, off, nodrafter):
        st = res.stats.extra
        # every verified token's node ran R loops; the rest went to discarded nodes or is
        # still in the tree when decoding stops
        in_tree = st["advances"] - r_full * st["verified_tokens"] - st["discarded_advances"]
        assert st["discarded"] > 0 and 0 <= in_tree <= len(PROMPTS) * r_full * st["capacity"]
    assert (off.stats.extra["discarded_advances"] > on.stats.extra["discarded_advances"])
    assert nodrafter.stats.extra["K"] == 0 and nodrafter.stats.extra["drafter_accepted"] == 0


def _tree(tokens, parents, depths, positions) -> LoopTree:
    """One row's tree from its nodes' tokens, parents (-1: the root, slot 0), depths and
    positions, with two free slots."""
    n = len(tokens)
    tree = LoopTree.init(jnp.asarray([tokens[0]]), jnp.asarray([positions[0]]), n + 2, 8,
                         jnp.float32, 1)
    anc = np.zeros((1, n + 2, n + 2), bool)
    for i, p in enumerate(parents):
        while p >= 0:
            anc[0, i, p] = True
            p = parents[p]
    pad = lambda x, v=0: jnp.asarray([list(x) + [v, v]], jnp.int32)  # noqa: E731
    return tree.replace(valid=jnp.asarray([[True] * n + [False, False]]),
                        fresh=jnp.zeros((1, n + 2), bool), token=pad(tokens),
                        parent=pad(parents, -1), depth=pad(depths), pos=pad(positions),
                        kind=pad([0] + [1] * (n - 1)), anc=jnp.asarray(anc))


def test_later_readouts_resume_and_pause_children():
    """Feedback (greedy, R = 4, r2 = 2): the root's depth-3 readout agrees with its paused
    child, which resumes, and not with the running one, which pauses; no proposal is added
    after r2. At depth 2 a readout agreeing with neither pauses both and adds its own."""
    method = LoopAhead(r1=1, r2=2)
    tree = _tree([4, 5, 7], [-1, 0, 0], [3, 2, 2], [10, 11, 11])
    paused = jnp.asarray([[False, True, False, False, False]])
    active = jnp.asarray([[True, False, False, False, False]])
    top = jnp.asarray([[5, 0, 0, 0, 0]])
    new, got = method._feedback(tree, paused, active, top, None, None, 4)
    assert got[0, :3].tolist() == [False, False, True]
    assert new.valid.sum() == 3  # nothing added at depth 3
    # a depth-3 readout agreeing with no child changes nothing
    _, same = method._feedback(tree, paused, active, jnp.asarray([[9, 0, 0, 0, 0]]), None,
                               None, 4)
    assert same[0, :3].tolist() == [False, True, False]
    at_r2 = tree.replace(depth=jnp.asarray([[2, 1, 1, 0, 0]]))
    new, got = method._feedback(at_r2, paused, active, jnp.asarray([[9, 0, 0, 0, 0]]), None,
                                None, 4)
    assert got[0, :3].tolist() == [False, True, True]
    added = np.flatnonzero(np.asarray(new.valid[0] & ~at_r2.valid[0]))
    assert len(added) == 1 and int(new.token[0, added[0]]) == 9
    assert int(new.parent[0, added[0]]) == 0


def test_priority_and_discarded_nodes():
    """Priority: the nearer position first, then the deeper node, then the lower slot; a
    verification that keeps one child discards the other subtree (the committed root is not
    counted), a restart discards every node but the root."""
    #        0 (pos 10, d3)
    #      /     \
    #  1 (11, d2)  2 (11, d1)
    #     |
    #  3 (12, d2)
    tree = _tree([4, 5, 7, 6], [-1, 0, 0, 1], [3, 2, 1, 2], [10, 11, 11, 12])
    every = tree.valid
    assert priority_rank(tree, every)[0, :4].tolist() == [0, 1, 2, 3]
    only = every & (jnp.arange(6) != 1)[None]
    assert priority_rank(tree, only)[0, [0, 2, 3]].tolist() == [0, 1, 2]
    keep, restart = jnp.asarray([True]), jnp.asarray([False])
    assert np.flatnonzero(tree.discarded(keep, jnp.asarray([1]), restart)[0]).tolist() == [2]
    assert np.flatnonzero(tree.discarded(keep, jnp.asarray([2]), restart)[0]).tolist() == [1, 3]
    assert np.flatnonzero(tree.discarded(~keep, jnp.asarray([0]), ~restart)[0]).tolist() == [
        1, 2, 3]
    assert not tree.discarded(~keep, jnp.asarray([0]), restart).any()
    kids = tree.children()[0]
    assert [np.flatnonzero(kids[i]).tolist() for i in range(4)] == [[1, 2], [3], [], []]
    assert not kids[4:].any()  # empty slots have no children
    freed = tree.free(jnp.arange(6)[None] == 3).children()[0]
    assert np.flatnonzero(freed[1]).tolist() == []  # a freed node is no one's child


def test_budget_and_calls_are_checked():
    from models.config import ConfigError  # noqa: PLC0415
    with pytest.raises(ConfigError, match="max_active >= 0"):
        LoopAhead(max_active=-1)
    with pytest.raises(ConfigError, match="lad_calls"):
        LoopAhead(lad_calls=0)
    with pytest.raises(ConfigError, match="suspend_below"):
        LoopAhead(suspend_below=1.5)


def test_the_suspension_default_follows_the_budget():
    """Sampling pauses no child by default, and all but the likeliest under a budget (where a
    paused child frees its slot); a threshold given is kept; greedy ignores the budget."""
    hot = Sampling(0.7)
    assert LoopAhead(hot).suspend_below == 0.0
    assert LoopAhead(hot, max_active=4).suspend_below == 1.0
    assert LoopAhead(hot, max_active=4, suspend_below=0.0).suspend_below == 0.0
    assert LoopAhead(hot, suspend_below=0.5).suspend_below == 0.5
    assert LoopAhead(max_active=4).suspend_below == 0.0


def test_near_zero_temperature_is_greedy(engine, plain):
    """The sampling path (drafter and feedback on) at temperature 1e-6 emits plain greedy's
    tokens: under sampling the tree keeps exactly the accepted branch."""
    res = engine.generate_ids(PROMPTS, method=LoopAhead(Sampling(1e-6), drafter=untrained(
        engine.config), window=8), max_new_tokens=NEW, seed=5)
    assert res.tokens == plain


def test_oracle_drafter_commits_chains(engine, plain):
    spec = run(engine, LoopSpec(d1=1))
    res = run(engine, LoopAhead(r1=1, r2=2, drafter=oracle(plain), window=8))
    assert res.tokens == plain
    st = res.stats.extra
    assert st["loops_per_token"] < 0.7 * spec.stats.extra["loops_per_token"]


def test_cli_with_a_trained_drafter(tmp_path):
    """train_lad for the tiny_ouro preset (random weights, a few steps), then
    `--method=loopahead --lad=<workdir>` emits plain decoding's tokens, and samples with
    `--temperature`; the same drafter is refused for a model of another shape."""
    import dataclasses  # noqa: PLC0415
    import json  # noqa: PLC0415

    from test_cli import assert_error, run_inproc  # noqa: PLC0415
    from train_lad import config as lad_config  # noqa: PLC0415
    from train_lad.main import run as train_lad_run  # noqa: PLC0415
    cfg = dataclasses.replace(
        lad_config.get("tiny_ouro"), model_ckpt="random", hidden_size=32, num_layers=1,
        num_heads=2, draft_vocab=128, prompt_len=8, continuation=8, num_train=16, num_dev=4,
        num_confirm=4, prompt_source="random", batch_size=8, steps=2, eval_every=2)
    lad = tmp_path / "lad"
    train_lad_run(cfg, lad, progress_bar=False, log=lambda m: None)
    outs = {}
    for method, extra in (("ar", {}), ("loopahead", {"lad": str(lad)})):
        path = tmp_path / f"{method}.json"
        res = run_inproc(config="tiny_ouro", ckpt="random", prompt_ids="5,6,7,8,9",
                         method=method, max_new_tokens=8, json_out=str(path), **extra)
        assert res.returncode == 0, res.stderr
        with open(path) as f:
            outs[method] = json.load(f)["results"][0]
    assert outs["loopahead"]["tokens"] == outs["ar"]["tokens"]
    assert outs["loopahead"]["stats"]["extra"]["K"] == 3
    path = tmp_path / "sampled.json"  # sampling with the drafter
    res = run_inproc(config="tiny_ouro", ckpt="random", prompt_ids="5,6,7,8,9",
                     method="loopahead", lad=str(lad), temperature=0.8, top_p=0.9, seed=3,
                     max_new_tokens=8, json_out=str(path))
    assert res.returncode == 0, res.stderr
    with open(path) as f:
        assert len(json.load(f)["results"][0]["tokens"]) == 8
    assert_error(run_inproc(config="tiny_raven", ckpt="random", prompt_ids="1,2",
                            method="loopahead", lad=str(lad)), "does not match", "family")
