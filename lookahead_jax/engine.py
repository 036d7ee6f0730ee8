"""The Python API: an `Engine` wraps a model and a tokenizer and generates with any method.

    engine = Engine.from_preset("smollm2_135m")
    result = engine.generate(["What is JAX?"], max_new_tokens=64)          # lookahead (preset)
    plain = engine.generate(["What is JAX?"], max_new_tokens=64, method="ar")
    print(result.texts[0], result.stats.step_compression)

Each method is a small frozen dataclass with `init` (prefill) and `run` (a `lax.while_loop`
over at most `max_steps` steps); the engine compiles both once per shape, measures compile,
prefill and decode time separately, and streams tokens between chunks of steps.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from lookahead_jax.generation import cache_length_for, pad_prompts
from lookahead_jax.lookahead.config import LookaheadConfig
from lookahead_jax.looped.drafter import check_drafter_model, params_digest
from lookahead_jax.mesh import (MeshShape, make_mesh, mesh_shape, put_global, shard_cache,
                                shard_params, state_shardings, to_host, host_state)
from lookahead_jax.method import Method
from lookahead_jax.registry import build_method
from lookahead_jax.sampling import Sampling
from lookahead_jax.store.checkpoint import load_model_and_tokenizer
from lookahead_jax.store.presets import load_preset
from lookahead_jax.store.tokenizer import encode_prompt
from models.config import ConfigError, LlamaConfig


@dataclasses.dataclass
class Stats:
    """What one `generate` call did. Times in seconds; compile time is not in tokens/s."""

    new_tokens: list[int]  # per prompt
    steps: int  # forward passes, the prefill included (as the reference counts)
    prefill_s: float
    decode_s: float
    compile_s: float
    extra: dict = dataclasses.field(default_factory=dict)

    @property
    def total_tokens(self) -> int:
        return int(sum(self.new_tokens))

    @property
    def tokens_per_s(self) -> float:
        t = self.prefill_s + self.decode_s
        return self.total_tokens / t if t > 0 else float("nan")

    @property
    def step_compression(self) -> float:
        """S = generated tokens per forward step (mean over prompts of the batch)."""
        return float(np.mean(self.new_tokens)) / max(self.steps, 1)

    def line(self) -> str:
        return (f"[{self.total_tokens} tokens, {self.tokens_per_s:.1f} tokens/s, {self.steps} steps, "
                f"S={self.step_compression:.2f}, prefill {self.prefill_s:.2f}s, "
                f"decode {self.decode_s:.2f}s, compile {self.compile_s:.1f}s]")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(total_tokens=self.total_tokens, tokens_per_s=self.tokens_per_s,
                 step_compression=self.step_compression)
        return d


@dataclasses.dataclass
class Result:
    tokens: list[list[int]]  # generated ids per prompt (EOS kept when generated)
    stats: Stats
    texts: list[str] | None = None


TokenCallback = Callable[[int, list[int]], None]  # (prompt index, new token ids)


def _init_fn(method, graphdef, max_new_tokens, eos_ids, params, tokens, lengths, cache, key):
    return method.init(graphdef, params, tokens, lengths, cache, key,
                       max_new_tokens=max_new_tokens, eos_ids=eos_ids)


def _run_fn(method, graphdef, eos_ids, params, state, max_steps):
    return method.run(graphdef, params, state, max_steps, eos_ids=eos_ids)


# kind -> (function, static argnums, donated argnums: the cache, the state)
_PROGRAMS = {"init": (_init_fn, (0, 1, 2, 3), (7,)), "run": (_run_fn, (0, 1, 2), (4,))}
_JITTED = {kind: jax.jit(fn, static_argnums=st, donate_argnums=do)
           for kind, (fn, st, do) in _PROGRAMS.items()}


def preset_devices(preset) -> int:
    """Lookahead parallelism's default for a preset: all local devices where the preset enables
    it (`Preset.parallel`), else 1."""
    return len(jax.local_devices()) if preset.parallel else 1


def check_compiler_options(options) -> dict[str, bool | int | float | str] | None:
    """XLA compiler options as `jax.jit` takes them: a mapping of option names (no leading
    dashes) to a bool, int, float or str; None or an empty mapping: none."""
    if not options:
        return None
    if not isinstance(options, Mapping):
        raise ConfigError(f"compiler_options must be a mapping of XLA option names to values, "
                          f"got {options!r}")
    for name, value in options.items():
        if not isinstance(name, str) or not name or name.startswith("-"):
            raise ConfigError(f"compiler option names are XLA's without the leading dashes "
                              f"(e.g. 'xla_gpu_autotune_level'), got {name!r}")
        if not isinstance(value, (bool, int, float, str)):
            raise ConfigError(f"compiler option {name!r}: a bool, int, float or str, got "
                              f"{value!r}")
    return dict(options)


class Engine:
    """A loaded model (and optionally its tokenizer) ready to generate."""

    def __init__(self, model: nnx.Module, tokenizer=None, *, eos_ids: Sequence[int] | None = None,
                 lookahead: LookaheadConfig | None = None, chat: bool = True,
                 cache_len: int | None = None, attention: Any = "dense", devices: int = 1,
                 mesh: Mesh | MeshShape | str | None = None,
                 compiler_options: Mapping[str, bool | int | float | str] | None = None):
        """mesh: a (lookahead, model) device mesh (`lookahead_jax.mesh`), e.g.
        "lookahead:2,model:4": parameters and cache sharded over its model axis (tensor
        parallelism; attention then dense, "auto" included), lookahead parallelism over its
        lookahead axis (which then sets `devices`).

        compiler_options: XLA options for this engine's programs only (the prefill and the
        decoding loop), e.g. {"xla_gpu_autotune_level": 0}, given as XLA_FLAGS would name them
        without the leading dashes; they override XLA_FLAGS for these programs, and XLA refuses
        an option it does not know when the first program compiles."""
        self.config: LlamaConfig | Any = model.config  # LlamaConfig or LoopedConfig
        self.dtype = model.dtype
        self._model_cache = model.init_cache  # (batch, max_len, dtype) -> the model's cache
        self.graphdef, self.params = nnx.split(model)
        self.mesh = None
        if mesh is not None:
            self.mesh = mesh if isinstance(mesh, Mesh) else make_mesh(mesh)
            lookahead_axis = mesh_shape(self.mesh).lookahead
            if devices not in (1, lookahead_axis):
                raise ConfigError(f"devices={devices} disagrees with the mesh's lookahead axis "
                                  f"({lookahead_axis}): give one or the other")
            devices = lookahead_axis
            if mesh_shape(self.mesh).model > 1:  # a Pallas call is one device's program
                if attention not in ("dense", "auto"):
                    raise ConfigError(f"tensor parallelism (a model axis > 1) runs dense "
                                      f"attention: attention={attention!r} is a single-device "
                                      f"kernel")
                attention = "dense"
            self.params = shard_params(self.params, self.mesh, self.config)
        self.tokenizer = tokenizer
        self.eos_ids = tuple(int(e) for e in (eos_ids if eos_ids is not None
                                                else self.config.eos_token_ids))
        self.lookahead = lookahead
        self.chat = chat
        self.cache_len = cache_len
        self.attention = attention  # lookahead steps: 'dense' | 'pallas' | 'auto' | a function
        self.devices = devices  # lookahead parallelism over this many local devices (1 = off)
        self.compiler_options = check_compiler_options(compiler_options)
        self._compiled: dict = {}
        self._digest: str | None = None  # params_digest of the model, when a drafter asks

    def _init_cache(self, batch: int, max_len: int, dtype):
        cache = self._model_cache(batch, max_len, dtype)
        return cache if self.mesh is None else shard_cache(cache, self.mesh)

    def _put(self, tree):
        """Host inputs as arrays for the compiled programs: on a mesh, global and replicated."""
        return tree if self.mesh is None else put_global(tree, self.mesh)

    @classmethod
    def from_preset(cls, name: str = "smollm2_135m", *, ckpt: str | None = None,
                    dtype: str | None = None, **kw) -> "Engine":
        """Loads a preset from `configs/` with its checkpoint (`ckpt` overrides the preset's)
        in `dtype` ("float32" | "bfloat16"; default: the preset's). kw go to `Engine(...)` and
        may override the preset's `lookahead`, `chat`, `devices` (default: all local devices
        for presets with `parallel`, else 1) and `mesh` (default: the preset's, e.g.
        llama70b's model axis of 8; a Hugging Face checkpoint is then read sharded)."""
        preset = load_preset(name)
        mesh = kw.get("mesh", preset.mesh)
        if mesh is not None and not isinstance(mesh, Mesh):
            mesh = make_mesh(mesh)
        model, tokenizer, _ = load_model_and_tokenizer(preset, ckpt, dtype, mesh=mesh)
        kw = {"lookahead": preset.lookahead, "chat": preset.chat,
              **({"devices": preset_devices(preset)} if mesh is None else {}), **kw,
              "mesh": mesh}
        return cls(model, tokenizer, **kw)

    def build_method(self, name: str | None = None, sampling: Sampling | None = None,
                     **settings) -> Method:
        """`registry.build_method` with this engine's defaults: its model config, its
        lookahead settings, attention and devices. name None: 'lookahead' when the engine
        has lookahead settings, else 'ar'."""
        name = name or ("lookahead" if self.lookahead is not None else "ar")
        if name == "lookahead":
            settings = {"lookahead": self.lookahead, "attention": self.attention,
                        "devices": self.devices, **settings}
            if self.mesh is not None and settings["devices"] > 1:
                settings["mesh"] = self.mesh
        return self.check_drafter(build_method(name, sampling=sampling,
                                               model_config=self.config, **settings))

    def check_drafter(self, method: Method) -> Method:
        """`method`, after warning (`DrafterModelWarning`) when its drafter records a looped
        model other than this engine's (`drafter.check_drafter_model`; the digest of this
        engine's parameters is computed once, on the first method with such a drafter)."""
        if getattr(getattr(method, "drafter", None), "base_digest", None) is not None:
            if self._digest is None:
                self._digest = params_digest(nnx.merge(self.graphdef, self.params))
            check_drafter_model(method.drafter, self._digest, "this engine's model")
        return method

    def resolve_method(self, method: str | Method | None, sampling: Sampling | None,
                       lookahead: LookaheadConfig | None = None) -> Method:
        """A name (built by the registry with `sampling` and `lookahead`) or a Method
        instance, which carries its own sampling: a different `sampling` is refused."""
        if isinstance(method, Method):
            if sampling is not None and sampling != method.sampling:
                raise ConfigError(f"the method instance carries its own sampling "
                                  f"({method.sampling}); pass sampling=None or build the "
                                  f"method with {sampling}")
            if lookahead is not None:
                raise ConfigError("lookahead settings apply to a method name, not to a "
                                  "method instance (it carries its own config)")
            method.check(self.config)
            return self.check_drafter(method)
        if method is not None and not isinstance(method, str):
            raise ConfigError(f"method must be a name or a Method, got {method!r}")
        settings = {} if lookahead is None else {"lookahead": lookahead}
        if lookahead is not None and method is None:
            method = "lookahead"
        return self.build_method(method, sampling, **settings)

    # -- compilation -------------------------------------------------------------------------
    def _compile(self, kind: str, statics: tuple, args: tuple):
        shapes = tuple((a.shape, a.dtype) for a in jax.tree.leaves(args[1:]))
        key = (kind, statics, shapes)
        if key not in self._compiled:
            t0 = time.perf_counter()
            if self.mesh is None:
                self._compiled[key] = _JITTED[kind].lower(*statics, *args).compile(
                    self.compiler_options)
            else:  # every program leaves the state laid out as `state_shardings` says
                base, static, donate = _PROGRAMS[kind]
                with jax.set_mesh(self.mesh):
                    state = jax.eval_shape(functools.partial(base, *statics), *args)
                    fn = jax.jit(base, static_argnums=static, donate_argnums=donate,
                                 out_shardings=state_shardings(state, self.mesh))
                    self._compiled[key] = fn.lower(*statics, *args).compile(
                        self.compiler_options)
            return self._compiled[key], time.perf_counter() - t0
        return self._compiled[key], 0.0

    # -- generation --------------------------------------------------------------------------
    def generate_ids(self, prompts: Sequence[Sequence[int]], *, method: str | Method | None = None,
                     max_new_tokens: int = 128, sampling: Sampling | None = None,
                     lookahead: LookaheadConfig | None = None, seed: int = 0,
                     on_tokens: TokenCallback | None = None, chunk_steps: int | None = None,
                     cache_len: int | None = None) -> Result:
        """Generates for a batch of token-id prompts of any lengths.

        on_tokens(i, ids) is called with each prompt's new ids after every chunk of
        `chunk_steps` steps (default: 8 when streaming, else the whole generation at once).
        """
        if max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        method = self.resolve_method(method, sampling, lookahead)
        vocab = self.config.vocab_size
        for p in prompts:
            bad = [t for t in p if not 0 <= int(t) < vocab]
            if bad:
                raise ConfigError(f"prompt token id {bad[0]} outside the vocabulary [0, {vocab})")
        tokens, lengths = pad_prompts(prompts)
        s = cache_length_for(tokens.shape[1], max_new_tokens,
                             method.cache_capacity(self.config),
                             self.config.max_position_embeddings, cache_len or self.cache_len)
        cache = self._init_cache(len(prompts), s, self.dtype)
        key = jax.random.key(seed)
        params = {"model": self.params, "method": self._put(method.params())}
        tokens, lengths = self._put((jnp.asarray(tokens), jnp.asarray(lengths)))
        init_args = (params, tokens, lengths, cache, self._put(key))
        init_c, compile_s = self._compile(
            "init", (method, self.graphdef, max_new_tokens, self.eos_ids), init_args)
        t0 = time.perf_counter()
        state = jax.block_until_ready(init_c(*init_args))
        prefill_s = time.perf_counter() - t0

        chunk = chunk_steps or (8 if on_tokens else max_new_tokens + 2 * 64)
        max_steps = self._put(jnp.asarray(chunk, jnp.int32))
        run_c, c2 = self._compile("run", (method, self.graphdef, self.eos_ids),
                                  (params, state, max_steps))
        compile_s += c2
        sent = [0] * len(prompts)
        decode_s = 0.0

        def flush(st):
            if on_tokens is None:
                return
            counts = to_host(st.out.count)
            toks = to_host(st.out.tokens)
            for i, c in enumerate(counts):
                if c > sent[i]:
                    on_tokens(i, toks[i, sent[i]:c].tolist())
                    sent[i] = int(c)

        flush(state)
        while not bool(to_host(state.out.done).all()):
            t0 = time.perf_counter()
            state = jax.block_until_ready(run_c(params, state, max_steps))
            decode_s += time.perf_counter() - t0
            flush(state)
        counts = to_host(state.out.count)
        toks = to_host(state.out.tokens)
        stats = Stats(new_tokens=counts.tolist(), steps=int(to_host(state.steps)),
                      prefill_s=prefill_s,
                      decode_s=decode_s, compile_s=compile_s,
                      extra=method.summary(state if self.mesh is None else host_state(state)))
        return Result([toks[i, :c].tolist() for i, c in enumerate(counts)], stats)

    def encode(self, text: str, chat: bool | None = None) -> list[int]:
        if self.tokenizer is None:
            raise ConfigError("this engine has no tokenizer: pass token ids to generate_ids")
        if not text or not text.strip():
            raise ConfigError("empty prompt")
        return encode_prompt(self.tokenizer, text, self.chat if chat is None else chat)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def generate(self, prompts: str | Sequence[str], *, chat: bool | None = None,
                 on_text: Callable[[int, str], None] | None = None, **kw) -> Result:
        """Text in, text out. on_text(i, piece) streams each prompt's new text."""
        if isinstance(prompts, str):
            prompts = [prompts]
        ids = [self.encode(p, chat) for p in prompts]
        on_tokens = None
        if on_text is not None:
            seen: dict[int, list[int]] = {}
            shown: dict[int, str] = {}

            def on_tokens(i, new):
                seen.setdefault(i, []).extend(new)
                text = self.decode(seen[i])
                if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait
                    return
                on_text(i, text[len(shown.get(i, "")):])
                shown[i] = text

        result = self.generate_ids(ids, on_tokens=on_tokens, **kw)
        result.texts = [self.decode(t) for t in result.tokens]
        return result
