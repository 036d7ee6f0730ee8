"""The benchmark suite (`benchmarks/suite*.py`): method parsing, the prompt-set loaders, every
method built by the registry with the run's sampling, a smoke run on the tiny random Llama with
a tiny data directory (JSON, Markdown and PNGs written, every output equal to plain greedy,
speed-ups equal to the recorded times' ratios), and the reference figures' data file."""

from __future__ import annotations

import gzip
import json
import os

import pytest
from absl import flags
from conftest import tiny_bpe_tokenizer

from benchmarks import common, suite, suite_methods
from lookahead_jax.lookahead.config import LookaheadConfig
from lookahead_jax.sampling import Sampling

HERE = os.path.dirname(os.path.abspath(__file__))
DRAFTER = os.path.join(HERE, "data", "golden_drafter_tiny_ouro.safetensors")


def test_split_and_parse_methods():
    assert suite_methods.split_methods("ar,lookahead:15,5,15,prompt_lookup;loopspec") == [
        "ar", "lookahead:15,5,15", "prompt_lookup", "loopspec"]
    specs = suite.parse_methods("lookahead:15,5,15,lookahead:7,5,7+prompt,prompt_lookup:8,2,"
                                "lookahead,ar", LookaheadConfig(W=4, N=3, G=4))
    assert [s.label for s in specs] == ["plain", "lookahead (15,5,15)",
                                        "lookahead (7,5,7) +prompt", "prompt_lookup:8,2",
                                        "lookahead (4,3,4)"]
    assert specs[2].lookahead.prompt_seeding
    assert [s.label for s in suite.sweep_methods([1, 3], [5])] == [
        "lookahead (1,5,1)", "lookahead (3,5,3)"]


@pytest.mark.parametrize("text,fragment", [
    ("beam_search", "unknown method"),
    ("lookahead:15,5", "W,N,G"),
    ("lookahead:15,1,15", "N"),
    ("lookahead:a,b,c", "bad numbers"),
    ("ar:3", "no settings"),
    ("prompt_lookup:0", "K draft tokens"),
    ("loopspec:2", "no settings"),
    ("prompt_lookup+prompt", "lookahead only"),
    ("ar+prompt", "lookahead only"),
])
def test_parse_methods_rejects(text, fragment):
    with pytest.raises(suite.SuiteError, match="--methods") as e:
        suite.parse_methods(text)
    assert fragment in str(e.value)


def test_applicable():
    la = suite.MethodSpec("lookahead", LookaheadConfig())
    applicable = suite_methods.applicable
    assert applicable(la, looped_model=False) is None
    assert "Llama" in applicable(la, looped_model=True)
    assert "looped" in applicable(suite.MethodSpec("loopspec"), looped_model=False)
    assert applicable(suite.MethodSpec("ar"), looped_model=True) is None


# -- a tiny data directory -----------------------------------------------------------------------
def write_data(path, n: int = 2):
    # prompts of 17-32 tokens with the test's tokenizer: one padded shape, one compile a method
    texts = ["add two numbers and return the answer, the quick brown fox jumps, hello world",
             "the quick brown fox jumps, hello world and again, add two numbers and again",
             "hello world, add two numbers, return the answer, the quick brown fox and again"]
    with open(path / common.MT_BENCH, "w") as f:
        for t in texts[:n]:
            f.write(json.dumps({"turns": [t, "and again"]}) + "\n")
    with gzip.open(path / common.HUMANEVAL, "wt") as f:
        for t in texts[:n]:
            f.write(json.dumps({"prompt": f"def f():\n    # {t}\n"}) + "\n")
    with open(path / common.GSM8K, "w") as f:
        for t in texts[:n]:
            f.write(json.dumps({"question": t, "answer": "4"}) + "\n")
    with open(path / common.MBPP, "w") as f:
        f.write(json.dumps({"task_id": 5, "text": "not in the test split", "test_list": []}) + "\n")
        for k, t in enumerate(["add two numbers", "hello world", "the quick brown fox"][:n]):
            f.write(json.dumps({"task_id": 11 + k, "text": t,
                                "test_list": ["assert f() == 1"]}) + "\n")
    (path / common.CLASSEVAL).write_text(json.dumps(
        [{"skeleton": f"class A:\n    # {t}\n"} for t in texts[:n]]))
    return str(path)


