"""The method registry and the `Method` base class: one place where a name and settings become a
method, which carries the sampling it was asked for; a cache sized from each method's declared
capacity; and the three bugs issue #16 found, each pinned by a test that failed before its fix:

1. a method built for a sampled run was greedy (prebuilt instances kept the default Sampling);
2. `--method=loopahead --lad=DIR` ignored the drafter's trained draft depth (r1 stayed 1);
3. LoopSpec guessed 32 scratch slots, but a 32-loop model (huginn_0125's R) needs 33.
"""

from __future__ import annotations

import dataclasses
import io
import json

import numpy as np
import pytest
from flax import nnx

from lookahead_jax.engine import Engine
from lookahead_jax.generation import bucket_length, cache_length_for
from lookahead_jax.lookahead.step import Lookahead
from lookahead_jax.looped.drafter import load_drafter_file, save_drafter_file
from lookahead_jax.looped.loopahead import LoopAhead
from lookahead_jax.looped.loopspec import LoopSpec
from lookahead_jax.method import Method
from lookahead_jax.registry import METHODS, build_method
from lookahead_jax.sampling import Sampling
from lookahead_jax.store.presets import load_preset
from models.build import build_looped
from models.config import ConfigError

SAMPLED = Sampling(temperature=0.7, top_p=0.9)
GOLDEN_DRAFTER = "tests/data/golden_drafter_{}.safetensors"


def looped_config(preset: str, **changes):
    """A preset's looped shape made tiny (its loop structure kept unless changed)."""
    cfg = load_preset(preset).model
    small = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_heads=2,
                 num_kv_heads=2, head_dim=16, max_position_embeddings=1024)
    return dataclasses.replace(cfg, **{**small, **changes})


@pytest.mark.parametrize("name", METHODS)
def test_every_method_carries_the_sampling_it_was_built_with(name):
    cfg = load_preset("tiny_ouro" if name in ("loopspec", "loopahead") else "tiny_llama").model
    method = build_method(name, sampling=SAMPLED, model_config=cfg)
    assert isinstance(method, Method) and method.name == name
    assert method.sampling == SAMPLED
    assert build_method(name, model_config=cfg).sampling == Sampling()  # greedy by default


def test_a_setting_of_another_method_is_refused_not_ignored():
    with pytest.raises(ConfigError, match="W.*only applies to --method=lookahead"):
        build_method("ar", W=5)
    with pytest.raises(ConfigError, match="pl_tokens.*prompt_lookup"):
        build_method("lookahead", pl_tokens=3)
    with pytest.raises(ConfigError, match="unknown method 'beam'"):
        build_method("beam")
    with pytest.raises(ConfigError, match="need a looped model"):
        build_method("loopspec", model_config=load_preset("tiny_llama").model)
    assert build_method("lookahead", W=3, N=4, G=2).config.W == 3


def test_an_instance_with_other_sampling_is_refused_by_the_engine():
    engine = Engine.from_preset("tiny_llama")
    greedy = Lookahead()
    with pytest.raises(ConfigError, match="carries its own sampling"):
        engine.generate_ids([[1, 2, 3]], method=greedy, sampling=SAMPLED, max_new_tokens=4)
    res = engine.generate_ids([[1, 2, 3]], method="ar", sampling=SAMPLED, max_new_tokens=4)
    assert len(res.tokens[0]) == 4


def test_compiler_options_reach_xla_and_bad_ones_are_refused():
    """An engine's compiler options go to XLA with its programs (XLA names an option it does
    not know when the first one compiles; a known one leaves the tokens as they were); malformed
    ones are refused before anything compiles."""
    plain = Engine.from_preset("tiny_llama").generate_ids([[1, 2, 3]], method="ar",
                                                          max_new_tokens=4)
    tuned = Engine.from_preset("tiny_llama", compiler_options={"xla_backend_optimization_level": 1})
    assert tuned.generate_ids([[1, 2, 3]], method="ar", max_new_tokens=4).tokens == plain.tokens
    unknown = Engine.from_preset("tiny_llama", compiler_options={"xla_no_such_option": 1})
    with pytest.raises(Exception, match="xla_no_such_option"):
        unknown.generate_ids([[1, 2, 3]], method="ar", max_new_tokens=4)
    for bad, match in [("xla_cpu_enable_fast_math", "must be a mapping"),
                       ({"--xla_gpu_autotune_level": 0}, "without the leading dashes"),
                       ({"xla_gpu_autotune_level": [0]}, "a bool, int, float or str")]:
        with pytest.raises(ConfigError, match=match):
            Engine.from_preset("tiny_llama", compiler_options=bad)
    assert Engine.from_preset("tiny_llama", compiler_options={}).compiler_options is None


