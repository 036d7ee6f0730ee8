"""The Pallas lookahead attention kernel: its block map, exactness against the dense path (both
the GPU/Triton and the TPU/Mosaic kernels), block skipping, the platform checks, lowering for GPU
and TPU (the kernel alone, and a whole lookahead decode with it), a whole generation with it,
its two tools and the CLI flag.

Any host: each kernel runs compiled on the device where jax's default backend is its platform
(Triton on a GPU, Mosaic on a TPU) and in a Pallas interpreter otherwise, on the CPU
(`kernel_mode`, `kernel_device`). So a CPU host interprets both; a GPU host compiles the Triton
cases and interprets the Mosaic ones; a TPU host the other way round. The lowering tests name
their platform (`platform='cuda'` / `'tpu'`) and run everywhere: they lower for it, they run
nothing (no device compiler is needed).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental.pallas import tpu as pltpu

from lookahead_jax.lookahead.config import LookaheadConfig
from lookahead_jax.engine import _JITTED, Engine
from lookahead_jax.lookahead.layout import StepLayout
from lookahead_jax.lookahead.step import Lookahead
from lookahead_jax.sampling import Sampling
from models import ConfigError, KVCache, Llama, LlamaConfig, dot_product_attention
from pallas_kernels import block_stats as block_stats_mod
from pallas_kernels import gpu_bench
from pallas_kernels import lookahead_attention as la
from pallas_kernels.attention import KernelUnavailable, select_attention
from pallas_kernels.block_map import BlockMap
from pallas_kernels.platform import KERNEL_BACKENDS
from pallas_kernels.lookahead_attention import PallasAttention, lookahead_attention
from lookahead_jax.lookahead.mask import StepMask, dense_attention

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
HOST = jax.default_backend()  # 'cpu', 'gpu' or 'tpu'
HOST_BACKEND = KERNEL_BACKENDS.get(HOST)  # the kernel compiled on this host's device, if any


def qkv(layout: StepLayout, batch: int, cache_size: int, heads: int, kv_heads: int, dim: int,
        dtype, seed: int = 0):
    """Random q [B,T,H,D], the step's k, v [B,T,Hkv,D] and a cache layer's ck, cv [B,Hkv,S,D]."""
    rng = np.random.default_rng(seed)
    t = layout.size
    q = rng.normal(size=(batch, t, heads, dim))
    k, v = (rng.normal(size=(batch, t, kv_heads, dim)) for _ in range(2))
    ck, cv = (rng.normal(size=(batch, kv_heads, cache_size, dim)) for _ in range(2))
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v, ck, cv))


def kernel_mode(backend: str):
    """`interpret=` for the `backend` kernel on this host: False (compiled, run on the device)
    where jax's default backend is its platform (a GPU for 'triton', a TPU for 'mosaic_tpu'),
    else an interpreter: the TPU kernel runs in the TPU interpreter (TPU memory spaces and DMAs
    simulated, out-of-bounds reads raise), the Triton kernel in the generic Pallas
    interpreter."""
    if HOST in la.PLATFORM_OF[backend]:
        return False
    return pltpu.InterpretParams(out_of_bounds_reads="raise") if backend == "mosaic_tpu" else True


def kernel_blocks(backend: str, mode, block_q: int | None, block_k: int | None):
    """A case's tiles for `mode`. Interpreted, small tiles make small cases span several of
    them; compiled for a GPU, Triton needs tiles of at least 16 (a power of two)."""
    if mode is False and backend == "triton":
        return tuple(None if n is None else max(16, n) for n in (block_q, block_k))
    return block_q, block_k


@contextlib.contextmanager
def kernel_device(mode):
    """Where a test of the kernel runs, its inputs and reference included: an interpreted
    kernel on an accelerator host runs on the CPU (both Pallas interpreters are made for it;
    the TPU one drives the kernel through host callbacks), unless jax was started without
    it; else on the default device."""
    cpus = []
    if mode is not False and HOST != "cpu":
        with contextlib.suppress(RuntimeError):  # JAX_PLATFORMS without cpu
            cpus = jax.devices("cpu")
    with jax.default_device(cpus[0]) if cpus else contextlib.nullcontext():
        yield


def dense_reference(q, k, v, mask, ck, cv):
    """The dense path in float32 (bf16 inputs are upcast: the kernel accumulates in float32)."""
    q, k, v, ck, cv = (x.astype(jnp.float32) for x in (q, k, v, ck, cv))
    return dense_attention(q, k, v, mask, ck, cv)


# ------------------------------------------------------------------------- block map ---

def test_block_map_tiles_come_from_the_layout_mask():
    layout = StepLayout(15, 5, 15)  # T = 120: window rows 0..59, candidates 60..119
    bm = BlockMap(layout, group=1, block_q=32, block_k=32)
    assert (bm.rows_padded, bm.step_padded, bm.q_blocks, bm.step_blocks) == (128, 128, 4, 4)
    assert (bm.row_mask[:120, :120] == layout.mask).all() and not bm.row_mask[120:].any()
    # by hand: every query block sees key block 0 (the current token); window rows 32..59 also
    # see their own column at levels 1-2 (block 1); candidates 60..63 their own tokens (block
    # 1), 64..95 (block 2), 96..119 (block 3). Nobody sees across window/candidate blocks.
    assert bm.tiles.tolist() == [[True, False, False, False], [True, True, False, False],
                                 [True, False, True, False], [True, False, False, True]]
    index, count = bm.step_index
    assert count.tolist() == [1, 2, 2, 2]
    assert index.tolist() == [[0, 0], [0, 1], [0, 2], [0, 3]]
    assert bm.step_fetch.tolist() == [[0, 0, 0, 0], [0, 1, 1, 1], [0, 0, 2, 2], [0, 0, 0, 3]]
    c = bm.counts(512)
    assert (c["cache_blocks"]["computed"], c["step_blocks"]["computed"], c["skipped"]) == (64, 7, 9)
    c = bm.counts(500, cache_size=2048)  # 16 of 64 cache blocks per query block hold a key
    assert c["cache_blocks"] == {"computed": 64, "skipped": 192, "total": 256}


def test_block_map_groups_query_heads_into_rows():
    layout = StepLayout(2, 3, 1)  # T = 6
    bm = BlockMap(layout, group=4, block_q=8, block_k=4)
    assert bm.rows == 24 and bm.q_blocks == 3 and bm.step_blocks == 2
    for r in range(24):  # row r is token r // 4, for each of the group's 4 heads
        assert (bm.row_mask[r, :6] == layout.mask[r // 4]).all()
    want = bm.row_mask.reshape(3, 8, 2, 4).any(axis=(1, 3))
    assert (bm.tiles == want).all()
    with pytest.raises(ValueError):
        bm.counts(10, cache_size=5)


def test_step_mask_expands_to_the_dense_step_mask():
    layout = StepLayout(3, 3, 2)
    lens = jnp.asarray([0, 4, 9], jnp.int32)
    cache = KVCache.init(1, 3, 9, 1, 2).replace(length=lens)
    m = StepMask(lens, layout, 9)
    t = layout.size
    old = jnp.concatenate([jnp.broadcast_to(cache.visible()[:, None, :], (3, t, 9)),
                           jnp.broadcast_to(jnp.asarray(layout.mask)[None], (3, t, t))], -1)
    assert m.shape == (3, t, 9 + t) == m.dense().shape
    assert (np.asarray(m.dense()) == np.asarray(old)).all()
    # a pytree: cache lengths are data, the layout and the cache size are static
    leaves, tree = jax.tree.flatten(m)
    assert len(leaves) == 1 and jax.tree.unflatten(tree, leaves).layout == layout


# --------------------------------------------------------- exact against the dense path ---

# (W, N, G), cache lengths per row, cache slots S, heads, K/V heads, head dim, dtype, backend,
# block_q, block_k. Lengths include 0 and non-multiples of block_k; S is not always one either.
CASES = {
    "w3n3g2-gqa-f32-triton": ((3, 3, 2), [0, 5, 13], 20, 4, 2, 16, jnp.float32, "triton", 8, 8),
    "w3n3g2-gqa-f32-tpu": ((3, 3, 2), [0, 5, 13], 20, 4, 2, 16, jnp.float32, "mosaic_tpu", 8,
                           128),
    "w4n2g0-mha-f32-triton": ((4, 2, 0), [3, 17], 17, 2, 2, 8, jnp.float32, "triton", 4, 4),
    "w5n4g5-gqa4-f32-triton": ((5, 4, 5), [0, 16, 31], 32, 8, 2, 16, jnp.float32, "triton", 16,
                               16),
    "w2n4g3-mha-bf16-triton": ((2, 4, 3), [9, 1], 32, 2, 2, 16, jnp.bfloat16, "triton", None,
                               None),
    "w3n3g2-mqa-bf16-tpu": ((3, 3, 2), [0, 5, 130], 140, 4, 1, 16, jnp.bfloat16, "mosaic_tpu",
                            16, 128),
    "w1n2g0-f32-tpu": ((1, 2, 0), [0, 3], 5, 2, 2, 8, jnp.float32, "mosaic_tpu", None, None),
    # head dim 12: the Triton path zero-pads it to a power of two
    "w2n3g2-d12-f32-triton": ((2, 3, 2), [6, 0], 11, 4, 2, 12, jnp.float32, "triton", 8, 8),
}


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_equals_dense_reference(name):
    wng, lens, s, h, hkv, d, dtype, backend, bq, bk = CASES[name]
    mode = kernel_mode(backend)
    bq, bk = kernel_blocks(backend, mode, bq, bk)
    layout = StepLayout(*wng)
    with kernel_device(mode):
        q, k, v, ck, cv = qkv(layout, len(lens), s, h, hkv, d, dtype)
        mask = StepMask(jnp.asarray(lens, jnp.int32), layout, s)
        out = lookahead_attention(q, k, v, mask, ck, cv, backend=backend, interpret=mode,
                                  block_q=bq, block_k=bk)
        assert out.shape == q.shape and out.dtype == q.dtype
        ref = dense_reference(q, k, v, mask, ck, cv)
        err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)))
    print(f"\n{name} ({'compiled' if mode is False else 'interpreted'}): T={layout.size} "
          f"max abs err {err:.2e}")
    assert err <= TOL[dtype], err


@pytest.mark.parametrize("backend, bq, bk", [("triton", 8, 8), ("mosaic_tpu", 8, 128)])
def test_skipped_cache_blocks_are_never_read(backend, bq, bk):
    """NaN in every cache block past a row's length: a kernel that computed such a block would
    return NaN (0 * NaN); the kernel returns the clean dense result."""
    mode = kernel_mode(backend)
    bq, bk = kernel_blocks(backend, mode, bq, bk)
    layout = StepLayout(3, 3, 2)
    lens, s = [0, 5, 9], 300
    first_skipped = np.asarray([-(-n // bk) * bk for n in lens])
    poison = np.arange(s)[None, :] >= first_skipped[:, None]  # [B, S] cache slots
    with kernel_device(mode):
        q, k, v, ck, cv = qkv(layout, 3, s, 4, 2, 16, jnp.float32, seed=1)
        mask = StepMask(jnp.asarray(lens, jnp.int32), layout, s)
        ref = dense_reference(q, k, v, mask, ck, cv)
        ck_bad, cv_bad = (jnp.where(jnp.asarray(poison)[:, None, :, None], jnp.nan, x)
                          for x in (ck, cv))
        # the dense path reads every slot
        assert jnp.isnan(dense_attention(q, k, v, mask, ck_bad, cv_bad)).any()
        out = lookahead_attention(q, k, v, mask, ck_bad, cv_bad, backend=backend,
                                  interpret=mode, block_q=bq, block_k=bk)
        assert float(jnp.max(jnp.abs(out - ref))) <= 1e-5


def test_kernel_attention_fn_is_dense_for_other_masks():
    """Prefill and plain decoding pass dense masks: the same function serves them densely."""
    layout = StepLayout(2, 2, 0)
    q, k, v, ck, cv = qkv(layout, 2, 6, 2, 1, 8, jnp.float32)
    dense_mask = jnp.asarray(np.random.default_rng(2).random((2, 2, 8)) < 0.6)
    fn = PallasAttention("triton", interpret=True)
    assert (fn(q, k, v, dense_mask, ck, cv)
            == dot_product_attention(q, k, v, dense_mask, ck, cv)).all()
    assert hash(fn) == hash(PallasAttention("triton", interpret=True))  # a valid jit static


# --------------------------------------------------------------- platforms and lowering ---

def test_compiled_kernels_raise_off_their_platform():
    """A compiled kernel refuses a platform that is not its own: jax's default backend (for
    each kernel whose platform this host is not), or a platform named (on any host)."""
    layout = StepLayout(2, 2, 1)
    q, k, v, ck, cv = qkv(layout, 1, 4, 2, 2, 8, jnp.float32)
    mask = StepMask(jnp.asarray([2], jnp.int32), layout, 4)
    off_host = [b for b in la.BACKENDS if HOST not in la.PLATFORM_OF[b]]
    if not off_host:
        pytest.skip(f"every kernel's platform is this host's ({HOST!r})")
    for backend in off_host:
        with pytest.raises(KernelUnavailable, match="needs platform"):
            lookahead_attention(q, k, v, mask, ck, cv, backend=backend)
        with pytest.raises(KernelUnavailable):
            PallasAttention(backend)(q, k, v, mask, ck, cv)
    for backend, other in (("triton", "tpu"), ("mosaic_tpu", "cuda"), ("mosaic_tpu", "gpu"),
                           ("triton", "cpu")):
        with pytest.raises(KernelUnavailable, match=f"this is {other!r}"):
            lookahead_attention(q, k, v, mask, ck, cv, backend=backend, platform=other)
        with pytest.raises(KernelUnavailable, match="needs platform"):
            PallasAttention(backend, platform=other)  # a platform named is checked at once
    with pytest.raises(KernelUnavailable, match="GPU .* or TPU"):
        select_attention("pallas", "cpu")
    with pytest.raises(ConfigError, match="attention must be one of"):
        select_attention("flash", "gpu")


def test_pallas_attention_on_this_host():
    """'pallas' without a platform is this host's kernel: compiled on a GPU or TPU, and a
    clear KernelUnavailable on a host with neither."""
    cfg = LookaheadConfig(W=2, N=2, G=1)
    if HOST_BACKEND is None:
        with pytest.raises(KernelUnavailable, match="GPU .* or TPU"):
            select_attention("pallas")
        with pytest.raises(KernelUnavailable):
            Lookahead(config=cfg, attention="pallas")
        assert select_attention("auto") is dense_attention
    else:
        assert select_attention("pallas") == PallasAttention(HOST_BACKEND)
        assert select_attention("auto") == PallasAttention(HOST_BACKEND)
        assert Lookahead(config=cfg, attention="pallas").attention == "pallas"


def test_select_attention_by_platform():
    """A platform named is passed on to the compiled kernel (which is built for it on any
    host); interpreted, the platform only picks the kernel."""
    assert select_attention("dense", "gpu") is dense_attention
    assert select_attention("auto", "cpu") is dense_attention
    assert select_attention("auto", "gpu") == PallasAttention("triton", platform="gpu")
    assert select_attention("auto", "tpu") == PallasAttention("mosaic_tpu", platform="tpu")
    assert select_attention("pallas", "cuda") == PallasAttention("triton", platform="cuda")
    assert select_attention("pallas", "cpu", interpret=True) == PallasAttention(
        "triton", interpret=True)
    assert select_attention("pallas", "tpu", interpret=True) == PallasAttention(
        "mosaic_tpu", interpret=True)
    # interpreted, a platform is not checked (nor used)
    assert PallasAttention("triton", interpret=True, platform="tpu").platform == "tpu"
    assert Lookahead(config=LookaheadConfig(W=2, N=2, G=1), attention="auto").attention == "auto"


KERNEL_CALL = {"cuda": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}


@pytest.mark.parametrize("backend, platform", [("triton", "cuda"), ("mosaic_tpu", "tpu")])
def test_kernels_lower_for_their_platform(backend, platform):
    """Compiled (not interpreted), each kernel lowers at (15, 5, 15) with llama-7b-shaped heads,
    fp32 and bf16, to its platform's custom call: Triton IR for GPU, Mosaic for TPU; so do
    GQA heads and a head dim that is no power of two. (Lowering only, on any host: no device
    compiler runs.)"""
    layout = StepLayout(15, 5, 15)
    b, s = 2, 500
    for dtype, h, hkv, d in ((jnp.float32, 32, 32, 128), (jnp.bfloat16, 32, 32, 128),
                             (jnp.bfloat16, 32, 8, 128), (jnp.float32, 8, 2, 96)):
        exported = export_kernel(layout, b, s, h, hkv, d, dtype, backend, platform)
        assert KERNEL_CALL[platform] in exported.mlir_module()
        assert exported.out_avals[0].shape == (b, layout.size, h, d)


def export_for(fn, platform: str, *args):
    """`jax.export` of fn for `platform` ('cuda' or 'tpu'), the kernel's custom call allowed.
    Lowering the Triton kernel needs the target GPU's kind: JAX 0.12 reads it from the default
    device, so a host without a GPU names one (an H100) through an abstract mesh."""
    export = jax.export.export(
        fn, platforms=[platform],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(KERNEL_CALL[platform])])
    if platform != "cuda" or jax.default_backend() == "gpu":
        return export(*args)
    gpu = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=132, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), (jax.sharding.AxisType.Explicit,),
                                     abstract_device=gpu)
    with jax.sharding.use_abstract_mesh(mesh):
        return export(*args)


def export_kernel(layout: StepLayout, b: int, s: int, h: int, hkv: int, d: int, dtype,
                  backend: str, platform: str, block_q=None, block_k=None):
    """The compiled kernel for one step shape, exported for `platform`."""
    args = (jax.ShapeDtypeStruct((b, layout.size, h, d), dtype),
            jax.ShapeDtypeStruct((b, layout.size, hkv, d), dtype),
            jax.ShapeDtypeStruct((b, layout.size, hkv, d), dtype),
            jax.ShapeDtypeStruct((b, hkv, s, d), dtype),
            jax.ShapeDtypeStruct((b, hkv, s, d), dtype),
            jax.ShapeDtypeStruct((b,), jnp.int32))

    def f(q, k, v, ck, cv, lens):
        return lookahead_attention(q, k, v, StepMask(lens, layout, s), ck, cv, backend=backend,
                                   block_q=block_q, block_k=block_k, platform=platform)

    return export_for(jax.jit(f), platform, *args)


@pytest.mark.parametrize("name", list(CASES))
def test_exactness_cases_lower_compiled(name):
    """Each exactness case, with the tiles it gets where its kernel runs compiled
    (`kernel_blocks`), lowers for its platform: on a CPU host, a check that the GPU and TPU
    hosts' compiled cases are valid kernels."""
    wng, lens, s, h, hkv, d, dtype, backend, bq, bk = CASES[name]
    platform = {"triton": "cuda", "mosaic_tpu": "tpu"}[backend]
    bq, bk = kernel_blocks(backend, False, bq, bk)
    exported = export_kernel(StepLayout(*wng), len(lens), s, h, hkv, d, dtype, backend,
                             platform, bq, bk)
    assert KERNEL_CALL[platform] in exported.mlir_module()


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=0.7, top_p=0.9)],
                         ids=["greedy", "sampled"])