def test_new_loaders(tmp_path):
    d = write_data(tmp_path, 3)
    mbpp = common.mbpp_prompts(d, 2)
    assert len(mbpp) == 2 and mbpp[0].startswith("add two numbers\nYour code")
    assert "assert f() == 1" in mbpp[0] and "not in the test split" not in "".join(mbpp)
    assert common.classeval_prompts(d, None)[2].startswith("class A:\n    # hello world,")
    (tmp_path / common.CLASSEVAL).write_text("{}")
    with pytest.raises(common.DataError, match="list"):
        common.classeval_prompts(d)


@pytest.fixture(scope="module")
def tiny_engine():
    """tiny_llama's random weights with a small byte-level BPE tokenizer and chat template."""
    from lookahead_jax.engine import Engine
    tok = tiny_bpe_tokenizer(
        ["add two numbers, the quick brown fox, hello world, def f():\n    # class A:\n",
         "<s>user: \nassistant:\nYour code should pass these tests:\nassert f() == 1",
         "return the answer and again"], 500)
    engine = Engine.from_preset("tiny_llama")
    engine.tokenizer = tok
    return engine


def _summed(runs: list[dict]) -> dict[tuple[str, str], tuple[int, int, float]]:
    """(data set, method) -> (tokens, steps, seconds) summed over the JSON's run records."""
    out: dict = {}
    for r in runs:
        t, n, sec = out.get((r["dataset"], r["method"]), (0, 0, 0.0))
        out[(r["dataset"], r["method"])] = (t + r["tokens"], n + r["steps"],
                                           sec + r["prefill_s"] + r["decode_s"])
    return out


def _md_rows(md: str) -> list[list[str]]:
    """The cells of the main Markdown table (after the header and the --- line)."""
    lines = md.split("| data set | method |", 1)[1].split("\n\n", 1)[0].splitlines()[2:]
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines]


def _is_png(path: str) -> tuple[int, int]:
    """(width, height) of a PNG file; fails if it is not one."""
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n", path
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


def test_suite_smoke(tiny_engine, tmp_path):
    os.makedirs(tmp_path / "data")
    data = write_data(tmp_path / "data")
    out = str(tmp_path / "res" / "suite.json")
    specs = suite.parse_methods("ar,lookahead:1,3,1,lookahead:2,3,2,lookahead:3,3,3,"
                                "prompt_lookup,loopspec")
    opts = suite.SuiteOptions(methods=specs, datasets=list(common.DATASETS), num_prompts=1,
                              max_new_tokens=6, data_dir=data, out=out, progress=True,
                              step_cost=False,
                              fit_out=str(tmp_path / "res" / "fit.json"), config="tiny_llama")
    logs = []
    report = suite.run_suite(tiny_engine, opts, log=logs.append)
    assert any("loopspec needs a looped preset" in line for line in logs)
    rows = report["summary"]
    methods = ["plain", "lookahead (1,3,1)", "lookahead (2,3,2)", "lookahead (3,3,3)",
               "prompt_lookup"]
    assert {(r["dataset"], r["method"]) for r in rows} == {
        (ds, m) for ds in common.DATASETS for m in methods}
    saved = json.load(open(out))
    assert saved["summary"] == json.loads(json.dumps(rows))  # the JSON holds what was returned
    assert len(saved["runs"]) == 5 * 5
    sums = _summed(saved["runs"])
    for r in rows:
        assert r["exact"] == r["prompts"] == 1, r  # every output equals plain greedy
        tokens, steps, secs = sums[(r["dataset"], r["method"])]
        p_tokens, _, p_secs = sums[(r["dataset"], "plain")]
        assert tokens == p_tokens == 6 and r["S"] == pytest.approx(tokens / steps)
        # speed-up: the ratio of the two measured times in the JSON (same tokens)
        assert r["speedup"] == pytest.approx(p_secs / secs, rel=1e-9)
        assert (r["speedup"] == 1.0) == (r["method"] == "plain")
    stem = str(tmp_path / "res" / "suite")
    for path in (stem + "_sweep.png", stem + "_hist.png"):
        width, height = _is_png(path)
        assert width > 300 and height > 200, (path, width, height)
    md = open(stem + ".md").read()
    table = _md_rows(md)
    assert sorted((c[0], c[1]) for c in table) == sorted((r["dataset"], r["method"])
                                                         for r in rows)
    assert all(c[3] == "1/1" for c in table)  # the exact column
    # random weights accept nothing in 6 tokens (S = 1): no fit, each group says why, and
    # neither the fit file nor its plot is written
    assert all(r["S"] == 1.0 for r in rows) and report["fits"] == {}
    assert set(report["fit_notes"]) == {*common.DATASETS, "all"}
    assert all("no measured S is above 1" in v for v in report["fit_notes"].values())
    assert not os.path.exists(tmp_path / "res" / "fit.json")
    assert not os.path.exists(stem + "_fit.png")
    lengths = {len(ids) for ds in common.DATASETS
               for ids in common.encoded_prompts(tiny_engine, ds, 1, data)}
    assert 16 < min(lengths) and max(lengths) <= 32, lengths  # one bucket: few compiles


