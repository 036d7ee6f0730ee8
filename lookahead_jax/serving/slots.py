"""The slot engine: continuous batching over a fixed number of slots, each its own request.

A request's decoding state is exactly the state `Engine.generate` builds for it alone (batch
1): its cache row, lookahead window, n-gram pool, prompt-lookup history, PRNG key and output
buffer. The slot engine prefills a request with the offline `Method.init` (batch 1), inserts
that state as a row of a *lane*, and advances every row of a lane with one compiled program,
`jax.vmap` of the method's own `step` over the rows. So each row computes what the offline
batch-1 run computes, step for step and draw for draw: its output is the offline output for
the same settings and seed (greedy: the plain greedy tokens; sampling: the same tokens).

A lane holds the requests that share one compiled step: the same method and settings (W, N,
G; prompt lookup's draft length and n-gram) and greedy or not. Sampling values (temperature,
top-k, top-p) are per row arrays (`SamplingParams`), so any mix of them shares a lane. A
lane's rows are a power of two (1, 2, 4, .. up to `slots`): it grows when a request joins a
full lane and shrinks when at most half its rows are live, and its live rows are kept first,
so a step computes at most twice the live rows. Joining and leaving never recompile: a lane's
programs are compiled once per row count (and the prefill once per prompt-length bucket), the
first time they are needed; `warmup` compiles them ahead.

Static shapes per server: every row has a cache of `cache_len` positions (the context
`max_len` plus the widest step) and an output buffer of `max_tokens`; a request's own
`max_tokens` is applied on the host (the first max_tokens tokens of a longer run are the
tokens of the shorter run).

    slots = SlotEngine(engine, slots=8, limits=Limits(max_len=1024, max_tokens=256))
    handle, first = slots.admit(SlotRequest(ids, method="lookahead", settings={"W": 7}))
                                                           # = insert(prefill(request))
    while slots.live:
        for handle, update in slots.step().items(): ...   # new ids, done flag
    slots.evict(handle)                                    # finished or cancelled
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lookahead_jax.generation import bucket_length, pad_prompts
from lookahead_jax.lookahead.config import LookaheadConfig
from lookahead_jax.mesh import put_global, state_shardings, to_host
from lookahead_jax.method import Method
from lookahead_jax.prompt_lookup import DEFAULT_NGRAM, DEFAULT_TOKENS
from lookahead_jax.sampling import Sampling, SamplingParams
from models.config import ConfigError

SERVED_METHODS = ("ar", "lookahead", "prompt_lookup")
# per-request settings each method takes (names as the CLI flags)
METHOD_SETTINGS = {"ar": (), "lookahead": ("W", "N", "G"),
                   "prompt_lookup": ("pl_tokens", "pl_ngram")}


class RequestError(ConfigError):
    """A request the server refuses (HTTP 400): `param` names the field at fault."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclasses.dataclass(frozen=True)
class Limits:
    """What a request may ask for: the server's maximum settings."""

    max_len: int = 1024  # prompt + generated tokens
    max_tokens: int = 256  # generated tokens per request
    W: int = 15
    N: int = 5
    G: int = 15
    pl_tokens: int = 16
    pl_ngram: int = 5

    def maximum(self, name: str) -> int:
        return getattr(self, name)


@dataclasses.dataclass
class SlotRequest:
    """One request as the slot engine sees it: token ids and decoding settings."""

    ids: list[int]
    method: str = "ar"
    settings: dict[str, int] = dataclasses.field(default_factory=dict)
    sampling: Sampling = Sampling()
    seed: int = 0
    max_tokens: int = 16


@dataclasses.dataclass
class Update:
    """What one `step` did for one request: its new ids, and whether it has finished (EOS or
    its max_tokens); `steps` its forward passes so far (the prefill counted, as offline)."""

    ids: list[int]
    done: bool
    steps: int


@dataclasses.dataclass
class Prefilled:
    """A request after its prefill: the batch-1 state, shaped for its lane, not yet in a slot."""

    request: SlotRequest
    template: Method
    state: Any


def _placed(x) -> bool:
    """A committed array or a tree of them (a state): left where it is."""
    leaves = jax.tree.leaves(x)
    return bool(leaves) and all(isinstance(a, jax.Array) and a.committed for a in leaves)


def _bind(template: Method, sp: SamplingParams | None) -> Method:
    return template if sp is None else dataclasses.replace(template, sampling=sp)