@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_whole_decode_with_the_kernel_exports(platform, sampling):
    """A whole lookahead decode with the compiled kernel, as the engine runs it (its jitted
    `init`: prefill and first token; then `run`: the `lax.while_loop` over the steps), lowers
    for a GPU and for a TPU from any host: every op of the decode has a lowering for the
    platform, the kernel's custom call sits in the loop, and the outputs are the dense
    decode's (the state's structure, shapes and dtypes). Lowering only: nothing runs."""
    target = KERNEL_CALL[platform]
    model = tiny_model()
    graphdef, model_params = nnx.split(model)
    max_new, eos = 8, (0,)

    def decoder(attention):
        method = Lookahead(sampling, config=LookaheadConfig(W=3, N=3, G=2), attention=attention)

        def decode(params, tokens, lengths, cache, key, max_steps):
            state = _JITTED["init"](method, graphdef, max_new, eos, params, tokens, lengths,
                                    cache, key)
            return _JITTED["run"](method, graphdef, eos, params, state, max_steps)
        return jax.jit(decode)

    args = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
        ({"model": model_params, "method": {}}, jnp.zeros((2, 5), jnp.int32),
         jnp.asarray([3, 5], jnp.int32), model.init_cache(2, 32, model.dtype),
         jax.random.key(0), jnp.int32(0)))
    kernel = select_attention("pallas", platform)
    assert kernel == PallasAttention(KERNEL_BACKENDS[platform], platform=platform)
    exported = export_for(decoder(kernel), platform, *args)
    mlir = exported.mlir_module()
    assert exported.platforms == (platform,)
    assert "stablehlo.while" in mlir and target in mlir
    # the prefill is dense: the first kernel call comes after the decode loop begins
    assert mlir.index("stablehlo.while") < mlir.index(target)
    want = jax.eval_shape(decoder("dense"), *args)
    assert exported.out_tree == jax.tree.structure(want)
    assert [(a.shape, a.dtype) for a in exported.out_avals] == [
        (a.shape, a.dtype) for a in jax.tree.leaves(want)]