def test_suite_check_auto(tiny_engine, tmp_path):
    from lookahead_jax.tuning import auto
    from lookahead_jax.tuning.scaling_law import ScalingFit
    os.makedirs(tmp_path / "data")
    data = write_data(tmp_path / "data", 1)
    out = str(tmp_path / "suite.json")
    grid = [(1, 3, 1), (3, 3, 3), (2, 4, 2)]
    opts = suite.SuiteOptions(methods=suite.parse_methods("lookahead:1,3,1,lookahead:2,3,2"),
                              datasets=["humaneval", "gsm8k"], num_prompts=1, max_new_tokens=4,
                              data_dir=data, out=out, check_auto=True, progress=False,
                              plots=False, auto_grid=grid)
    report = suite.run_suite(tiny_engine, opts, log=lambda s: None)
    chk = report["auto_check"]
    assert set(chk["datasets"]) == {"humaneval", "gsm8k"}
    costs = {int(k): v for k, v in report["step_cost_s"].items()}
    best = auto.rank(ScalingFit.from_dict(chk["fit"]), costs, grid)[0]
    assert chk["label"] == f"lookahead ({best.W},{best.N},{best.G})"
    rows = report["summary"] + [r for r in common.summarize_runs(chk["runs"])
                                if r["method"] == chk["label"]]
    for ds, v in chk["datasets"].items():
        mine = next(r for r in rows if r["dataset"] == ds and r["method"] == chk["label"])
        top = max((r for r in rows if r["dataset"] == ds and r.get("W") is not None),
                  key=lambda r: r["speedup"])
        assert v["exact"] == 1 and v["auto_speedup"] == pytest.approx(mine["speedup"])
        assert (v["best"], v["best_speedup"]) == (top["method"], pytest.approx(top["speedup"]))
        assert v["ratio"] == pytest.approx(mine["speedup"] / top["speedup"]) and v["ratio"] <= 1
        assert v["within_10pct"] == (v["ratio"] >= 0.9)
    assert chk["passed"] == all(v["within_10pct"] for v in chk["datasets"].values())
    md = open(str(tmp_path / "suite.md")).read()
    assert f"--auto picks {chk['label']}" in md
    assert f"--auto check: {'passed' if chk['passed'] else 'FAILED'}" in md


