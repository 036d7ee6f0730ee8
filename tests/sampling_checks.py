"""Sampling exactness over whole generations: the test models, the checks and the planted faults.

The first-step tests (test_lookahead_sampling, test_loopspec, test_loopahead_sampling,
test_prompt_lookup) enumerate the exact joint distribution of the first three tokens. Later
steps bring in what the first cannot: the window and the pool filled by earlier steps, the PRNG
key carried from step to step, per-row commits in a batch of rows at different positions, and
(LoopAhead) branches suspended in one step and verified in a later one. Checking them needs the
exact distribution of a whole generation, which these models make computable.

**Markov models.** A model whose next-token logits depend on the current token alone generates
a Markov chain. With the warped transition matrix P (P[a] = the `Sampling`-warped distribution
after token a), the exact distribution of new token t after a prompt ending in token a is
m_t = e_a P^(t+1), and of the adjacent pair (t, t+1) it is m_t[x] P[x, y]: everything the
checks below compare with is computed, not estimated.
  * `markov_llama`: one Llama layer whose attention and MLP outputs are zero (o_proj, down_proj),
    one-hot embeddings and an LM head that gives exactly `markov_logits()`: after token a the
    likeliest next tokens are a+1 (about 2/3 of the mass at T = 1), a+3 and a+5 (mod V), the
    rest far less likely. The greedy path a, a+1, a+2, ... is what the lookahead window guesses
    and what the prompts repeat, so candidates are accepted at most steps and rejected at some.
  * `markov_ouro`: a 3-loop Ouro whose attention outputs are zero, so every loop transforms each
    position's state alone; its LM head is fitted so that the full-depth readout gives exactly
    `markov_logits()`. Earlier depths read out other distributions, so LoopSpec's and
    LoopAhead's drafts are often accepted and often rejected.
  * `markov_llama(attention=...)` with its attention output switched back on: the next token
    then depends on the whole context (no exact distribution), for two-sample tests against
    plain sampling.

**Batches mixing prompt lengths.** Rows alternate between `PROMPTS[0]` (11 tokens, ends in 2)
and `PROMPTS[1]` (18 tokens, ends in 6). The rows of each prompt are checked against their own
exact distributions, and the pairs of neighbouring rows (2i, 2i+1) for independence: the joint
of their tokens at the same position, and at positions t and t+1, against the product of the
exact marginals. Shared random numbers between rows, or one row committing another's tokens,
show there.

**The checks and their threshold.** `exact_checks` makes 6T - 3 Pearson chi-square tests of one
run of T new tokens (each prompt's T positions and T - 1 adjacent pairs, T same-position and
T - 1 next-position row pairs); cells expecting fewer than 5 are pooled. A run passes when its
smallest p-value is above `threshold(checks)`: Bonferroni over its checks and over the
`FAMILY` of runs of the real implementations, so that a correct implementation fails any of
them with probability at most `FAMILY_ALPHA` = 1%. A planted fault is caught when its run's
smallest p-value is below the same threshold: the test as the real implementation runs it
would fail.

**Planted faults** (`planted`): the method's own step with hooks (its verifier, its key, its
feedback) that an index switches to a fault; the index travels as a traced parameter, so one
compiled program, about the size of the method's own, runs every fault:
  * `Fault(reuse_key=True)`: every step draws with the previous step's key (the new key is
    dropped);
  * `Fault(verifier=wrong, when=...)`: the rows and steps where `when(state)` holds are
    decided by a wrong verifier: one that skips the residual update after a rejection
    (`wrong_verdict("no_residual")`, `cascade(keep_target=True)`) or commits the next row's
    candidate (`next_rows_candidate`, `next_rows_draft`);
  * `Fault(stale_branches=True)` (`StaleLoopAhead`): LoopAhead's children paused by feedback
    carry, from then on, their parent's depth-r2 distribution (current when the branch was
    suspended) instead of the distribution their token was drawn from, so the branch is
    verified against a stale q.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from scipy import stats

from lookahead_jax.looped.loopahead import LoopAhead
from lookahead_jax.looped.spec_sampling import residual_after, verify_drafts
from lookahead_jax.lookahead.verify import Verdict, sampling_verdict, token_validity
from lookahead_jax.method import Method
from lookahead_jax.sampling import Sampling
from models.build import build_looped
from models.config import LlamaConfig, LoopedConfig
from models.llama import Llama


V = 8
PROMPTS = ([0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2],
           [3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 6])

FAMILY_ALPHA = 0.01
# every run of a real implementation checked against the threshold: the family of tests
SETTINGS = ("t1", "t1.5_topk2", "t1_topp0.95")
EXACT_METHODS = ("lookahead", "lookahead_unseeded", "prompt_lookup", "parallel", "loopspec",
                 "loopahead", "loopahead_suspending")
TWO_SAMPLE = ("lookahead_vs_plain/t1", "prompt_lookup_vs_plain/t1")
FAMILY = tuple(f"{m}/{s}" for m in EXACT_METHODS for s in SETTINGS) + TWO_SAMPLE


def sampling(name: str) -> Sampling:
    """The sampling settings of the family: temperature 1; temperature 1.5 with top-k 2 (two
    tokens left, the second made likelier); top-p 0.95 (three tokens left)."""
    return {"t1": Sampling(1.0), "t1.5_topk2": Sampling(1.5, top_k=2),
            "t1_topp0.95": Sampling(1.0, top_p=0.95)}[name]


def prompts(rows: int) -> list[list[int]]:
    return [list(PROMPTS[r % 2]) for r in range(rows)]


# ------------------------------------------------------------------ models ---

def markov_logits() -> np.ndarray:
    """[V, V] float32: after token a, a+1 gets logit 3, a+3 logit 2, a+5 logit 1, others -4."""
    logits = np.full((V, V), -4.0, np.float32)
    for a in range(V):
        for step, value in ((1, 3.0), (3, 2.0), (5, 1.0)):
            logits[a, (a + step) % V] = value
    return logits


def markov_llama(attention: float = 0.0, seed: int = 0) -> Llama:
    """The one-layer Markov Llama (see the module docstring); attention > 0 scales a random
    attention output projection in (the next token then depends on the context)."""
    hidden = 16
    cfg = LlamaConfig(vocab_size=V, hidden_size=hidden, intermediate_size=16, num_layers=1,
                      num_heads=2, num_kv_heads=1, eos_token_ids=())
    model = Llama(cfg, rngs=nnx.Rngs(seed))
    model.embed_tokens.embedding.set_value(jnp.eye(V, hidden, dtype=jnp.float32))
    for layer in model.layers:
        o = layer.self_attn.o_proj.kernel
        o.set_value(o.get_value() * attention)
        down = layer.mlp.down_proj.kernel
        down.set_value(jnp.zeros_like(down.get_value()))
    # the final RMSNorm turns one-hot e_a into sqrt(hidden) e_a
    head = np.zeros((hidden, V), np.float32)
    head[:V] = markov_logits() / np.sqrt(hidden)
    model.lm_head.kernel.set_value(jnp.asarray(head))
    return model


OURO = LoopedConfig(family="ouro", vocab_size=V, hidden_size=32, intermediate_size=48,
                    num_heads=4, num_kv_heads=2, num_loops=3, num_layers=1,
                    max_position_embeddings=128, eos_token_ids=())


def markov_ouro(loop_change: float = 1.0):
    """The 3-loop Markov Ouro (see the module docstring); loop_change scales the sandwich
    norms' weights (how much each loop changes a state: how far the early readouts are from
    the full-depth one)."""
    model = build_looped(OURO, rngs=nnx.Rngs(0))
    for layer in model.layers:
        o = layer.self_attn.o_proj.kernel
        o.set_value(jnp.zeros_like(o.get_value()))
        for norm in (layer.input_layernorm_2, layer.post_attention_layernorm_2):
            norm.weight.set_value(norm.weight.get_value() * loop_change)
    _, states = model.loop_states(jnp.arange(V)[:, None], jnp.zeros((V, 1), jnp.int32))
    final = np.asarray(states[-1][0][:, 0], np.float64)  # [V, E] the full-depth states
    head = np.linalg.lstsq(final, markov_logits().astype(np.float64), rcond=None)[0]
    model.lm_head.kernel.set_value(jnp.asarray(head, jnp.float32))
    return model


def next_token_logits(model, seqs: Sequence[Sequence[int]]) -> np.ndarray:
    """[len(seqs), V] logits after each sequence (full depth for a looped model), computed
    without a cache over the whole sequence."""
    t = max(len(s) for s in seqs)
    tokens = np.zeros((len(seqs), t), np.int32)
    for i, s in enumerate(seqs):
        tokens[i, :len(s)] = s
    last = np.array([len(s) - 1 for s in seqs])
    graphdef, params = nnx.split(model)
    return np.asarray(_last_logits(graphdef, params, jnp.asarray(tokens), jnp.asarray(last)))


@functools.partial(jax.jit, static_argnums=0)
def _last_logits(graphdef, params, tokens, last):
    model = nnx.merge(graphdef, params)
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))
    if hasattr(model, "loop_logits"):
        logits = model.loop_logits(tokens, positions)[0][-1]
    else:
        mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool))[None], (b, t, t))
        logits, _ = model(tokens, positions, mask, None)
    return logits[jnp.arange(b), last]


def transition(model, sampling: Sampling) -> np.ndarray:
    """[V, V] float64: the warped next-token distribution after each token alone."""
    logits = next_token_logits(model, [[a] for a in range(V)])
    return np.asarray(jax.nn.softmax(sampling.log_probs(jnp.asarray(logits)), -1), np.float64)


# ------------------------------------------------------------------ checks ---

@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    stat: float
    df: int
    p: float


def chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int, float]:
    """Pearson's test of counts against probs (same shape). Cells expecting < 5 are merged
    (into the smallest remaining cell if they still expect < 5 together). Returns the
    statistic, the degrees of freedom and the p-value (float64: down to about 1e-300)."""
    counts = counts.ravel().astype(np.float64)
    expected = probs.ravel() / probs.sum() * counts.sum()
    big = expected >= 5
    obs, exp = list(counts[big]), list(expected[big])
    if (~big).any():
        o, e = counts[~big].sum(), expected[~big].sum()
        if e >= 5 or not exp:
            obs.append(o)
            exp.append(e)
        else:
            i = int(np.argmin(exp))
            obs[i] += o
            exp[i] += e
    obs, exp = np.array(obs), np.array(exp)
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = len(obs) - 1
    return stat, df, float(stats.chi2.sf(stat, df)) if df else 1.0


def check(name: str, counts: np.ndarray, probs: np.ndarray) -> Check:
    """A chi-square check; a count where probs is 0 (a token top-k / top-p removes, or a pair
    the chain cannot make) fails it outright (p = 0)."""
    if counts[probs == 0].sum():
        return Check(name + " (outside the support)", float("inf"), 0, 0.0)
    return Check(name, *chi_square(counts[probs > 0], probs[probs > 0]))


def exact_checks(tokens: np.ndarray, P: np.ndarray) -> list[Check]:
    """The 6T - 3 checks of a run (see the module docstring). tokens [rows, T], rows
    alternating between PROMPTS[0] and PROMPTS[1]; P the warped transition matrix."""
    rows, t_new = tokens.shape
    pairs = rows // 2
    a, b = tokens[0: 2 * pairs: 2], tokens[1: 2 * pairs: 2]
    marg = {}
    out = []
    for g, (toks, prompt) in enumerate(((a, PROMPTS[0]), (b, PROMPTS[1]))):
        m = np.eye(V)[prompt[-1]]
        for t in range(t_new):
            m = m @ P
            marg[g, t] = m
            out.append(check(f"prompt {g} token {t}", np.bincount(toks[:, t], minlength=V), m))
            if t + 1 < t_new:
                pair = np.bincount(toks[:, t] * V + toks[:, t + 1], minlength=V * V)
                out.append(check(f"prompt {g} tokens {t},{t + 1}", pair.reshape(V, V),
                                 m[:, None] * P))
    for t in range(t_new):
        for lag in (0, 1):
            if t + lag < t_new:
                joint = np.bincount(a[:, t] * V + b[:, t + lag], minlength=V * V)
                out.append(check(f"rows 2i,2i+1 tokens {t},{t + lag}", joint.reshape(V, V),
                                 np.outer(marg[0, t], marg[1, t + lag])))
    return out


def homogeneity(name: str, a: np.ndarray, b: np.ndarray) -> Check:
    """Two-sample chi-square test that counts a and b (same cells) come from one distribution;
    cells with fewer than 10 counts in both samples together are pooled."""
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    small = (a + b) < 10
    table = np.stack([np.append(a[~small], a[small].sum()), np.append(b[~small], b[small].sum())])
    table = table[:, table.sum(0) > 0]
    if table.shape[1] < 2:
        return Check(name, 0.0, 0, 1.0)
    stat, p, df, _ = stats.chi2_contingency(table, correction=False)
    return Check(name, float(stat), int(df), float(p))


def two_sample_checks(x: np.ndarray, y: np.ndarray) -> list[Check]:
    """Two runs of the same prompts ([rows, T] each): for each prompt, the distributions of every
    position and adjacent pair compared (4T - 2 checks)."""
    out = []
    for g in (0, 1):
        xs, ys = x[g::2], y[g::2]
        for t in range(x.shape[1]):
            out.append(homogeneity(f"prompt {g} token {t}", np.bincount(xs[:, t], minlength=V),
                                   np.bincount(ys[:, t], minlength=V)))
            if t + 1 < x.shape[1]:
                out.append(homogeneity(
                    f"prompt {g} tokens {t},{t + 1}",
                    np.bincount(xs[:, t] * V + xs[:, t + 1], minlength=V * V),
                    np.bincount(ys[:, t] * V + ys[:, t + 1], minlength=V * V)))
    return out


def threshold(checks: Sequence[Check]) -> float:
    """The p-value below which one of a run's checks fails it: Bonferroni over the run's
    checks and the family's runs."""
    return FAMILY_ALPHA / len(FAMILY) / len(checks)


