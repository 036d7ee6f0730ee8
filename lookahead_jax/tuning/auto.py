"""Automatic method and W, N, G: what the scaling law and the device's step cost predict fastest.

Lookahead decoding's speed-up over plain decoding is S / c: S tokens per step (the scaling
law, `lookahead_jax.tuning.scaling_law`, with (a, f) fitted to a measured sweep) at a step cost of
c plain steps (the step-cost curve, `lookahead_jax.tuning.step_cost`: one forward pass of T tokens
against one of a single token, measured on the current device at the current cache length).
On a GPU a 100-token step costs little more than a 1-token one and wide windows pay; on a
small CPU cost grows with T and small settings win. `choose_settings` measures the curve,
ranks a grid of (W, N, G = W) candidates by predicted speed-up and returns the best:

    choice = choose_settings(engine, prompt_len=40, max_new_tokens=128)
    print(choice.report())
    engine.generate_ids([ids], lookahead=choice.config)

The candidates keep G = W, as the paper's settings do: the law has no W term (W only fills
the n-gram pool that the G candidates are drawn from), so letting G run free of W would make
it prefer W = 1 with many candidates, which a real pool cannot feed.
Where the curve comes from: measured on the current device (the default), or, for a device
this host is not (`device=` a `lookahead_jax.tuning.roofline.Device` or its name), predicted
by the roofline model from the compiled program of this model's shape
(`lookahead_jax.tuning.program_cost`). The report says which, and which scaling-law fit.

Asked for the fastest, a user never gets a method predicted slower than plain decoding: when no
lookahead setting is predicted at least `min_speedup` (default 1.05, a margin for the
prediction's error) times faster, the choice is prompt lookup if that is predicted to clear the
same bar, else plain decoding (`AutoChoice.method`), and the report says why.

`python -m lookahead_jax.decode --auto` does the same and prints the report on stderr.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping, Sequence

import jax

from lookahead_jax.lookahead.config import LookaheadConfig
from lookahead_jax.lookahead.layout import tokens_per_step
from lookahead_jax.prompt_lookup import DEFAULT_TOKENS as PROMPT_LOOKUP_DRAFT
from lookahead_jax.tuning import program_cost, roofline
from lookahead_jax.tuning.scaling_law import ScalingFit, default_fit, load_fit
from lookahead_jax.tuning.step_cost import measure_step_cost, relative_cost
from models.config import ConfigError

GRID_W = (1, 2, 3, 4, 5, 7, 10, 15, 20)
GRID_N = (3, 4, 5, 6)
MIN_SPEEDUP = 1.05  # a method other than plain decoding must be predicted at least this fast
# Prompt lookup (its default 10 draft tokens): tokens per step, the lowest over MT-Bench,
# HumanEval, GSM8K, MBPP, ClassEval in the committed SmolLM2 suite (`python -m benchmarks.suite`,
# suite_smollm2_135m.json; MT-Bench: 1.12; the others 1.35-4.09). The lowest, because prompt
# lookup pays only where the output copies the prompt, which chat rarely does.
PROMPT_LOOKUP_S = 1.12
PROMPT_LOOKUP_TOKENS = 1 + PROMPT_LOOKUP_DRAFT  # tokens per step: the current one + the draft


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One ranked setting: its tokens per step (per device), predicted S, step cost in
    one-token steps, and predicted speed-up S / cost over plain decoding."""

    W: int
    N: int
    G: int
    tokens: int
    S: float
    cost: float
    speedup: float

    @property
    def label(self) -> str:
        return f"({self.W},{self.N},{self.G})"