def test_suite_builds_every_method_with_the_runs_sampling(tiny_engine, tmp_path):
    """Bug 1 of issue 16: `--temperature=0.7` on a looped preset compared sampled plain
    decoding with greedy LoopSpec / LoopAhead (prebuilt with the default sampling). Every
    method the suite builds, from the command line's flags, carries Sampling(0.7), and every
    run record says it decoded with it."""
    from lookahead_jax.engine import Engine
    from lookahead_jax.store.presets import load_preset
    fv = flags.FlagValues()
    suite.define_flags(fv)
    fv(["suite", "--config=tiny_ouro", "--temperature=0.7", f"--lad={DRAFTER}",
        "--methods=ar,loopspec,loopspec_d2,loopspec_matched,loopahead,loopahead_nodrafter,"
        "loopahead_nosched"])
    opts = suite.options_from_flags(load_preset("tiny_ouro"), fv)
    assert opts.sampling == Sampling(0.7)
    engine = Engine.from_preset("tiny_ouro")
    built = suite_methods.build_methods(engine, opts.methods, opts.sampling, opts.lad)
    assert list(built) == ["plain", "loopspec", "loopspec_d2", "loopspec_matched", "loopahead",
                           "loopahead_nodrafter", "loopahead_nosched"]
    assert {label: m.sampling for label, m in built.items()} == {
        label: Sampling(0.7) for label in built}
    assert built["loopahead"].drafter is not None and built["loopahead"].r1 == \
        built["loopahead"].drafter.draft_depth
    assert built["loopahead_nodrafter"].drafter is None
    assert not built["loopahead_nosched"].scheduling
    matched, ahead = built["loopspec_matched"], built["loopahead"]
    assert (matched.name, matched.d1, matched.d2) == ("loopspec", ahead.r1, ahead.r2)
    with pytest.raises(suite.SuiteError, match="loopspec_matched needs --lad"):
        suite_methods.build_methods(engine, suite.parse_methods("loopspec_matched"),
                                    opts.sampling, None)

    llama = suite_methods.build_methods(
        tiny_engine, suite.parse_methods("lookahead:2,3,2,prompt_lookup:4"),
        Sampling(0.7, top_k=5))
    assert {m.sampling for m in llama.values()} == {Sampling(0.7, top_k=5)}

    os.makedirs(tmp_path / "data")
    write_data(tmp_path / "data", 1)
    run = suite.SuiteOptions(methods=suite.parse_methods("loopspec,loopahead"),
                             datasets=["gsm8k"], num_prompts=1, max_new_tokens=4,
                             data_dir=str(tmp_path / "data"), out=str(tmp_path / "s.json"),
                             sampling=opts.sampling, lad=DRAFTER, progress=False, plots=False)
    report = suite.run_suite(engine, run, log=lambda s: None)
    assert [r["method"] for r in report["runs"]] == ["plain", "loopspec", "loopahead"]
    for r in report["runs"]:
        assert r["sampling"] == {"temperature": 0.7, "top_k": 0, "top_p": 1.0}, r
        assert r["exact"] is None  # sampled: exactness does not apply
    assert all(r["exact"] is None for r in report["summary"])


def test_suite_errors(tiny_engine, tmp_path):
    opts = suite.SuiteOptions(methods=suite.parse_methods("ar"), datasets=["nope"],
                              num_prompts=1, data_dir=str(tmp_path), out=str(tmp_path / "x.json"))
    with pytest.raises(suite.SuiteError, match="unknown data set"):
        suite.run_suite(tiny_engine, opts, log=lambda s: None)
    opts.datasets = ["gsm8k"]
    with pytest.raises(common.DataError, match="not found"):
        suite.run_suite(tiny_engine, opts, log=lambda s: None)


def test_reference_figures_come_from_the_data_file():
    """The reference implementation's figures live in a committed data file with their
    source, not in code; lookahead_bench keys them by its own method labels."""
    from benchmarks import lookahead_bench
    ref = lookahead_bench.load_reference()
    assert "ALGORITHM_NOTES.md" in ref["source"] and ref["config"] == "smollm2_135m"
    assert ref["by_label"]["(15,5,15)"] == {"mt_bench": (1.64, 8.7), "humaneval": (1.82, 9.5),
                                            "gsm8k": (1.94, 10.2)}
    assert ref["by_label"]["(15,5,15) +prompt"]["humaneval"] == (2.17, 12.3)
    assert set(ref["by_label"]) == {"(15,5,15)", "(15,5,15) +prompt", "(7,5,7)", "(5,4,5)"}


# ---------------------------------------------------------------------- degeneracy (#21) ---
def test_degeneracy_scores():
    from benchmarks.degeneracy import distinct_ngram_ratio, ends_in_cycle, score  # noqa: PLC0415
    text = list(range(40))
    assert ends_in_cycle(text) == 0
    assert ends_in_cycle(text + [7] * 12) == 1
    assert ends_in_cycle(text + [7] * 11) == 0  # a cycle of period 1 needs 12 tokens
    assert ends_in_cycle(text + [1, 2, 3] * 4) == 3
    assert ends_in_cycle(text + [1, 2, 3, 4, 5] * 3) == 5  # 3 periods of 5
    assert ends_in_cycle(text + [1, 2, 3, 4, 5] * 2 + [1, 2, 3, 4]) == 0
    assert ends_in_cycle([1, 2, 3] * 10 + text) == 0  # a loop that the text left
    assert ends_in_cycle(list(range(17)) * 3) == 0  # longer than the longest period
    assert ends_in_cycle([5] * 11) == 0  # too short to tell
    assert distinct_ngram_ratio(list(range(10))) == 1.0
    assert distinct_ngram_ratio([1, 2] * 10) == 2 / 17
    assert distinct_ngram_ratio([1, 2]) == 1.0
    s = score(text + [9] * 12 + [0], eos_ids=(0,))
    assert s == {"cycle": 1, "distinct4": round(41 / 49, 4), "length": 52, "eos": True}
    assert not score([0, 1], eos_ids=(2,))["eos"]