def worst(checks: Sequence[Check]) -> Check:
    return min(checks, key=lambda c: (c.p, -c.stat))


def power(c: Check, alpha: float) -> float:
    """The chance that a run like this one (same fault, same rows) fails check c at level
    alpha, with the noncentrality estimated from its statistic (stat - df)."""
    if not np.isfinite(c.stat):
        return 1.0
    crit = stats.chi2.isf(alpha, c.df)
    return float(stats.ncx2.sf(crit, c.df, max(c.stat - c.df, 1e-9)))


def report(run: str, checks: Sequence[Check], extra: str = "") -> str:
    """One line: the run (a `FAMILY` member, " + fault" for a planted one), its smallest
    p-value and the threshold."""
    assert run.split(" + ")[0] in FAMILY, f"{run} is not in the family the threshold counts"
    w = worst(checks)
    return (f"{run}: {len(checks)} checks, smallest p = {w.p:.3g} ({w.name}: chi2 {w.stat:.1f}, "
            f"df {w.df}), threshold {threshold(checks):.2g} {extra}")


# ------------------------------------------------------------------ planted faults ---

@dataclasses.dataclass(frozen=True)
class Fault:
    """A planted fault of the later steps (any of):
    verifier, when: the rows and steps where when(state) (a [B] or scalar bool, read before the
        step) holds are decided by the wrong `verifier` instead of the method's own; both see
        the same random numbers, so only the planted mistake differs;
    reuse_key: every step draws with the key the previous step drew with (the new one is
        dropped);
    stale_branches: LoopAhead's suspended branches are verified against a stale proposal
        distribution (`StaleLoopAhead`)."""

    verifier: Callable | None = None
    when: Callable | None = None
    reuse_key: bool = False
    stale_branches: bool = False


