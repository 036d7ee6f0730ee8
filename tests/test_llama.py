"""The model's seams: an arbitrary mask over [cache | new tokens], the explicit K/V commit,
and the shared output buffer (EOS ids, max_new_tokens)."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lookahead_jax.generation import Output, prefill
from models import KVCache, Llama, LlamaConfig, NewKV, causal_mask
from models.families import config_from_hf

CFG = LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=96, num_layers=2,
                  num_heads=6, num_kv_heads=2, rope_theta=10000.0)


@pytest.fixture(scope="module")
def model():
    return Llama(CFG, rngs=nnx.Rngs(3))


def _prefilled(model, prefix):
    cache = model.init_cache(1, 32)
    _, cache = prefill(model, jnp.asarray([prefix]), jnp.asarray([len(prefix)]), cache)
    return cache


def test_two_branches_in_one_pass_equal_each_branch_alone(model):
    prefix, a, b = [5, 17, 3, 44, 8, 61], [9, 12, 70, 2], [33, 4, 90]
    cache = _prefilled(model, prefix)
    p = len(prefix)
    # one pass over [a | b]: both branches continue the prefix, neither sees the other
    toks = jnp.asarray([a + b])
    pos = jnp.asarray([list(range(p, p + len(a))) + list(range(p, p + len(b)))])
    t = len(a) + len(b)
    branch = np.array([0] * len(a) + [1] * len(b))
    idx = np.arange(t)
    new = (branch[:, None] == branch[None, :]) & (idx[None, :] <= idx[:, None])
    mask = jnp.concatenate([jnp.broadcast_to(cache.visible()[:, None], (1, t, cache.max_len)),
                            jnp.asarray(new)[None]], axis=-1)
    both, kv_both = model(toks, pos, mask, cache)
    # a plain causal mask over the same tokens must give different logits for branch b
    causal, _ = model(toks, pos, causal_mask(jnp.asarray([t]), t, cache), cache)
    assert float(jnp.abs(causal[:, len(a):] - both[:, len(a):]).max()) > 1e-3
    for start, branch_toks in ((0, a), (len(a), b)):
        n = len(branch_toks)
        alone, kv_alone = model(jnp.asarray([branch_toks]), jnp.arange(p, p + n)[None],
                                causal_mask(jnp.asarray([n]), n, cache), cache)
        np.testing.assert_allclose(both[:, start:start + n], alone, atol=1e-5)
        np.testing.assert_allclose(kv_both.k[:, :, start:start + n], kv_alone.k, atol=1e-5)


def test_committing_chosen_tokens_equals_decoding_them(model):
    """Compute 3 speculative tokens, commit only 2 of them (from their own K/V), then the next
    token's logits equal a causal run over prefix + those 2 tokens."""
    prefix, spec = [5, 17, 3, 44], [9, 12, 70]
    cache = _prefilled(model, prefix)
    n = len(spec)
    _, kv = model(jnp.asarray([spec]), jnp.arange(4, 4 + n)[None],
                  causal_mask(jnp.asarray([n]), n, cache), cache)
    cache = cache.append(kv, jnp.asarray([[0, 1, 2]]), jnp.asarray([2]))
    assert int(cache.length[0]) == 6
    nxt, _ = model(jnp.asarray([[77]]), jnp.asarray([[6]]),
                   causal_mask(jnp.asarray([1]), 1, cache), cache)
    full = prefix + spec[:2] + [77]
    ref, _ = model(jnp.asarray([full]), jnp.arange(len(full))[None],
                   causal_mask(jnp.asarray([len(full)]), len(full)))
    np.testing.assert_allclose(nxt[:, 0], ref[:, -1], atol=1e-5)


def test_cache_write_drops_out_of_range_slots():
    kv = NewKV(jnp.arange(12.0).reshape(1, 2, 3, 1, 2), jnp.zeros((1, 2, 3, 1, 2)))
    out = KVCache.init(1, 2, 4, 1, 2).replace(length=jnp.asarray([3, 0]))
    out = out.append(kv, jnp.asarray([[0, 1], [2, 0]]), jnp.asarray([2, 1]))
    assert out.length.tolist() == [5, 1]
    # the cache is head-major: out.k[layer, row, head, slot]
    np.testing.assert_array_equal(out.k[0, 0, 0, 3], kv.k[0, 0, 0, 0])  # slot 4 dropped
    np.testing.assert_array_equal(out.k[0, 1, 0, 0], kv.k[0, 1, 2, 0])
    np.testing.assert_array_equal(out.k[0, 1, :, 1:], 0)


def test_output_stops_at_any_eos_id_and_at_max_new_tokens():
    out = Output.init(3, 5)
    new = jnp.asarray([[4, 8, 6, 1], [4, 9, 6, 1], [4, 5, 6, 1]])
    out, taken = out.emit(new, jnp.asarray([4, 4, 2]), eos_ids=(8, 9))
    assert taken.tolist() == [2, 2, 2]
    assert out.done.tolist() == [True, True, False]
    out, taken = out.emit(new, jnp.asarray([4, 4, 4]), eos_ids=(8, 9))
    assert taken.tolist() == [0, 0, 3]  # done rows take nothing; row 2 stops at 5 tokens
    assert out.tokens[2].tolist() == [4, 5, 4, 5, 6] and out.done.tolist() == [True] * 3


def test_mistral_sliding_window_is_read_not_capped():
    """The window is implemented (`models.layers.in_window`), so positions keep their range."""
    cfg = config_from_hf(dict(model_type="mistral", vocab_size=10, hidden_size=8,
                                   intermediate_size=16, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1,
                                   max_position_embeddings=32768, sliding_window=4096))
    assert cfg.max_position_embeddings == 32768
    assert cfg.family == "mistral" and cfg.sliding_window == 4096
    assert cfg.layer_kinds == ("sliding",)