def test_degeneracy_smoke(tiny_engine, tmp_path):
    """`benchmarks.degeneracy` on the tiny random Llama: 3 prompts in batches of 2, each output
    the one-prompt greedy run's and scored; the table."""
    from benchmarks import degeneracy  # noqa: PLC0415
    data = write_data(tmp_path, n=3)
    results = degeneracy.run(tiny_engine, ["gsm8k", "humaneval"], 3, 8, data, batch_size=2)
    for name in ("gsm8k", "humaneval"):
        outs = results[name]["outputs"]
        prompts = common.encoded_prompts(tiny_engine, name, 3, data)
        assert [o["ids"] for o in outs] == [
            tiny_engine.generate_ids([p], method="ar", max_new_tokens=8).tokens[0]
            for p in prompts]
        assert [o["scores"] for o in outs] == [
            degeneracy.score(o["ids"], tiny_engine.eos_ids) for o in outs]
        summary = results[name]["summary"]
        assert summary["prompts"] == 3 and 0 <= summary["distinct4"] <= 1
        assert results[name]["too_long"] == []
    assert "| gsm8k | 3 | 0 |" in degeneracy.table(results)
    # a limit that the prompts (17-32 tokens, padded to 32) and 8 new tokens exceed
    short = degeneracy.run(tiny_engine, ["gsm8k"], 3, 8, data, max_positions=39)
    assert short["gsm8k"]["too_long"] == [0, 1, 2] and short["gsm8k"]["outputs"] == []
    assert degeneracy.fits(31, 8, 40) and not degeneracy.fits(33, 8, 64)


def test_degeneracy_main_in_another_dtype(tmp_path):
    """The command line on the shipped tiny_ouro in bfloat16 (--dtype): its file records the
    dtype, and the outputs are that dtype's greedy outputs, not the preset's float32 ones."""
    from benchmarks import degeneracy  # noqa: PLC0415
    from lookahead_jax.engine import Engine  # noqa: PLC0415
    os.makedirs(tmp_path / "data")
    data = write_data(tmp_path / "data", n=2)
    out = tmp_path / "out"
    argv = ["--config", "tiny_ouro", "--sets", "gsm8k", "--num_prompts", "2",
            "--max_new_tokens", "6", "--data_dir", data, "--out", str(out), "--tag", "t"]
    assert degeneracy.main(argv + ["--dtype", "bfloat16"]) == 0
    rec = json.loads((out / "degeneracy_t.json").read_text())
    assert rec["dtype"] == "bfloat16" and rec["config"] == "tiny_ouro"
    engine = Engine.from_preset("tiny_ouro", dtype="bfloat16")
    prompts = common.encoded_prompts(engine, "gsm8k", 2, data)
    assert [o["ids"] for o in rec["sets"]["gsm8k"]["outputs"]] == engine.generate_ids(
        prompts, method="ar", max_new_tokens=6).tokens
    with pytest.raises(SystemExit):
        degeneracy.main(argv + ["--dtype", "float16"])


def _scored(d4s, cycles=(), first=0):
    """A `degeneracy.run`-shaped set of outputs with the given distinct-4 scores."""
    return {"outputs": [{"prompt": first + i, "scores": {"distinct4": d, "cycle": int(
        i in cycles)}} for i, d in enumerate(d4s)]}