@pytest.mark.parametrize("method, capacity", [
    (build_method("ar"), 1), (build_method("lookahead", W=5, N=4, G=5), 4),
    (build_method("prompt_lookup", pl_tokens=6), 7),
    (LoopSpec(d1=1), 5), (LoopSpec(d1=1, d2=2), 10), (LoopAhead(r1=1, r2=2), (0 + 2) * 2 + 4 + 2)])
def test_cache_capacity_is_what_a_step_writes(method, capacity):
    cfg = load_preset("tiny_ouro").model  # 4 loops
    assert method.cache_capacity(cfg) == capacity


def test_loopspec_on_32_loops_sizes_its_cache_from_the_tree():
    """Bug 3: a 32-token prompt, 64 new tokens, R = 32: the tree needs 33 scratch slots, the old
    guess of 32 gave a cache of 128 and `check_scratch_room` raised."""
    # one layer in each part (CI's time: every loop's layers are compiled): the loop count
    # is what sizes the tree
    cfg = looped_config("huginn_0125", num_loops=32, prelude_layers=1, core_layers=1,
                        coda_layers=1)
    assert cfg.family == "raven" and cfg.num_loops == 32
    method = LoopSpec()
    assert method.cache_capacity(cfg) == 33
    assert cache_length_for(bucket_length(32), 64, 33, cfg.max_position_embeddings) == 256
    engine = Engine(build_looped(cfg, rngs=nnx.Rngs(0)), eos_ids=())
    prompt = list(range(1, 33))
    out = engine.generate_ids([prompt], method=method, max_new_tokens=64)
    plain = engine.generate_ids([prompt], method="ar", max_new_tokens=64)
    assert out.tokens == plain.tokens and len(out.tokens[0]) == 64


@pytest.fixture(scope="module")
def depth2_drafter(tmp_path_factory):
    """tiny_raven's golden drafter re-saved as trained on depth-2 states."""
    cfg = load_preset("tiny_raven").model
    drafter = load_drafter_file(GOLDEN_DRAFTER.format("tiny_raven"), cfg)
    path = tmp_path_factory.mktemp("lad") / "drafter.safetensors"
    net = nnx.merge(drafter.graphdef, drafter.params["net"])
    save_drafter_file(path, net, np.asarray(drafter.params["vocab"]), draft_depth=2,
                      model_family=cfg.family, model_loops=cfg.num_loops)
    return str(path)


def test_registry_takes_r1_from_the_drafter(depth2_drafter):
    cfg = load_preset("tiny_raven").model
    method = build_method("loopahead", model_config=cfg, lad=depth2_drafter)
    assert (method.r1, method.r2) == (2, 3) and method.drafter.draft_depth == 2
    with pytest.raises(ConfigError, match="depth-2 states, but r1 is 1"):
        build_method("loopahead", model_config=cfg, lad=depth2_drafter, r1=1)