def at_step(k: int) -> Callable:
    """The k-th step after the prefill, in every row (state.steps counts the prefill)."""
    return lambda state: state.steps == k


def from_step(k: int) -> Callable:
    return lambda state: state.steps >= k


def at_verification(k: int) -> Callable:
    """Looped methods: the rows whose k-th full-depth verification (k = 1: the first) comes
    in this step (any later ones in the same step too)."""
    return lambda state: state.stats.verified == k - 1


def after_verification(k: int) -> Callable:
    return lambda state: state.stats.verified >= k


def _key(state):
    return state.inner.key if hasattr(state, "inner") else state.key


def _with_key(state, key):
    if hasattr(state, "inner"):  # ParallelState
        return state.replace(inner=state.inner.replace(key=key))
    return state.replace(key=key)


def _select_rows(use: jax.Array, wrong, right):
    """wrong where use ([B] or scalar) holds, else right, for pytrees of [B, ...] arrays."""
    return jax.tree.map(lambda w, r: jnp.where(use.reshape((-1,) + (1,) * (w.ndim - 1)), w, r),
                        wrong, right)


def planted(method: Method, faults: dict[str, Fault]) -> Callable[[str], Method]:
    """-> name -> `method` with the fault `name` planted ("none": none). The fault index is a
    parameter, not a setting: every returned method compares equal, so an Engine compiles one
    program, whose step is the method's own step with every fault's hooks switched by the
    index, and runs every fault with it."""
    base = type(method)
    names = ("none", *faults)

    def params(self):
        return {"inner": base.params(self), "fault": jnp.int32(self.fault)}

    def prepare(self, model, p):
        return {"inner": base.prepare(self, model, p["inner"]), "fault": p["fault"]}

    def start(self, model, p, first):
        return base.start(self, model, p["inner"], first)

    def step(self, model, p, state, *, eos_ids):
        on = {name: p["fault"] == names.index(name) for name in faults}
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(base)}
        wrong = [(on[n] & jnp.asarray(f.when(state)), f.verifier)
                 for n, f in faults.items() if f.verifier is not None]
        if wrong:
            right = fields["verifier"]

            def verifier(*args):
                out = right(*args)
                for use, fn in wrong:
                    out = _select_rows(use, fn(*args), out)
                return out

            fields["verifier"] = verifier
        stale = [on[n] for n, f in faults.items() if f.stale_branches]
        m = StaleLoopAhead(**fields, stale=stale[0]) if stale else base(**fields)
        new = type(m).step(m, model, p["inner"], state, eos_ids=eos_ids)
        for n, f in faults.items():
            if f.reuse_key:
                new = _with_key(new, jnp.where(on[n], _key(state), _key(new)))
        return new

    cls = dataclasses.make_dataclass(
        f"Planted{base.__name__}",
        [("fault", int, dataclasses.field(default=0, compare=False))],
        bases=(base,), frozen=True,
        namespace={"params": params, "prepare": prepare, "start": start, "step": step})
    fields = {f.name: getattr(method, f.name) for f in dataclasses.fields(base)}
    return lambda name: cls(**fields, fault=names.index(name))