# ------------------------------------------------------------------ whole generation ---

def tiny_model(seed: int = 0) -> Llama:
    """A tiny random Llama (GQA 4/2 heads, head dim 8) with scaled-up weights, so attention
    matters to its greedy choices."""
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, eos_token_ids=())
    model = Llama(cfg, rngs=nnx.Rngs(seed))
    for path, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Param) and path[-1] == "kernel":
            var.set_value(var.get_value() * 6)
    return model


def test_generation_with_the_kernel_is_token_identical():
    """Lookahead decoding with the kernel (this host's, compiled on a GPU or TPU; else the
    Triton kernel interpreted) emits exactly the dense path's tokens, for a batch whose rows
    have different cache lengths; both equal plain greedy decoding."""
    backend = HOST_BACKEND or "triton"
    mode = kernel_mode(backend)
    blocks = dict(block_q=8, block_k=8) if mode is not False else {}  # compiled: its defaults
    model = tiny_model()
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 64, n).tolist() for n in (3, 11)]
    cfg = LookaheadConfig(W=3, N=3, G=2)
    kw = dict(method="lookahead", lookahead=cfg, max_new_tokens=14, cache_len=48)
    dense = Engine(model).generate_ids(prompts, **kw)
    attention = select_attention("pallas", interpret=mode is not False, **blocks)
    assert attention.backend == backend
    kernel = Engine(model, attention=attention).generate_ids(prompts, **kw)
    plain = Engine(model).generate_ids(prompts, method="ar", max_new_tokens=14, cache_len=48)
    print(f"\nS dense {dense.stats.step_compression:.2f}, kernel "
          f"{kernel.stats.step_compression:.2f}, steps {kernel.stats.steps}")
    assert kernel.tokens == dense.tokens == plain.tokens
    assert kernel.stats.steps == dense.stats.steps
    assert [len(t) for t in kernel.tokens] == [14, 14]


