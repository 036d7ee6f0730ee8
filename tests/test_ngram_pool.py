"""The on-device n-gram pool against a plain Python model of it.

Python model: per batch row, per bucket (key % K), a list of n-grams oldest first. Inserting an
n-gram already in its bucket moves it to the newest end; otherwise it is appended and the
oldest is evicted beyond C slots. Lookup(token) returns the bucket's n-grams whose key is
`token`, newest first, up to G. With K = V (direct-indexed) a bucket is one key; with K < V
(hashed) the keys of a bucket share its C slots, which the model reproduces exactly.
Also: prompt_ngrams and committed_ngrams against Python slicing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lookahead_jax.lookahead.ngram_pool import NGramPool, committed_ngrams, prompt_ngrams


class PyPool:
    def __init__(self, batch: int, keys: int, slots: int):
        self.keys, self.slots = keys, slots
        self.rows = [dict() for _ in range(batch)]  # bucket -> [n-gram tuples], oldest first

    def insert(self, b: int, gram: tuple):
        bucket = self.rows[b].setdefault(gram[0] % self.keys, [])
        if gram in bucket:
            bucket.remove(gram)
        bucket.append(gram)
        if len(bucket) > self.slots:
            bucket.pop(0)

    def lookup(self, b: int, token: int, g: int) -> list[tuple]:
        bucket = self.rows[b].get(token % self.keys, [])
        return [gram[1:] for gram in reversed(bucket) if gram[0] == token][:g]

    def bucket(self, b: int, k: int) -> list[tuple]:
        return list(self.rows[b].get(k, []))


_insert = jax.jit(lambda pool, grams, valid: pool.insert(grams, valid))
_lookup = jax.jit(lambda pool, token, g: pool.lookup(token, g), static_argnums=2)
_lookup_all = jax.jit(lambda pool, tokens, g: jax.vmap(lambda t: pool.lookup(t, g), in_axes=1,
                                                       out_axes=1)(tokens), static_argnums=2)


def _pool_buckets(pool: NGramPool, b: int, k: int) -> list[tuple]:
    """The device pool's bucket k of row b as a Python list, oldest first."""
    grams = np.asarray(pool.grams[b, k])
    stamp = np.asarray(pool.stamp[b, k])
    order = [s for s in np.argsort(stamp, kind="stable") if stamp[s] >= 0]
    return [tuple(int(x) for x in grams[s]) for s in order]


def _check(pool: NGramPool, ref: PyPool, vocab: int, gs: tuple[int, ...]):
    b_rows = pool.grams.shape[0]
    for b in range(b_rows):
        for k in range(ref.keys):
            assert _pool_buckets(pool, b, k) == ref.bucket(b, k), (b, k)
    tokens = jnp.broadcast_to(jnp.arange(vocab, dtype=jnp.int32)[None], (b_rows, vocab))
    for g in gs:
        cands, valid = _lookup_all(pool, tokens, g)  # [B, V, g, N-1], [B, V, g]
        cands, valid = np.asarray(cands), np.asarray(valid)
        for b in range(b_rows):
            for t in range(vocab):
                want = ref.lookup(b, t, g)
                n = len(want)
                assert valid[b, t].tolist() == [True] * n + [False] * (g - n), (b, t, g)
                got = [tuple(int(x) for x in c) for c in cands[b, t, :n]]
                assert got == want, (b, t, g)


@pytest.mark.parametrize("vocab,keys,slots,n", [
    (10, 10, 3, 3),   # direct-indexed: one bucket per token id
    (10, 4, 3, 3),    # hashed: tokens 0, 4, 8 share bucket 0 and its 3 slots
    (7, 7, 1, 2),     # one slot, N=2 (bigrams)
    (12, 5, 4, 4),    # hashed, 4 slots, N=4
])
def test_insert_lookup_dedup_evict_match_python_model(vocab, keys, slots, n):
    rng = np.random.default_rng(vocab * 1000 + keys * 10 + slots)
    batch, per_call = 2, 6
    pool = NGramPool.init(batch, keys, slots, n)
    ref = PyPool(batch, keys, slots)
    assert pool.nbytes == batch * keys * slots * (n + 1) * 4
    seen_refresh = seen_evict = seen_shared = 0
    for _ in range(25):
        # keys from the whole vocab, continuations from a tiny alphabet: many repeats
        grams = np.concatenate([rng.integers(0, vocab, (batch, per_call, 1)),
                                rng.integers(0, 2, (batch, per_call, n - 1))], axis=-1)
        valid = rng.random((batch, per_call)) < 0.8
        for b in range(batch):
            for m in range(per_call):
                if valid[b, m]:
                    gram = tuple(int(x) for x in grams[b, m])
                    bucket = ref.bucket(b, gram[0] % keys)
                    seen_refresh += gram in bucket
                    seen_evict += gram not in bucket and len(bucket) == slots
                    seen_shared += any(other[0] != gram[0] for other in bucket)
                    ref.insert(b, gram)
        pool = _insert(pool, jnp.asarray(grams, jnp.int32), jnp.asarray(valid))
        _check(pool, ref, vocab, gs=(slots,) if slots == 1 else (slots, slots - 1))
    # the random stream really exercised re-seen n-grams, eviction and (hashed) shared buckets
    assert seen_refresh > 0 and seen_evict > 0
    assert (seen_shared > 0) == (keys < vocab)
    # rows are independent: the two rows' contents differ
    assert any(ref.bucket(0, k) != ref.bucket(1, k) for k in range(keys))