# -- faulty verifiers (the library's procedures with one mistake each) -------------------------

def wrong_verdict(rule: str):
    """`sampling_verdict` (the library's procedure, restated) with one planted mistake:
    "no_residual": a rejected candidate token keeps its mass (no residual update), in the later
    trials of its position and in the final draw; "no_renorm": candidate c is accepted with
    its original P(c), not its probability under the residual renormalised after earlier
    rejections; "threshold": c is accepted exactly when P(c) > 0.2 (no randomness)."""
    assert rule in ("no_residual", "no_renorm", "threshold"), rule

    def verdict(key, sampling, logits_at, cands, valid, agree=None) -> Verdict:
        agree = agree or (lambda j, rep, decision: decision)
        b, g, n1 = cands.shape
        rows = jnp.arange(b)
        k_try, k_res = jax.random.split(key)
        u = jax.random.uniform(k_try, (b, n1, max(g, 1)))
        res_keys = jax.random.split(k_res, n1 + 1)
        tok_valid = token_validity(valid, n1)
        alive = tok_valid[:, :, 0]
        accepted = jnp.zeros((b,), jnp.int32)
        stopped = jnp.zeros((b,), bool)
        final = jnp.zeros((b,), jnp.int32)
        rep = jnp.zeros((b,), jnp.int32)
        for j in range(n1 if g else 0):
            active = ~stopped
            target = jax.nn.softmax(sampling.log_probs(logits_at(j, rep)), axis=-1)
            res = target
            decided = ~active
            token_j = jnp.zeros((b,), jnp.int32)
            for gi in range(g):
                c = cands[:, gi, j]
                seen = jnp.zeros((b,), bool)
                for gp in range(gi):
                    seen = seen | (alive[:, gp] & tok_valid[:, gp, j] & (cands[:, gp, j] == c))
                trial = alive[:, gi] & tok_valid[:, gi, j] & ~decided & ~seen
                if rule == "no_renorm":
                    accept = trial & (u[:, j, gi] < target[rows, c])
                elif rule == "threshold":
                    accept = trial & (target[rows, c] > 0.2)
                else:
                    accept = trial & (u[:, j, gi] < res[rows, c] / jnp.maximum(res.sum(-1), 1e-30))
                if rule != "no_residual":
                    res = jnp.where((trial & ~accept)[:, None], res.at[rows, c].set(0.0), res)
                token_j = jnp.where(accept, c, token_j)
                decided = decided | accept
            took = decided & active
            drawn = jax.random.categorical(res_keys[j], jnp.log(res), axis=-1).astype(jnp.int32)
            took, token_j = agree(j, rep, (took, jnp.where(took, token_j, drawn)))
            final = jnp.where(active & ~took, token_j, final)
            stopped = stopped | (active & ~took)
            accepted = accepted + took.astype(jnp.int32)
            alive = jnp.where(took[:, None],
                              alive & tok_valid[:, :, j] & (cands[:, :, j] == token_j[:, None]),
                              alive)
            rep = jnp.argmax(alive, axis=1).astype(jnp.int32)
        last = n1 if g else 0
        probs = jax.nn.softmax(sampling.log_probs(logits_at(last, rep)), axis=-1)
        drawn = jax.random.categorical(res_keys[n1], jnp.log(probs), axis=-1).astype(jnp.int32)
        _, drawn = agree(last, rep, (stopped, drawn))
        final = jnp.where(stopped, final, drawn)
        best = rep if g else jnp.zeros((b,), jnp.int32)
        base = cands[rows, best] if g else jnp.zeros((b, n1), jnp.int32)
        tokens = jnp.concatenate([base, jnp.zeros((b, 1), jnp.int32)], axis=1)
        tokens = jnp.where(jnp.arange(n1 + 1)[None, :] == accepted[:, None], final[:, None],
                           tokens)
        return Verdict(accepted, best, tokens, accepted + 1)

    verdict.__name__ = f"verdict_{rule}"
    return verdict