# ---------------------------------------------------------------------------- tools ---

def run_module(module: str, *args: str):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=env, text=True,
                          capture_output=True, timeout=120)


def test_block_stats_tool():
    res = run_module("pallas_kernels.block_stats", "--W=15", "--N=5", "--G=15", "--cache_len=512",
                     "--block_q=32", "--block_k=32")
    assert res.returncode == 0, res.stderr
    lines = {ln.split()[0]: ln.split()[1:] for ln in res.stdout.splitlines()[3:]}
    assert lines["cache"] == ["64", "0", "64", "0.0%"]
    assert lines["step"] == ["7", "9", "16", "56.2%"]
    assert lines["all"] == ["71", "9", "80", "11.2%"]
    res = run_module("pallas_kernels.block_stats", "--W=15", "--N=5", "--G=15", "--cache_len=512",
                     "--cache_size=2048", "--json")
    st = json.loads(res.stdout)
    layout = StepLayout(15, 5, 15)
    bq, bk = la.default_blocks("triton", layout.size)
    assert (st["block_q"], st["block_k"]) == (bq, bk)
    assert st == {"W": 15, "N": 5, "G": 15, "backend": "triton",
                  **BlockMap(layout, 1, bq, bk).counts(512, 2048)}
    assert st["skipped_fraction"] > 0.7  # 3/4 of the cache is empty and skipped
    # the in-process API, TPU tiles, GQA rows
    st = block_stats_mod.block_stats(15, 5, 15, 512, group=4, backend="mosaic_tpu")
    assert (st["block_q"], st["block_k"], st["q_blocks"]) == (128, 128, 4)
    assert "tiles per (batch row, K/V head)" in block_stats_mod.format_stats(st)