def test_cli_loopahead_uses_the_drafters_depth(depth2_drafter, tmp_path):
    """Bug 2: the CLI built LoopAhead with r1 = 1 whatever the drafter was trained on."""
    from lookahead_jax import decode  # noqa: PLC0415
    out = tmp_path / "run.json"
    code = decode.run(decode.Options(config="tiny_raven", method="loopahead",
                                     lad=depth2_drafter, prompt="What is a list?",
                                     max_new_tokens=6, json_out=str(out)),
                      stdin=io.StringIO(""), stdout=io.StringIO(), stderr=io.StringIO())
    assert code == 0
    extra = json.loads(out.read_text())["results"][0]["stats"]["extra"]
    assert (extra["r1"], extra["r2"]) == (2, 3)
    assert (extra["max_active"], extra["lad_calls"]) == (0, 1)
    # the budget and the drafter calls from the command line; refused for other methods
    code = decode.run(decode.Options(config="tiny_raven", method="loopahead",
                                     lad=depth2_drafter, prompt="What is a list?",
                                     max_new_tokens=6, json_out=str(out), max_active=5,
                                     lad_calls=2),
                      stdin=io.StringIO(""), stdout=io.StringIO(), stderr=io.StringIO())
    assert code == 0
    extra = json.loads(out.read_text())["results"][0]["stats"]["extra"]
    assert (extra["max_active"], extra["lad_calls"]) == (5, 2)
    err = io.StringIO()
    code = decode.run(decode.Options(config="tiny_raven", method="loopspec", max_active=5,
                                     prompt="What is a list?", max_new_tokens=2),
                      stdin=io.StringIO(""), stdout=io.StringIO(), stderr=err)
    assert code == 2 and "only applies to --method=loopahead" in err.getvalue()


def test_cli_calibrated_retention(depth2_drafter, tmp_path):
    """--retain=calibrated --node_cost reach LoopAhead when sampling with a calibrated drafter
    (the shipped one); an uncalibrated drafter, and greedy decoding, are refused clearly."""
    import os  # noqa: PLC0415

    from lookahead_jax import decode  # noqa: PLC0415
    shipped = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "checkpoints", "tiny_raven_lad")
    out = tmp_path / "run.json"

    def run(**kw):
        err = io.StringIO()
        code = decode.run(decode.Options(config="tiny_raven", method="loopahead",
                                         prompt="What is a list?", max_new_tokens=6,
                                         json_out=str(out), **kw),
                          stdin=io.StringIO(""), stdout=io.StringIO(), stderr=err)
        return code, err.getvalue()

    code, _ = run(lad=shipped, temperature=0.7, retain="calibrated", node_cost=0.25)
    assert code == 0
    extra = json.loads(out.read_text())["results"][0]["stats"]["extra"]
    assert (extra["retain"], extra["node_cost"]) == ("calibrated", 0.25)
    code, err = run(lad=depth2_drafter, temperature=0.7, retain="calibrated")
    assert code == 2 and "needs a drafter with a calibration" in err
    code, err = run(lad=shipped, retain="calibrated")
    assert code == 2 and "greedy decoding keeps every drafted token" in err


def test_cli_suspend_below(depth2_drafter, tmp_path):
    """--suspend_below reaches LoopAhead when sampling (default 0: no child pauses; under a
    budget 1); greedy decoding and a threshold outside [0, 1] are refused clearly. The defaults
    are read from the built method (nothing compiles); one sampled CLI run shows the flag
    reaching the run's record."""
    from lookahead_jax import decode  # noqa: PLC0415
    cfg = load_preset("tiny_raven").model
    for given, budget, sampling, want in ((None, None, SAMPLED, 0.0), (1.0, None, SAMPLED, 1.0),
                                          (None, 4, SAMPLED, 1.0), (0.0, 4, SAMPLED, 0.0),
                                          (None, 4, Sampling(), 0.0)):  # greedy: stays 0
        method = build_method("loopahead", sampling=sampling, model_config=cfg,
                              lad=depth2_drafter, suspend_below=given, max_active=budget)
        assert method.suspend_below == want, (given, budget, sampling)
    out = tmp_path / "run.json"

    def run(**kw):
        err = io.StringIO()
        code = decode.run(decode.Options(config="tiny_raven", method="loopahead",
                                         lad=depth2_drafter, prompt="What is a list?",
                                         max_new_tokens=6, json_out=str(out), **kw),
                          stdin=io.StringIO(""), stdout=io.StringIO(), stderr=err)
        return code, err.getvalue()

    code, _ = run(temperature=0.7, suspend_below=0.5)
    assert code == 0
    assert json.loads(out.read_text())["results"][0]["stats"]["extra"]["suspend_below"] == 0.5
    code, err = run(suspend_below=1.0)
    assert code == 2 and "suspend_below applies when sampling" in err
    code, err = run(temperature=0.7, suspend_below=1.5)
    assert code == 2 and "must lie in [0, 1]" in err