def next_rows_candidate(key, sampling, logits_at, cands, valid, agree=None) -> Verdict:
    """`sampling_verdict`, then the accepted tokens are taken from the next row's candidate
    (same index, same count): a commit that mixes up rows."""
    v = sampling_verdict(key, sampling, logits_at, cands, valid, agree)
    b, _, n1 = cands.shape
    other = jnp.roll(cands, -1, axis=0)[jnp.arange(b), v.best]  # [B, N-1]
    other = jnp.concatenate([other, jnp.zeros((b, 1), jnp.int32)], axis=1)
    return v.replace(tokens=jnp.where(jnp.arange(n1 + 1)[None] < v.accepted[:, None], other,
                                      v.tokens))


def single_device(verdict_fn):
    """A `sampling_verdict`-shaped procedure as a single-device `Verifier` (Lookahead's and
    PromptLookup's `verifier`: logits at the current token and at the candidates)."""

    def verify(key, sampling, logits0, cand_logits, cands, valid):
        rows = jnp.arange(cands.shape[0])
        return verdict_fn(key, sampling,
                          lambda j, rep: logits0 if j == 0 else cand_logits[rows, rep, j - 1],
                          cands, valid)

    verify.__name__ = verdict_fn.__name__
    return verify


def cascade(inverted: bool = False, keep_target: bool = False):
    """`verify_drafts` with a planted mistake: inverted, accept with min(1, q(x)/r(x)) instead
    of min(1, r(x)/q(x)); keep_target, no residual update: r stays p after a rejection (and the
    final draw comes from p) instead of normalize(max(r - q, 0))."""

    def verify(u, p, q, x, has, key):
        b, k_drafts = x.shape
        rows = jnp.arange(b)
        res = p
        which = jnp.full((b,), -1, jnp.int32)
        for k in range(k_drafts):
            trial = has[:, k] & (which < 0)
            r_x = res[rows, x[:, k]] / res.sum(-1)
            q_x = q[rows, k, x[:, k]]
            ratio = q_x / jnp.maximum(r_x, 1e-30) if inverted else r_x / q_x
            accept = trial & (u[:, k] < ratio)
            which = jnp.where(accept, k, which)
            if not keep_target:  # the right residual: the library's
                res = jnp.where((trial & ~accept)[:, None], residual_after(res, q[:, k]), res)
        drawn = jax.random.categorical(key, jnp.log(res), axis=-1).astype(jnp.int32)
        return which, jnp.where(which >= 0, x[rows, jnp.maximum(which, 0)], drawn)

    verify.__name__ = f"cascade_inverted{inverted}_keep_target{keep_target}"
    return verify