def test_gpu_bench_without_a_gpu():
    """On any host: the GPU hidden (`run_module` starts jax with JAX_PLATFORMS=cpu)."""
    res = run_module("pallas_kernels.gpu_bench")
    assert res.returncode == 0, res.stderr
    assert "no GPU on this machine" in res.stdout
    assert "Traceback" not in res.stderr


def test_gpu_bench_logic():
    """The benchmark's check-and-time loop on tiny shapes: on a GPU the real benchmark (the
    kernel compiled), elsewhere in interpret mode (times are meaningless there)."""
    mode = kernel_mode("triton")
    f = types.SimpleNamespace(W=2, N=3, G=1, cache_lens=["5"], cache_size=0, batch=1, heads=4,
                              kv_heads=2, head_dim=16, dtype="float32", block_q=None,
                              block_k=None, iters=1, repeats=1, interpret=mode is not False)
    with kernel_device(mode):
        rec = gpu_bench.run_bench(f)
    assert rec["exact"] and len(rec["rows"]) == 1 and rec["interpret"] == (mode is not False)
    row = rec["rows"][0]
    assert row["max_abs_err"] <= 1e-4 and row["kernel_us"] > 0 and row["dense_us"] > 0
    assert "exact against the dense reference: yes" in gpu_bench.format_table(rec)