def test_degeneracy_compare(tmp_path, capsys):
    """--compare pairs two files' outputs by prompt: a constant gap has a zero-width interval
    at that gap; a gap that differs in sign between prompts straddles zero; cycles in one side
    only give a cycle-share difference whose interval excludes zero when every prompt differs
    and holds it when one does; prompts or sets only one side scored are left out; two files
    with nothing in common are an error."""
    from benchmarks import degeneracy  # noqa: PLC0415
    a = {"gsm8k": _scored([0.5] * 6, cycles=(1,)), "mbpp": _scored([1.0, 0.2, 1.0, 0.2]),
         "humaneval": _scored([0.9])}
    b = {"gsm8k": _scored([0.9] * 5, first=1), "mbpp": _scored([0.2, 1.0, 0.2, 1.0])}
    cmp = degeneracy.compare(a, b, resamples=2000)
    g = cmp["gsm8k"]
    assert g["prompts"] == 5 and g["cycles_a"] == 1 and g["cycles_b"] == 0
    assert g["cycle_diff"] == pytest.approx(0.2) and g["cycle_high"] > 0.2
    assert g["cycle_low"] == pytest.approx(0.0)  # one cycle in five: often no cycle drawn
    loops = degeneracy.compare({"mbpp": _scored([0.2] * 4, cycles=range(4))},
                               {"mbpp": _scored([0.2] * 4)}, resamples=500)["mbpp"]
    assert loops["cycle_diff"] == loops["cycle_low"] == loops["cycle_high"] == 1.0
    assert "all" not in loops  # one set: no "all" row repeating it
    mixed = degeneracy.compare({"mbpp": _scored([0.2] * 8, cycles=(0, 1, 2))},
                               {"mbpp": _scored([0.2] * 8, cycles=(3, 4))}, resamples=2000)
    mixed = mixed["mbpp"]
    assert mixed["cycles_a"] == 3 and mixed["cycles_b"] == 2
    assert mixed["cycle_diff"] == pytest.approx(1 / 8)
    assert mixed["cycle_low"] < 0 < mixed["cycle_high"]
    assert g["diff"] == pytest.approx(-0.4) and g["low"] == pytest.approx(-0.4)
    assert g["high"] == pytest.approx(-0.4)
    m = cmp["mbpp"]
    assert m["diff"] == pytest.approx(0.0) and m["low"] < -0.2 and m["high"] > 0.2
    assert m["cycle_diff"] == m["cycle_low"] == m["cycle_high"] == 0.0
    assert "humaneval" not in cmp and cmp["all"]["prompts"] == 9
    assert cmp["all"]["diff"] == pytest.approx(-0.4 * 5 / 9)
    assert degeneracy.compare(a, b, resamples=2000, seed=3)["mbpp"]["low"] < 0
    with pytest.raises(ValueError, match="no scored prompt"):
        degeneracy.compare({"gsm8k": _scored([0.5])}, {"gsm8k": _scored([0.5], first=1)})
    late = degeneracy.compare(a, b, resamples=2000, skip=3)
    assert late["gsm8k"]["prompts"] == 3 and late["gsm8k"]["cycles_a"] == 0
    assert late["mbpp"]["prompts"] == 1 and late["mbpp"]["diff"] == pytest.approx(-0.8)
    assert late["all"]["prompts"] == 4
    with pytest.raises(ValueError, match="skip must be >= 0"):
        degeneracy.compare(a, b, skip=-1)
    paths = []
    for name, sets in (("a", a), ("b", b)):
        paths.append(str(tmp_path / f"{name}.json"))
        with open(paths[-1], "w") as f:
            json.dump({"config": name, "dtype": "float32", "sets": sets}, f)
    assert degeneracy.main(["--compare", *paths, "--resamples", "500"]) == 0
    printed = capsys.readouterr().out
    assert "cycle share A - B [95%]" in printed
    assert ("| gsm8k | 5 | 1 / 0 | +0.200 [+0.000, +0.600] | 0.500 / 0.900 "
            "| -0.400 [-0.400, -0.400] |") in printed
    assert degeneracy.main(["--compare", *paths, "--resamples", "500", "--skip", "3"]) == 0
    printed = capsys.readouterr().out
    assert "first 3 prompts left out" in printed and "| gsm8k | 3 | 0 / 0 |" in printed
    with pytest.raises(SystemExit):
        degeneracy.main(["--compare", *paths, "--skip", "-2"])
    with pytest.raises(SystemExit):
        degeneracy.main(["--compare", paths[0], str(tmp_path / "missing.json")])
    (tmp_path / "other.json").write_text(json.dumps({"rows": []}))
    with pytest.raises(SystemExit, match="not a benchmarks.degeneracy results file"):
        degeneracy.main(["--compare", paths[0], str(tmp_path / "other.json")])