@dataclasses.dataclass
class AutoChoice:
    """The chosen method ('lookahead', 'prompt_lookup' or 'ar') and why: every lookahead
    candidate ranked (best first; `config` is the best's settings, used when the method is
    lookahead), prompt lookup's predicted speed-up, the fit and the step-cost curve (tokens ->
    seconds) behind the ranking, where the curve came from, and the cache length it is for."""

    config: LookaheadConfig
    candidates: list[Candidate]
    fit: ScalingFit
    step_costs: dict[int, float]
    cache_len: int
    method: str = "lookahead"
    prompt_lookup_speedup: float = 0.0
    curve_source: str = "given"
    min_speedup: float = MIN_SPEEDUP

    @property
    def best(self) -> Candidate:
        return self.candidates[0]

    def report(self, top: int = 5) -> str:
        """A few lines: the choice, the fit and curve it rests on, the best `top` candidates."""
        b = self.best
        ts = sorted(self.step_costs)
        mono = monotone_costs(self.step_costs)
        curve = ", ".join(f"{t}: {mono[t] / mono[ts[0]]:.2f}" for t in ts)
        best = (f"lookahead W={b.W} N={b.N} G={b.G}: predicted S {b.S:.2f} at a step cost of "
                f"{b.cost:.2f} one-token steps ({b.tokens} tokens) -> predicted speed-up "
                f"{b.speedup:.2f}x over plain decoding")
        pl = (f"prompt lookup: predicted S {PROMPT_LOOKUP_S:.2f} at a step cost of "
              f"{relative_cost(mono, PROMPT_LOOKUP_TOKENS):.2f} -> "
              f"{self.prompt_lookup_speedup:.2f}x")
        if self.method == "lookahead":
            lines = [f"auto: {best}"]
        elif self.method == "prompt_lookup":
            lines = [f"auto: --method=prompt_lookup, {pl}: the best lookahead setting is not "
                     f"predicted {self.min_speedup:.2f}x faster than plain decoding ({best})"]
        else:
            lines = [f"auto: plain decoding (--method=ar): neither the best lookahead setting "
                     f"nor prompt lookup is predicted {self.min_speedup:.2f}x faster than it "
                     f"on this device; the best {best}; {pl}"]
        lines.append(f"auto: scaling law a={self.fit.a:.3f} f={self.fit.f:.2f} "
                     f"({self.fit.source or 'given'}); step cost {self.curve_source}, at cache "
                     f"length {self.cache_len}, tokens: x one-token step = {curve}")
        lines.append("auto: best candidates: " + "; ".join(
            f"{c.label} S {c.S:.2f} / cost {c.cost:.2f} = {c.speedup:.2f}x"
            for c in self.candidates[:top]))
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "config": dataclasses.asdict(self.config),
                "prompt_lookup_speedup": self.prompt_lookup_speedup,
                "curve_source": self.curve_source, "min_speedup": self.min_speedup,
                "fit": self.fit.to_dict(),
                "step_cost_s": {str(k): v for k, v in self.step_costs.items()},
                "cache_len": self.cache_len,
                "candidates": [dataclasses.asdict(c) for c in self.candidates]}


def candidate_grid(Ws: Iterable[int] = GRID_W, Ns: Iterable[int] = GRID_N,
                   Gs: Iterable[int] | None = None) -> list[tuple[int, int, int]]:
    """(W, N, G) candidates: every W x N, with G = W (or every G in `Gs` when given)."""
    out = []
    for n in Ns:
        for w in Ws:
            for g in (Gs if Gs is not None else (w,)):
                out.append((int(w), int(n), int(g)))
    if not out:
        raise ConfigError("auto: the candidate grid is empty")
    for w, n, g in out:
        LookaheadConfig(W=w, N=n, G=g)  # raises ConfigError on an invalid setting
    return out


def monotone_costs(step_costs: Mapping[int, float]) -> dict[int, float]:
    """The curve made non-decreasing in T: cost(T) = min over measured T' >= T (a step of
    fewer tokens never costs more than a wider one, which could be padded to it); this removes
    timing spikes at small T, which would otherwise inflate every step's relative cost."""
    if not step_costs:
        raise ConfigError("auto: the step-cost curve is empty")
    costs = {int(t): float(c) for t, c in step_costs.items()}
    if any(t < 1 or not c > 0 for t, c in costs.items()):
        raise ConfigError("auto: step costs need token counts >= 1 and times > 0")
    out, low = {}, float("inf")
    for t in sorted(costs, reverse=True):
        low = min(low, costs[t])
        out[t] = low
    return dict(sorted(out.items()))