def _init_fn(template, graphdef, m, eos_ids, params, tokens, lengths, cache, key, sp):
    return _bind(template, sp).init(graphdef, params, tokens, lengths, cache, key,
                                    max_new_tokens=m, eos_ids=eos_ids)


def _step_fn(template, graphdef, eos_ids, params, state, sp):
    """One step of every row: the method's own batch-1 step, vmapped over the lane's rows."""
    model = nnx.merge(graphdef, params["model"])

    def one(row, sp_row):
        method = _bind(template, sp_row)
        return method.step(model, method.prepare(model, params["method"]), row, eos_ids=eos_ids)

    return jax.vmap(one)(state, sp)


def _fit(one, shapes):
    """A prefilled batch-1 state, padded with zeros at the end of any axis shorter than the
    lane's (prompt lookup's history is sized by the prompt bucket; it is read only below its
    length), and given the leading row axis."""
    def fit(x, s):
        if x.shape != s.shape:
            x = jnp.pad(x, [(0, b - a) for a, b in zip(x.shape, s.shape)])
        return x[None]
    return jax.tree.map(fit, one, shapes)


def _put_row(state, row_state, r):
    return jax.tree.map(lambda a, x: jax.lax.dynamic_update_index_in_dim(a, x, r, 0),
                        state, row_state)


def _remove_row(state, r, last):
    """Row `last` (the last live row) moves into row r, and becomes inert (done)."""
    moved = jax.tree.map(
        lambda a: jax.lax.dynamic_update_index_in_dim(
            a, jax.lax.dynamic_index_in_dim(a, last, 0), r, 0), state)
    return _with_done(moved, moved.out.done.at[last].set(True))


def _read(state):
    """What the host reads after a step: per row, the output count, done flag, output
    tokens and forward passes."""
    return state.out.count[:, 0], state.out.done[:, 0], state.out.tokens[:, 0], state.steps


def _with_done(state, done):
    return state.replace(out=state.out.replace(done=done))


def _resize(rows: int, state):
    """The first `rows` rows (shrink), or the rows followed by copies of row 0 marked done
    (grow): inert rows a step computes but nobody reads."""
    n = jax.tree.leaves(state)[0].shape[0]
    if rows <= n:
        return jax.tree.map(lambda a: a[:rows], state)
    grown = jax.tree.map(
        lambda a: jnp.concatenate([a, jnp.broadcast_to(a[:1], (rows - n, *a.shape[1:]))]), state)
    done = grown.out.done.at[n:].set(True)
    return _with_done(grown, done)


# kind -> (function, static argnums, donated argnums)
_PROGRAMS = {
    "init": (_init_fn, (0, 1, 2, 3), (7,)),
    "step": (_step_fn, (0, 1, 2), (4,)),
    "put": (_put_row, (), (0,)),
    "remove": (_remove_row, (), (0,)),
    "read": (_read, (), ()),
    "resize": (_resize, (0,), ()),  # a new shape: nothing to donate
}
_JIT = {kind: jax.jit(fn, static_argnums=st, donate_argnums=do)
        for kind, (fn, st, do) in _PROGRAMS.items()}


class Lane:
    """Rows sharing one compiled step: a method template (its settings, greedy or not)."""

    def __init__(self, template: Method):
        self.template = template
        self.sampled = not template.sampling.greedy
        self.state = None  # rows stacked on a leading axis; None while the lane is empty
        self.shapes = None  # a row's state shapes (at the longest prompt bucket)
        self.handles: list[int] = []  # the live rows' handles, row i = handles[i]
        self.sp: dict[str, np.ndarray] = {}  # per-row sampling values (sampled lanes)
        self.sent = np.zeros((0,), np.int64)  # tokens already reported, per row

    @property
    def rows(self) -> int:
        return 0 if self.state is None else int(self.state.out.done.shape[0])

    def sampling_params(self):
        if not self.sampled:
            return None
        return SamplingParams(self.sp["temperature"], self.sp["top_k"], self.sp["top_p"])


