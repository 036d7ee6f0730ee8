"""The suite's methods: `--methods` text -> `MethodSpec`s -> `Method`s, every one built by the
registry (`Engine.build_method`) with the run's `Sampling`, so a sampled run compares sampled
methods with sampled plain decoding."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from benchmarks.looped_bench import looped_methods
from lookahead_jax.lookahead.config import LookaheadConfig
from lookahead_jax.method import Method
from lookahead_jax.sampling import Sampling
from models.config import ConfigError

LOOKAHEAD_DEFAULT = "ar,lookahead:15,5,15,lookahead:7,5,7,lookahead:5,3,5,prompt_lookup"
LOOPED_DEFAULT = "ar,loopspec,loopahead"
LOOPED_NAMES = ("loopspec", "loopspec_d2", "loopspec_matched", "loopahead",
                "loopahead_nodrafter", "loopahead_nosched")


class SuiteError(Exception):
    """Bad suite settings (methods, sweep, data sets); the message says which and why."""


@dataclasses.dataclass(frozen=True)
class MethodSpec:
    """One method of the suite: `name` (ar | lookahead | prompt_lookup | a looped method),
    its lookahead settings or its own numbers (`args`), and the label it is reported under."""

    name: str
    lookahead: LookaheadConfig | None = None
    args: tuple[int, ...] = ()

    @property
    def label(self) -> str:
        if self.name == "ar":
            return "plain"
        if self.name == "lookahead" and self.lookahead is not None:
            c = self.lookahead
            return f"lookahead ({c.W},{c.N},{c.G})" + (" +prompt" if c.prompt_seeding else "")
        if self.args:
            return f"{self.name}:{','.join(str(a) for a in self.args)}"
        return self.name

    @property
    def looped(self) -> bool:
        return self.name in LOOPED_NAMES

    def settings(self) -> dict[str, Any]:
        """The registry settings of a non-looped spec (named as the CLI flags)."""
        if self.name == "lookahead":
            return {"lookahead": self.lookahead}
        if self.name == "prompt_lookup":
            return dict(zip(("pl_tokens", "pl_ngram"), self.args))
        return {}


def split_methods(text: str) -> list[str]:
    """"ar,lookahead:15,5,15,prompt_lookup" -> ["ar", "lookahead:15,5,15", "prompt_lookup"]:
    a bare number (or number+suffix) continues the method before it."""
    out: list[str] = []
    for tok in (t.strip() for t in text.replace(";", ",").split(",")):
        if not tok:
            continue
        if tok[0].isdigit() and out:
            out[-1] += "," + tok
        else:
            out.append(tok)
    return out


def _lookahead_spec(item: str, nums: tuple[int, ...], seeded: bool,
                    preset_lookahead: LookaheadConfig | None) -> MethodSpec:
    if nums and len(nums) != 3:
        raise SuiteError(f"--methods: {item!r}: expected lookahead:W,N,G")
    base = preset_lookahead or LookaheadConfig()
    try:
        cfg = (LookaheadConfig(W=nums[0], N=nums[1], G=nums[2], prompt_seeding=seeded)
               if nums else dataclasses.replace(base, prompt_seeding=seeded
                                                or base.prompt_seeding))
    except ConfigError as e:
        raise SuiteError(f"--methods: {item!r}: {e}") from None
    return MethodSpec("lookahead", cfg)


def parse_method(item: str, preset_lookahead: LookaheadConfig | None = None) -> MethodSpec:
    """One --methods item ("lookahead:7,5,7+prompt", "prompt_lookup:8", "loopspec", ...)."""
    seeded = item.endswith("+prompt")
    name, _, rest = (item[: -len("+prompt")] if seeded else item).partition(":")
    name = name.strip().lower()
    try:
        nums = tuple(int(x) for x in rest.split(",")) if rest else ()
    except ValueError:
        raise SuiteError(f"--methods: bad numbers in {item!r}") from None
    if seeded and name != "lookahead":
        raise SuiteError(f"--methods: {item!r}: +prompt applies to lookahead only")
    if name in ("ar", "plain"):
        if nums:
            raise SuiteError(f"--methods: {item!r}: plain decoding takes no settings")
        return MethodSpec("ar")
    if name == "lookahead":
        return _lookahead_spec(item, nums, seeded, preset_lookahead)
    if name == "prompt_lookup":
        if len(nums) > 2 or any(n < 1 for n in nums):
            raise SuiteError(f"--methods: {item!r}: expected prompt_lookup[:K[,M]] with "
                             f"K draft tokens and M the longest suffix, both >= 1")
        return MethodSpec("prompt_lookup", args=nums)
    if name in LOOPED_NAMES:
        if nums:
            raise SuiteError(f"--methods: {item!r}: {name} takes no settings here")
        return MethodSpec(name)
    raise SuiteError(f"--methods: unknown method {name!r} (ar, lookahead[:W,N,G], "
                     f"prompt_lookup[:K[,M]], {', '.join(LOOPED_NAMES)})")


def parse_methods(text: str, preset_lookahead: LookaheadConfig | None = None) -> list[MethodSpec]:
    """The --methods string -> MethodSpecs (plain first, each method once)."""
    specs = [MethodSpec("ar")]
    for item in split_methods(text):
        spec = parse_method(item, preset_lookahead)
        if spec not in specs:
            specs.append(spec)
    return specs


def sweep_methods(Ws: Sequence[int], Ns: Sequence[int], seeding: bool = False) -> list[MethodSpec]:
    """Lookahead at every (W, N) with G = W: the settings of a W sweep (the paper's Figure 8)."""
    out = []
    for n in Ns:
        for w in Ws:
            try:
                out.append(MethodSpec("lookahead", LookaheadConfig(W=int(w), N=int(n), G=int(w),
                                                                   prompt_seeding=seeding)))
            except ConfigError as e:
                raise SuiteError(f"--sweep: W={w}, N={n}: {e}") from None
    return out


def applicable(spec: MethodSpec, looped_model: bool) -> str | None:
    """None if `spec` runs on this kind of model, else why not."""
    if spec.name == "ar":
        return None
    if looped_model and not spec.looped:
        return f"{spec.label} needs a Llama-family preset"
    if spec.looped and not looped_model:
        return f"{spec.label} needs a looped preset (e.g. --config=tiny_ouro)"
    return None


def build_methods(engine, specs: Sequence[MethodSpec], sampling: Sampling,
                  lad: str | None = None) -> dict[str, Method]:
    """label -> the Method of each spec, built by the registry (`engine.build_method`) with
    `sampling`; looped methods as `looped_bench.looped_methods` builds them (`lad`: the
    LoopAhead drafter, a drafter file or a train_lad workdir)."""
    out: dict[str, Method] = {}
    looped = None
    for spec in specs:
        if not spec.looped:
            out[spec.label] = engine.build_method(spec.name, sampling, **spec.settings())
            continue
        if looped is None:
            looped = looped_methods(engine, sampling, lad)
        if spec.name in looped:
            out[spec.label] = looped[spec.name]
        elif spec.name == "loopahead":  # no drafter given: native proposals only
            out[spec.label] = engine.build_method("loopahead", sampling)
        elif spec.name in ("loopahead_nosched", "loopspec_matched"):
            raise SuiteError(f"{spec.name} needs --lad (a drafter file or a train_lad work "
                             f"directory)")
        else:
            raise SuiteError(f"{spec.name} does not apply to a model of "
                             f"{engine.config.num_loops} loops")
    return out
