"""The candidate tree's forward (`loop_advance`): tokens of one branch held at different
depths, or advanced together at equal depths (a drafted chain), read out at every depth equal
to the no-cache forward of the same sequence; a sibling branch does not leak into another; the
root's K/V committed from its scratch position serves the tokens after it. Ouro and Raven."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lookahead_jax.looped.tree import LoopTree, commit_root, loop_advance, prefill_all_depths
from models.build import build_looped
from test_looped import CONFIGS, _perturb_norms  # noqa: E402

PROMPT = [5, 9, 11, 3, 4]
CHAIN = [17, 23, 31, 40]  # tokens after the prompt, one per position


@pytest.fixture(scope="module", params=list(CONFIGS))
def model(request):
    return _perturb_norms(build_looped(CONFIGS[request.param], rngs=nnx.Rngs(2)))


@pytest.fixture(scope="module")
def reference(model):
    """Readouts [R, T, V] of prompt + CHAIN at every depth (no cache)."""
    seq = jnp.asarray([PROMPT + CHAIN])
    return np.asarray(model.loop_logits(seq, jnp.arange(seq.shape[1])[None])[0][:, 0])


@pytest.fixture(scope="module")
def step(model):
    graphdef, params = nnx.split(model)
    r_full = model.config.num_loops
    depths = tuple(range(1, r_full + 1))

    @jax.jit
    def f(params, tree, cache, run):
        return loop_advance(nnx.merge(graphdef, params), tree, cache, jnp.ones((1,), bool),
                            depths, run)
    return lambda tree, cache, run: f(params, tree, cache, run)


def _start(model, capacity=6):
    cache = model.init_cache(1, 32)
    tokens = jnp.asarray([PROMPT + [0] * (16 - len(PROMPT))])
    _, cache = prefill_all_depths(model, tokens, jnp.asarray([len(PROMPT)]), cache,
                                  tuple(range(1, model.config.num_loops + 1)))
    tree = LoopTree.init(jnp.asarray([CHAIN[0]]), jnp.asarray([len(PROMPT)]), capacity,
                         model.config.hidden_size, jnp.float32, 1)
    return tree, cache


def _spawn_chain(tree, parent_slot, tokens):
    """A chain below parent_slot: token i's parent is token i-1's slot."""
    slot = parent_slot
    q = jnp.zeros((1, tree.capacity, 1))
    for tok in tokens:
        want = jnp.arange(tree.capacity)[None] == slot
        tree, _ = tree.spawn(want, jnp.full((1, tree.capacity), tok), q)
        slot = int(jnp.argmax(tree.valid & (tree.parent == slot) & (tree.token == tok)))
    return tree


def _check(tree, logits, active, reference, where):
    for i in np.nonzero(np.asarray(active[0]))[0]:
        d = int(tree.depth[0, i])
        t = int(tree.pos[0, i])
        np.testing.assert_allclose(np.asarray(logits[0, i]), reference[d - 1, t], atol=2e-5,
                                   err_msg=f"{where}: slot {i} pos {t} depth {d}")


def test_chain_at_equal_depths(model, step, reference):
    """Root and a drafted chain of 3 start together and advance as one block to full depth."""
    tree, cache = _start(model)
    tree = _spawn_chain(tree, 0, CHAIN[1:])
    every = jnp.ones((1, tree.capacity), bool)
    for r in range(model.config.num_loops):
        tree, cache, logits, active = step(tree, cache, every)
        assert int(active.sum()) == 4
        _check(tree, logits, active, reference, f"loop {r}")


def test_pipeline_commit_and_siblings(model, step, reference):
    """The root runs 2 loops alone; then a child chain starts (the root deeper), a wrong
    sibling branch runs beside it; the root commits at full depth (its K/V copied to the
    cache) and the chain continues, still exact."""
    r_full = model.config.num_loops
    tree, cache = _start(model)
    only_root = jnp.arange(tree.capacity)[None] == 0
    for _ in range(2):
        tree, cache, logits, active = step(tree, cache, only_root)
        _check(tree, logits, active, reference, "root alone")
    tree = _spawn_chain(tree, 0, CHAIN[1:3])
    tree = _spawn_chain(tree, 0, [77, 78])  # a sibling branch with other tokens
    wrong = np.asarray(tree.valid & (tree.token >= 77))[0]
    every = jnp.ones((1, tree.capacity), bool)
    for r in range(2 * r_full):
        tree, cache, logits, active = step(tree, cache, every)
        right = jnp.asarray(~wrong)[None] & active
        _check(tree, logits, right, reference, f"step {r}")
        root = int(tree.root[0])
        if int(tree.depth[0, root]) == r_full:
            done = jnp.asarray([True])
            cache = commit_root(cache, tree, done)
            nxt = int(jnp.argmax(tree.valid & (tree.parent == root) & (tree.token < 77)))
            tree = tree.keep_subtree(done, jnp.asarray([nxt]))
            wrong = wrong & np.asarray(tree.valid)[0]
        if not bool(tree.valid.any()) or int(cache.length[0]) == len(PROMPT) + 3:
            break
    assert int(cache.length[0]) == len(PROMPT) + 3  # the root and the chain all committed