class SlotEngine:
    """Continuous batching over `slots` slots (see the module docstring).

    engine: a loaded `Engine`; its lookahead settings are the per-request default. On a mesh
        with a model axis (`Engine(mesh="model:4")`) the model and every slot's cache are
        sharded over it (tensor parallelism) and every program is compiled for the mesh.
    limits: the server's maximum settings (default: the engine's lookahead W, N, G)."""

    def __init__(self, engine, *, slots: int = 8, limits: Limits | None = None):
        if engine.devices > 1:
            raise ConfigError("the slot engine runs tensor parallelism (a mesh's model axis), "
                              "not lookahead parallelism: give a mesh whose lookahead axis is 1")
        if slots < 1:
            raise ConfigError(f"slots must be >= 1, got {slots}")
        la = engine.lookahead or LookaheadConfig()
        self.limits = limits or Limits(W=la.W, N=la.N, G=la.G)
        self.engine = engine
        self.slots = slots
        self.default_lookahead = {"W": min(la.W, self.limits.W), "N": min(la.N, self.limits.N),
                                  "G": min(la.G, self.limits.G)}
        self.default_pl = {"pl_tokens": min(DEFAULT_TOKENS, self.limits.pl_tokens),
                           "pl_ngram": min(DEFAULT_NGRAM, self.limits.pl_ngram)}
        widest = max(self.limits.N, self.limits.pl_tokens + 1)  # cache slots a step writes
        self.prompt_bucket = bucket_length(self.limits.max_len)
        self.cache_len = -(-max(self.prompt_bucket, self.limits.max_len + widest) // 128) * 128
        if self.limits.max_tokens > self.limits.max_len - 1:
            raise ConfigError(f"max_tokens ({self.limits.max_tokens}) must be below max_len "
                              f"({self.limits.max_len}): a prompt needs a token")
        self.lanes: dict[Method, Lane] = {}
        self._where: dict[int, Lane] = {}  # handle -> its lane
        self._requests: dict[int, SlotRequest] = {}
        self._handles = itertools.count()
        self._params = {"model": engine.params, "method": {}}
        # programs are cached with the engine's own, so slot engines over one engine share them
        self._compiled: dict = engine._compiled
        self.compile_s = 0.0

    # -- what a request asks for ------------------------------------------------------------
    def method_for(self, request: SlotRequest) -> Method:
        """The Method offline `Engine.generate` would run for this request (validated against
        the limits); raises ConfigError naming the setting."""
        name = request.method
        if name not in SERVED_METHODS:
            raise RequestError("lookahead.method", f"unknown method {name!r}: the server runs "
                               f"{', '.join(SERVED_METHODS)}")
        allowed = METHOD_SETTINGS[name]
        for key in request.settings:
            if key not in allowed:
                raise RequestError(f"lookahead.{key}",
                                   f"setting {key} does not apply to method {name!r}"
                                   + (f" (it takes {', '.join(allowed)})" if allowed else ""))
        defaults = {"lookahead": self.default_lookahead, "prompt_lookup": self.default_pl,
                    "ar": {}}[name]
        settings = {**defaults, **request.settings}
        for key, value in settings.items():
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
                raise RequestError(f"lookahead.{key}", f"{key} must be an integer, got {value!r}")
            low = 0 if key == "G" else (2 if key == "N" else 1)
            if not low <= value <= self.limits.maximum(key):
                raise RequestError(f"lookahead.{key}", f"{key}={value} is outside [{low}, "
                                   f"{self.limits.maximum(key)}] (the server's maximum)")
        try:
            return self.engine.build_method(name, request.sampling, **settings)
        except RequestError:
            raise
        except ConfigError as e:  # e.g. a step wider than the model's positions
            raise RequestError("lookahead", str(e)) from e

    def check(self, request: SlotRequest) -> Method:
        """Validates a request against the limits; returns its method."""
        n = len(request.ids)
        if n == 0:
            raise RequestError("prompt", "empty prompt")
        if n >= self.limits.max_len:
            raise RequestError("prompt", f"the prompt has {n} tokens; the context is "
                                         f"{self.limits.max_len}")
        if not 1 <= request.max_tokens <= self.limits.max_tokens:
            raise RequestError("max_tokens", f"max_tokens must be in [1, "
                               f"{self.limits.max_tokens}], got {request.max_tokens}")
        if n + request.max_tokens > self.limits.max_len:
            raise RequestError("max_tokens", f"prompt ({n} tokens) + max_tokens "
                               f"({request.max_tokens}) exceeds the context ({self.limits.max_len})")
        vocab = self.engine.config.vocab_size
        if any(not 0 <= t < vocab for t in request.ids):
            raise RequestError("prompt", f"a prompt token id is outside the vocabulary [0, {vocab})")
        return self.method_for(request)

    # -- compiled programs ------------------------------------------------------------------
    def _run(self, kind: str, statics: tuple, *args):
        key = ("slots", kind, statics,
               tuple((a.shape, str(a.dtype)) for a in jax.tree.leaves(args)))
        mesh = self.engine.mesh
        if mesh is not None:  # host values replicated; states keep their placement
            args = tuple(a if _placed(a) else put_global(a, mesh) for a in args)
        if key not in self._compiled:
            t0 = time.perf_counter()
            if mesh is None:
                self._compiled[key] = _JIT[kind].lower(*statics, *args).compile()
            else:  # every state leaves a program laid out as `state_shardings` says
                fn, static, donate = _PROGRAMS[kind]
                with jax.set_mesh(mesh):
                    out = jax.eval_shape(functools.partial(fn, *statics), *args)
                    self._compiled[key] = jax.jit(
                        fn, static_argnums=static, donate_argnums=donate,
                        out_shardings=state_shardings(out, mesh)).lower(*statics, *args).compile()
            self.compile_s += time.perf_counter() - t0
        return self._compiled[key](*args)

    def _place(self, state):
        """A state built outside the compiled programs, laid out as they lay theirs out."""
        mesh = self.engine.mesh
        return state if mesh is None else jax.device_put(state, state_shardings(state, mesh))

    @staticmethod
    def _template(method: Method) -> Method:
        return method if method.sampling.greedy else dataclasses.replace(
            method, sampling=Sampling(temperature=1.0))

    def _init_row(self, request: SlotRequest, template: Method):
        tokens, lengths = pad_prompts([request.ids])
        cache = self.engine._init_cache(1, self.cache_len, self.engine.dtype)
        sp = None if request.sampling.greedy else SamplingParams.of(request.sampling)
        statics = (template, self.engine.graphdef, self.limits.max_tokens, self.engine.eos_ids)
        return self._run("init", statics, self._params, tokens, lengths, cache,
                         jax.random.key(request.seed), sp)

    def _lane_shapes(self, template: Method):
        """The row state's shapes at the longest prompt bucket (the lane's shapes)."""
        tokens = jax.ShapeDtypeStruct((1, self.prompt_bucket), jnp.int32)
        lengths = jax.ShapeDtypeStruct((1,), jnp.int32)
        cache = jax.eval_shape(lambda: self.engine._init_cache(1, self.cache_len,
                                                                self.engine.dtype))
        key = jax.eval_shape(lambda: jax.random.key(0))
        sp = None if template.sampling.greedy else jax.eval_shape(
            lambda: SamplingParams.of(Sampling(1.0)))
        return jax.eval_shape(
            lambda *a: _init_fn(template, self.engine.graphdef, self.limits.max_tokens,
                                self.engine.eos_ids, self._params, *a),
            tokens, lengths, cache, key, sp)

    # -- admit, step, evict -----------------------------------------------------------------
    @property
    def live(self) -> int:
        return len(self._where)

    @property
    def free(self) -> int:
        return self.slots - self.live

    def prefill(self, request: SlotRequest) -> Prefilled:
        """The request's batch-1 prefill and first token (the offline `Method.init`), shaped
        for its lane. Raises RequestError for a bad request. Touches no slot."""
        method = self.check(request)
        template = self._template(method)
        lane = self.lanes.get(template)
        if lane is None:
            lane = self.lanes[template] = Lane(template)
        if lane.shapes is None:
            lane.shapes = self._lane_shapes(template)
        return Prefilled(request, template,
                         self._place(_fit(self._init_row(request, template), lane.shapes)))

    def insert(self, prefilled: Prefilled) -> tuple[int, Update]:
        """Puts a prefilled request into a free slot (its lane grows to the next power of two
        when full). Returns its handle and its first update (the first token). Raises
        RuntimeError when no slot is free."""
        if self.free <= 0:
            raise RuntimeError("no free slot")
        request = prefilled.request
        lane = self.lanes[prefilled.template]
        handle = next(self._handles)
        r = len(lane.handles)
        if lane.state is None:
            lane.state = prefilled.state
        else:
            if r >= lane.rows:
                lane.state = self._run("resize", (2 * lane.rows,), lane.state)
            lane.state = self._run("put", (), lane.state, prefilled.state, np.int32(r))
        lane.handles.append(handle)
        lane.sent = np.append(lane.sent, 0)
        if lane.sampled:
            for name in ("temperature", "top_k", "top_p"):
                dtype = np.int32 if name == "top_k" else np.float32
                vals = lane.sp.get(name, np.zeros((0,), dtype))[:r]
                vals = np.append(vals, dtype(getattr(request.sampling, name)))
                lane.sp[name] = np.pad(vals, (0, lane.rows - len(vals)),
                                       constant_values=1).astype(dtype)
        self._where[handle] = lane
        self._requests[handle] = request
        return handle, self._updates(lane)[handle]

    def admit(self, request: SlotRequest) -> tuple[int, Update]:
        """`insert(prefill(request))`: checks for a free slot first."""
        if self.free <= 0:
            raise RuntimeError("no free slot")
        return self.insert(self.prefill(request))

    def _updates(self, lane: Lane) -> dict[int, Update]:
        count, done, tokens, steps = (to_host(x) for x in self._run("read", (), lane.state))
        updates = {}
        for r, handle in enumerate(lane.handles):
            limit = self._requests[handle].max_tokens
            c = min(int(count[r]), limit)
            new = tokens[r, lane.sent[r]:c].tolist()
            lane.sent[r] = max(lane.sent[r], c)
            updates[handle] = Update(new, bool(done[r]) or c >= limit, int(steps[r]))
        return updates

    def step(self) -> dict[int, Update]:
        """One step of every live request (one compiled program per lane with live rows)."""
        updates = {}
        for lane in list(self.lanes.values()):
            if lane.handles:
                updates.update(self.step_lane(lane))
        return updates

    def step_lane(self, lane: Lane) -> dict[int, Update]:
        statics = (lane.template, self.engine.graphdef, self.engine.eos_ids)
        lane.state = self._run("step", statics, self._params, lane.state,
                               lane.sampling_params())
        return self._updates(lane)

    def evict(self, handle: int) -> None:
        """Frees a finished or cancelled request's slot: the lane's last live row moves into
        it, and the lane shrinks to the next power of two >= its live rows (or is emptied)."""
        lane = self._where.pop(handle, None)
        self._requests.pop(handle, None)
        if lane is None:
            return
        r = lane.handles.index(handle)
        last = len(lane.handles) - 1
        if last > 0:  # the last live row moves into row r; row `last` becomes inert
            lane.state = self._run("remove", (), lane.state, np.int32(r), np.int32(last))
            lane.handles[r] = lane.handles[last]
            lane.sent[r] = lane.sent[last]
            for v in lane.sp.values():
                v[r] = v[last]
        lane.handles.pop()
        lane.sent = lane.sent[:last]
        n = len(lane.handles)
        if n == 0:
            lane.state = None  # the memory goes; the compiled programs stay
            lane.sp = {}
        elif bucket_length(n, minimum=1) < lane.rows:
            target = bucket_length(n, minimum=1)
            lane.state = self._run("resize", (target,), lane.state)
            lane.sp = {k: v[:target] for k, v in lane.sp.items()}

    def lane_of(self, handle: int) -> Lane | None:
        return self._where.get(handle)

    def drop_lane(self, lane: Lane) -> list[int]:
        """Forgets a lane whose step failed; returns the handles it held."""
        handles = list(lane.handles)
        for h in handles:
            self._where.pop(h, None)
            self._requests.pop(h, None)
        lane.handles, lane.state, lane.sp, lane.sent = [], None, {}, np.zeros((0,), np.int64)
        return handles

    def warmup(self, requests: list[SlotRequest]) -> float:
        """Compiles every program these requests need (prefill at their prompt bucket, the step
        at every row count up to `slots`) by running them; returns the compile seconds."""
        before = self.compile_s
        for request in requests:
            handles = []
            for _ in range(self.slots):
                handles.append(self.admit(request)[0])
                self.step_lane(self._where[handles[-1]])
            for h in handles:
                self.evict(h)
        return self.compile_s - before


def request_settings(method: Method) -> dict[str, Any]:
    """The settings a method was built with, as a response reports them."""
    config = getattr(method, "config", None)
    if isinstance(config, LookaheadConfig):
        return {"W": config.W, "N": config.N, "G": config.G}
    if hasattr(method, "num_tokens"):
        return {"pl_tokens": method.num_tokens, "pl_ngram": method.max_ngram}
    return {}