def rank(fit: ScalingFit, step_costs: Mapping[int, float],
         grid: Sequence[tuple[int, int, int]], *, devices: int = 1) -> list[Candidate]:
    """Candidates sorted by predicted speed-up S(W, N, G) / cost(tokens), best first (ties:
    fewer tokens first). step_costs: tokens per step -> seconds (or any unit), smallest
    measured T as the unit (T = 1 when measured), made non-decreasing (`monotone_costs`)."""
    costs = monotone_costs(step_costs)
    out = []
    for w, n, g in grid:
        t = tokens_per_step(w, n, g, devices)
        s = float(fit.predict_S(w, n, g))
        c = relative_cost(costs, t)
        out.append(Candidate(w, n, g, t, s, c, s / c))
    out.sort(key=lambda c: (-c.speedup, c.tokens, c.W, c.N))
    return out


def tokens_to_measure(grid: Sequence[tuple[int, int, int]], devices: int = 1) -> list[int]:
    """Token counts at which to measure the step-cost curve: 1, the powers of two below the
    widest candidate, and the widest candidate itself (interpolated in between)."""
    widest = max(tokens_per_step(w, n, g, devices) for w, n, g in grid)
    ts = {1, widest}
    t = 2
    while t < widest:
        ts.add(t)
        t *= 2
    return sorted(ts)


def resolve_fit(fit: ScalingFit | str | None) -> ScalingFit:
    """A ScalingFit, a path to a JSON fit (`scaling_law.save_fits`), or None: the one default
    fit shipped with the package (`scaling_law.default_fit()`). The fit's `source` says
    which it is (the report prints it)."""
    if fit is None:
        return default_fit()
    if isinstance(fit, ScalingFit):
        return fit
    try:
        return load_fit(fit)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def predicted_step_costs(model_config, token_counts: Sequence[int], *, cache_len: int,
                         device, itemsize: int = 2, kernel: bool = True) -> dict[int, float]:
    """The step-cost curve of a model of `model_config`'s shape on `device` (a roofline
    `Device` or its name), predicted: seconds of one forward pass of T tokens after `cache_len`
    committed ones (the compiled program's cost, `program_cost.forward_cost`, on the roofline,
    `roofline.predict_step_time`), for each T. itemsize: bytes per weight and cache element
    on the device (2: bfloat16). kernel: count the attention as the fused Pallas kernel's
    traffic (what `--attention=auto` runs on a GPU or TPU), else as the dense path's."""
    dev = roofline.device(device) if isinstance(device, str) else device
    layers = roofline.layers_of(model_config)
    attention = program_cost.ATTENTIONS["fused" if kernel else "dense"]
    return {int(t): roofline.predict_step_time(
                program_cost.forward_cost(model_config, tokens=int(t), cache_len=cache_len,
                                          attention=attention),
                dev, itemsize, layers=layers)
            for t in token_counts}


def choose_method(ranked: Sequence[Candidate], step_costs: Mapping[int, float], *,
                  min_speedup: float = MIN_SPEEDUP) -> tuple[str, float]:
    """('lookahead' | 'prompt_lookup' | 'ar', prompt lookup's predicted speed-up): lookahead
    when its best candidate is predicted at least `min_speedup` times faster than plain
    decoding (and not slower than prompt lookup), else prompt lookup when it is, else plain."""
    costs = monotone_costs(step_costs)
    pl = PROMPT_LOOKUP_S / relative_cost(costs, PROMPT_LOOKUP_TOKENS)
    best = ranked[0].speedup if ranked else 0.0
    if best >= min_speedup and best >= pl:
        return "lookahead", pl
    if pl >= min_speedup:
        return "prompt_lookup", pl
    return "ar", pl