# ------------------------------------------------------------------------------ CLI ---

def test_cli_attention_flag():
    """--attention: on a GPU or TPU host 'pallas' (the kernel compiled) decodes the greedy fp32
    tiny model token for token as 'dense' does; on a host with neither it is a clear error.
    'auto' equals 'dense' everywhere (the kernel where there is one, else dense)."""
    from lookahead_jax import decode
    opts = dict(config="tiny_llama", prompt_ids="5,6,7", max_new_tokens=12)
    err = io.StringIO()
    code = decode.run(decode.Options(**opts, attention="pallas", method="ar"),
                      stdin=io.StringIO(""), stdout=io.StringIO(), stderr=err)
    assert code == 2 and "only applies to --method=lookahead" in err.getvalue()
    results = {}
    for attention in ("pallas", "auto", "dense"):
        out, err = io.StringIO(), io.StringIO()
        code = decode.run(decode.Options(**opts, attention=attention), stdin=io.StringIO(""),
                          stdout=out, stderr=err)
        if attention == "pallas" and HOST_BACKEND is None:
            lines = [ln for ln in err.getvalue().splitlines() if ln.startswith("error:")]
            assert code == 2 and len(lines) == 1 and "--attention=pallas" in lines[0], \
                err.getvalue()
            assert "GPU" in lines[0] and "Traceback" not in err.getvalue()
            continue
        assert code == 0, err.getvalue()
        results[attention] = out.getvalue()
    assert results["dense"].split()
    assert all(r == results["dense"] for r in results.values()), results
    assert ("pallas" in results) == (HOST_BACKEND is not None)