def next_rows_draft(u, p, q, x, has, key):
    """`verify_drafts`, then an accepted draft's token is the next row's draft of that kind."""
    which, token = verify_drafts(u, p, q, x, has, key)
    rows = jnp.arange(x.shape[0])
    other = jnp.roll(x, -1, axis=0)[rows, jnp.maximum(which, 0)]
    return which, jnp.where(which >= 0, other, token)


@dataclasses.dataclass(frozen=True)
class StaleLoopAhead(LoopAhead):
    """LoopAhead whose feedback, when it pauses a child, overwrites the child's q with the
    parent's depth-r2 distribution: a suspended branch is later verified (and, resumed,
    drafted after) with a stale proposal distribution instead of the one its token was
    drawn from. stale: whether the fault acts (a traced bool inside `planted`'s step)."""

    stale: Any = True

    def _feedback_sampling(self, tree, paused, probs, reads, at_r2, has_kid, key):
        new_tree, new_paused = super()._feedback_sampling(tree, paused, probs, reads, at_r2,
                                                          has_kid, key)
        now = new_paused & ~paused & tree.valid & self.stale  # [B, C] paused in this step
        b = tree.valid.shape[0]
        parent_probs = probs[jnp.arange(b)[:, None], jnp.maximum(tree.parent, 0)]  # [B, C, V]
        return new_tree.replace(q=jnp.where(now[..., None], parent_probs, new_tree.q)), new_paused