def choose_settings(engine, *, prompt_len: int = 64, max_new_tokens: int = 128,
                    fit: ScalingFit | str | None = None,
                    grid: Sequence[tuple[int, int, int]] | None = None,
                    base: LookaheadConfig | None = None,
                    step_costs: Mapping[int, float] | None = None,
                    device=None, min_speedup: float = MIN_SPEEDUP,
                    repeats: int = 5) -> AutoChoice:
    """Ranks `grid` (default `candidate_grid()`) with `fit` (a ScalingFit or a JSON path;
    default `resolve_fit(None)`) on a step-cost curve and chooses the method (`choose_method`).

    The curve: `step_costs` when given; else predicted for `device` (a roofline `Device` or its
    name) when given; else measured on the current device with `engine`'s model. It is taken
    at cache length prompt_len + max_new_tokens // 2 (the middle of a generation). The chosen
    config keeps `base`'s other fields (pool, prompt seeding; default: engine.lookahead, else
    LookaheadConfig's defaults)."""
    def measure(points, cache_len):
        return measure_step_cost(engine.graphdef, engine.params, points, cache_len=cache_len,
                                 repeats=repeats)

    return choose_for_model(
        engine.config, prompt_len=prompt_len, max_new_tokens=max_new_tokens, fit=fit, grid=grid,
        base=base or getattr(engine, "lookahead", None), step_costs=step_costs, device=device,
        min_speedup=min_speedup, devices=getattr(engine, "devices", 1) or 1,
        kernel=getattr(engine, "attention", "dense") != "dense", measure=measure)


def choose_for_model(model_config, *, prompt_len: int = 64, max_new_tokens: int = 128,
                     fit: ScalingFit | str | None = None,
                     grid: Sequence[tuple[int, int, int]] | None = None,
                     base: LookaheadConfig | None = None,
                     step_costs: Mapping[int, float] | None = None, device=None,
                     min_speedup: float = MIN_SPEEDUP, devices: int = 1, kernel: bool = True,
                     measure=None) -> AutoChoice:
    """`choose_settings` for a model config without an engine: the curve is `step_costs`, or
    predicted for `device` (kernel: the Pallas kernel's attention traffic, else dense), or
    `measure(token counts, cache_len)` -> {tokens: seconds}. What the presets' lookahead
    settings are chosen with (`benchmarks/family_presets.py`)."""
    fit = resolve_fit(fit)
    grid = list(grid) if grid is not None else candidate_grid()
    if not grid:
        raise ConfigError("auto: the candidate grid is empty")
    limit = model_config.max_position_embeddings
    fitting = [c for c in grid if tokens_per_step(*c) <= limit]
    if not fitting:
        raise ConfigError(f"auto: no candidate's step fits the model's {limit} positions")
    cache_len = max(1, int(prompt_len) + int(max_new_tokens) // 2)
    points = sorted(set(tokens_to_measure(fitting, devices)) | {PROMPT_LOOKUP_TOKENS})
    if step_costs is not None:
        source = "given"
    elif device is not None:
        step_costs = predicted_step_costs(model_config, points, cache_len=cache_len,
                                          device=device, kernel=kernel)
        name = device if isinstance(device, str) else device.name
        source = (f"predicted for {name} by the roofline model ("
                  f"{'the Pallas kernel' if kernel else 'dense attention'})")
    elif measure is not None:
        step_costs = measure(points, cache_len)
        source = (f"measured on this {jax.default_backend()} device "
                  f"({jax.devices()[0].device_kind})")
    else:
        raise ConfigError("auto: no step-cost curve: give step_costs, a device or measure")
    ranked = rank(fit, step_costs, fitting, devices=devices)
    method, pl = choose_method(ranked, step_costs, min_speedup=min_speedup)
    base = base or LookaheadConfig()
    b = ranked[0]
    pool_slots = base.pool_slots if base.pool_slots == 0 or base.pool_slots >= b.G else 0
    config = dataclasses.replace(base, W=b.W, N=b.N, G=b.G, pool_slots=pool_slots)
    return AutoChoice(config, ranked, fit, {int(k): float(v) for k, v in step_costs.items()},
                      cache_len, method, pl, source, min_speedup)
