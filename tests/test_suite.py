"""The benchmark suite (`benchmarks/suite.py`): method parsing, the new prompt-set loaders, and
a smoke run on the tiny random Llama with a tiny data directory (JSON, Markdown and PNGs
written, every output equal to plain greedy)."""

from __future__ import annotations

import gzip
import json
import os

import pytest

from benchmarks import common, suite
from lookahead_jax.config import LookaheadConfig


def test_split_and_parse_methods():
    assert suite._split_methods("ar,lookahead:15,5,15,prompt_lookup;loopspec") == [
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
])
def test_parse_methods_rejects(text, fragment):
    with pytest.raises(suite.SuiteError, match="--methods") as e:
        suite.parse_methods(text)
    assert fragment in str(e.value)


def test_applicable():
    la = suite.MethodSpec("lookahead", LookaheadConfig())
    assert suite.applicable(la, looped_model=False) is None
    assert "Llama" in suite.applicable(la, looped_model=True)
    assert "looped" in suite.applicable(suite.MethodSpec("loopspec"), looped_model=False)
    assert suite.applicable(suite.MethodSpec("ar"), looped_model=True) is None


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
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from lookahead_jax.engine import Engine
    tk = Tokenizer(models.BPE(unk_token=None))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    corpus = ["add two numbers, the quick brown fox, hello world, def f():\n    # class A:\n",
              "<s>user: \nassistant:\nYour code should pass these tests:\nassert f() == 1",
              "return the answer and again"] * 20
    tk.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=500, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        chat_template="{% for m in messages %}<s>user: {{ m['content'] }}\n{% endfor %}"
                      "{% if add_generation_prompt %}assistant:{% endif %}")
    engine = Engine.from_preset("tiny_llama")
    engine.tokenizer = tok
    return engine


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
    assert {r["dataset"] for r in rows} == set(common.DATASETS)
    assert {r["method"] for r in rows} == {"plain", "lookahead (1,3,1)", "lookahead (2,3,2)",
                                           "lookahead (3,3,3)", "prompt_lookup"}
    for r in rows:
        assert r["exact"] == r["prompts"] == 1, r  # every output equals plain greedy
        assert r["tokens"] >= 1 and r["steps"] >= 1 and r["speedup"] > 0
    stem = str(tmp_path / "res" / "suite")
    for path in (out, stem + ".md", stem + "_sweep.png", stem + "_hist.png"):
        assert os.path.getsize(path) > 100, path
    md = open(stem + ".md").read()
    assert "| data set | method |" in md and "1/1" in md
    lengths = {len(ids) for ds in common.DATASETS
               for ids in common.encoded_prompts(tiny_engine, ds, 1, data)}
    assert 16 < min(lengths) and max(lengths) <= 32, lengths  # one bucket: few compiles
    saved = json.load(open(out))
    assert len(saved["runs"]) == 5 * 5


def test_suite_check_auto(tiny_engine, tmp_path):
    os.makedirs(tmp_path / "data")
    data = write_data(tmp_path / "data", 1)
    out = str(tmp_path / "suite.json")
    opts = suite.SuiteOptions(methods=suite.parse_methods("lookahead:1,3,1,lookahead:2,3,2"),
                              datasets=["humaneval", "gsm8k"], num_prompts=1, max_new_tokens=4,
                              data_dir=data, out=out, check_auto=True, progress=False,
                              plots=False, auto_grid=[(1, 3, 1), (3, 3, 3), (2, 4, 2)])
    report = suite.run_suite(tiny_engine, opts, log=lambda s: None)
    chk = report["auto_check"]
    assert set(chk["datasets"]) == {"humaneval", "gsm8k"}
    for v in chk["datasets"].values():
        assert v["exact"] == 1 and v["ratio"] > 0
    assert "--auto picks" in open(str(tmp_path / "suite.md")).read()


def test_suite_errors(tiny_engine, tmp_path):
    opts = suite.SuiteOptions(methods=suite.parse_methods("ar"), datasets=["nope"],
                              num_prompts=1, data_dir=str(tmp_path), out=str(tmp_path / "x.json"))
    with pytest.raises(suite.SuiteError, match="unknown data set"):
        suite.run_suite(tiny_engine, opts, log=lambda s: None)
    opts.datasets = ["gsm8k"]
    with pytest.raises(common.DataError, match="not found"):
        suite.run_suite(tiny_engine, opts, log=lambda s: None)