def test_rows_are_independent_and_invalid_inserts_do_nothing():
    pool = NGramPool.init(2, 8, 2, 3)
    grams = jnp.asarray([[[1, 2, 3], [1, 4, 5]], [[1, 6, 7], [1, 2, 3]]], jnp.int32)
    pool = _insert(pool, grams, jnp.asarray([[True, False], [True, True]]))
    c, v = _lookup(pool, jnp.asarray([1, 1], jnp.int32), 2)
    assert np.asarray(v).tolist() == [[True, False], [True, True]]
    assert np.asarray(c)[0, 0].tolist() == [2, 3]
    assert np.asarray(c)[1].tolist() == [[2, 3], [6, 7]]  # newest first
    # re-inserting [1, 6, 7] in row 1 makes it the newest again; row 0 unaffected
    pool = _insert(pool, jnp.asarray([[[0, 0, 0]], [[1, 6, 7]]], jnp.int32),
                   jnp.asarray([[False], [True]]))
    c, v = _lookup(pool, jnp.asarray([1, 1], jnp.int32), 2)
    assert np.asarray(c)[1].tolist() == [[6, 7], [2, 3]]
    assert np.asarray(v)[0].tolist() == [True, False] and np.asarray(c)[0, 0].tolist() == [2, 3]
    # a key whose bucket is empty, or holds only other keys (hashed), finds nothing
    c, v = _lookup(pool, jnp.asarray([9, 0], jnp.int32), 2)  # 9 % 8 == 1: bucket of key 1
    assert not np.asarray(v).any()


# ---------------------------------------------------------------- prompt / committed ---

@pytest.mark.parametrize("n", [2, 3, 5])
def test_prompt_ngrams_match_python_slicing(n):
    rng = np.random.default_rng(n)
    lengths = np.array([1, 6, 9, n], np.int32)
    tokens = rng.integers(0, 50, (4, 9)).astype(np.int32)
    grams, valid = prompt_ngrams(jnp.asarray(tokens), jnp.asarray(lengths), n)
    grams, valid = np.asarray(grams), np.asarray(valid)
    assert grams.shape == (4, 9 - n + 1, n) and valid.shape == (4, 9 - n + 1)
    for b in range(4):
        want = [tokens[b, m:m + n].tolist() for m in range(lengths[b] - n + 1)]
        got = [grams[b, m].tolist() for m in range(grams.shape[1]) if valid[b, m]]
        assert got == want
        assert valid[b].tolist() == sorted(valid[b].tolist(), reverse=True)  # a valid prefix


def test_prompt_ngrams_prompt_shorter_than_n():
    grams, valid = prompt_ngrams(jnp.zeros((2, 3), jnp.int32), jnp.asarray([3, 2]), 5)
    assert grams.shape == (2, 0, 5) and valid.shape == (2, 0)


@pytest.mark.parametrize("n", [2, 3, 5])
def test_committed_ngrams_match_python_slicing(n):
    """Feed random emissions step by step; every n-gram of the committed stream that ends at a
    newly committed token comes out exactly once, in order; the history tracks the stream."""
    rng = np.random.default_rng(10 + n)
    n1 = n - 1
    batch, e_max = 3, n + 1
    stream = [list(rng.integers(0, 30, rng.integers(0, n1 + 1))) for _ in range(batch)]
    hist_len = np.array([len(s) for s in stream], np.int32)
    history = np.zeros((batch, n1), np.int32)
    for b, s in enumerate(stream):  # right-aligned, junk (99) on the left
        history[b] = [99] * (n1 - len(s)) + s
    fn = jax.jit(committed_ngrams)
    h, hl = jnp.asarray(history), jnp.asarray(hist_len)
    for _ in range(8):
        emitted = rng.integers(0, 30, (batch, e_max)).astype(np.int32)
        n_emit = rng.integers(0, e_max + 1, batch).astype(np.int32)
        grams, valid, h, hl = fn(h, hl, jnp.asarray(emitted), jnp.asarray(n_emit))
        grams, valid = np.asarray(grams), np.asarray(valid)
        assert grams.shape == (batch, e_max, n)
        for b in range(batch):
            before = len(stream[b])
            stream[b] += emitted[b, : n_emit[b]].tolist()
            want = [stream[b][end - n + 1: end + 1] for end in range(before, len(stream[b]))
                    if end - n + 1 >= 0]
            got = [grams[b, j].tolist() for j in range(e_max) if valid[b, j]]
            assert got == want
            assert not valid[b, n_emit[b]:].any()
            k = int(np.asarray(hl)[b])
            assert k == min(len(stream[b]), n1)
            assert np.asarray(h)[b, n1 - k:].tolist() == stream[b][len(stream[b]) - k:]
