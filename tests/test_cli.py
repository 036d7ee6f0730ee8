"""The decode CLI end to end: bad input gives one `error:` line on stderr, exit status 2 and no
traceback; good input streams output and ends each prompt with a statistics line.

Each kind of bad input named in the CLI's contract runs as a real subprocess
(`python -m lookahead_jax.decode ...`); the finer cases and the happy paths call
`decode.run(Options(...))` in-process, which is the same code minus flag parsing (and much
faster: no interpreter and JAX start-up per case).

Nothing here needs SmolLM2: the checkpoints are tiny ones written by the tests (a Hugging Face
directory with a BPE tokenizer, GGUF files) or the `tiny_llama` preset's random weights."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from conftest import TINY  # the tiny_llama preset's shape, in Hugging Face names

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

STATS_PREFIX = "["  # Stats.line(): "[N tokens, ... tokens/s, ...]"


def run_cli(*args: str, stdin: str | None = None, timeout: float = 120):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}
    return subprocess.run([sys.executable, "-m", "lookahead_jax.decode", *args], cwd=REPO,
                          env=env, input=stdin if stdin is not None else "", text=True,
                          capture_output=True, timeout=timeout)


class InProcess:
    def __init__(self, returncode: int, stdout: str, stderr: str):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def run_inproc(stdin: str = "", **options) -> InProcess:
    from lookahead_jax import decode
    out, err = io.StringIO(), io.StringIO()
    code = decode.run(decode.Options(**options), stdin=io.StringIO(stdin), stdout=out, stderr=err)
    return InProcess(code, out.getvalue(), err.getvalue())


def assert_error(res, *fragments: str) -> str:
    """Non-zero exit, exactly one `error:` line naming every fragment, no traceback."""
    assert "Traceback" not in res.stderr, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, res.stderr
    assert res.returncode == 2, (res.returncode, res.stderr)
    for f in fragments:
        assert f in lines[0], lines[0]
    return lines[0]


def stats_lines(res) -> list[str]:
    return [ln for ln in res.stderr.splitlines()
            if ln.startswith(STATS_PREFIX) and "tokens/s" in ln]


# -- fixtures: tiny checkpoints ----------------------------------------------------------------
def _copy(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def _gguf(path, arch: str = "llama", quant_tensor: str | None = None) -> str:
    """A GGUF file of tiny_llama's shape (no tokenizer metadata). quant_tensor: store that
    tensor as Q8_1, a type the gguf package cannot dequantize."""
    gguf = pytest.importorskip("gguf")
    rng = np.random.default_rng(0)
    e, f, v = TINY["hidden_size"], TINY["intermediate_size"], TINY["vocab_size"]
    d = e // TINY["num_attention_heads"]
    kv = TINY["num_key_value_heads"] * d
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(TINY["num_hidden_layers"])
    w.add_context_length(TINY["max_position_embeddings"])
    w.add_embedding_length(e)
    w.add_feed_forward_length(f)
    w.add_head_count(TINY["num_attention_heads"])
    w.add_head_count_kv(TINY["num_key_value_heads"])
    w.add_rope_freq_base(TINY["rope_theta"])
    w.add_layer_norm_rms_eps(TINY["rms_norm_eps"])
    w.add_vocab_size(v)
    shapes = {"token_embd.weight": (v, e), "output_norm.weight": (e,), "output.weight": (v, e)}
    for i in range(TINY["num_hidden_layers"]):
        shapes.update({f"blk.{i}.attn_norm.weight": (e,), f"blk.{i}.attn_q.weight": (e, e),
                       f"blk.{i}.attn_k.weight": (kv, e), f"blk.{i}.attn_v.weight": (kv, e),
                       f"blk.{i}.attn_output.weight": (e, e), f"blk.{i}.ffn_norm.weight": (e,),
                       f"blk.{i}.ffn_gate.weight": (f, e), f"blk.{i}.ffn_up.weight": (f, e),
                       f"blk.{i}.ffn_down.weight": (e, f)})
    for name, shape in shapes.items():
        if name == quant_tensor:
            block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1]
            raw = np.zeros((shape[0], shape[1] // block * size), np.uint8)
            w.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType.Q8_1)
        else:
            w.add_tensor(name, (0.05 * rng.standard_normal(shape)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


# -- bad input: subprocesses ---------------------------------------------------------------------
@pytest.mark.parametrize("args, fragments", [
    (["--config=no_such_preset", "--prompt=hi"], ["unknown preset 'no_such_preset'", "tiny_llama"]),
    (["--prompt=   "], ["empty prompt"]),
    (["--prompt=hi", "--temperature=-1"], ["temperature"]),
    (["--max_new_tokens=many"], ["max_new_tokens"]),  # absl flag errors
    (["--no_such_flag=1"], ["no_such_flag"]),
    (["--config=llama7b", "--prompt=hi"],
     ["preset llama7b needs weights: pass --ckpt=/path/to/Llama-2-7b-chat-hf", "config.json"]),
    (["--config=tiny_llama", "--ckpt=/no/such/checkpoint", "--prompt=hi"],
     ["/no/such/checkpoint", "does not exist"]),
    (["--config=tiny_llama", "--prompt_ids=1,2,3", "--cache_len=16", "--method=ar"],
     ["exceeds the cache length 16"]),
    (["--prompt_file=/no/such/prompts.txt"], ["/no/such/prompts.txt", "no such file"]),
])
def test_bad_input(args, fragments):
    assert_error(run_cli(*args), *fragments)


# -- bad input: in-process -------------------------------------------------------------------------
@pytest.mark.parametrize("options, fragments", [
    (dict(prompt=""), ["empty prompt"]),
    (dict(prompt="hi", top_p=0.0), ["top_p"]),
    (dict(prompt="hi", top_k=-3), ["top_k"]),
    (dict(prompt="hi", N=1), ["N (n-gram size)"]),
    (dict(prompt="hi", method="ar", W=5), ["--W", "lookahead"]),
    (dict(prompt="hi", max_new_tokens=0), ["max_new_tokens"]),
    (dict(prompt="hi", dtype="float16"), ["dtype", "bfloat16"]),
    (dict(prompt="hi", prompt_ids="1,2"), ["one of"]),
    (dict(config="tiny_llama", prompt_ids="1,x"), ["--prompt_ids"]),
    (dict(config="tiny_llama", prompt_ids="1,999", method="ar"), ["999", "vocabulary"]),
    (dict(config="tiny_llama", prompt="hello"), ["no tokenizer", "--prompt_ids"]),
    (dict(config="tiny_llama", prompt_ids="1,2", G=2, method="lookahead", W=2, N=3,
          cache_len=20), ["exceeds the cache length 20"]),
])
def test_bad_options(options, fragments):
    assert_error(run_inproc(**options), *fragments)


def test_bad_prompt_files(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    assert_error(run_inproc(prompt_file=str(empty)), "no prompts")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"answer": 1}\n')
    assert_error(run_inproc(prompt_file=str(bad)), f"{bad}:2", "prompt / turns / question")
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00bad")
    assert_error(run_inproc(prompt_file=str(binary)), "UTF-8")


def test_unreadable_checkpoints(tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    assert_error(run_cli("--config=tiny_llama", f"--ckpt={broken}", "--prompt=hi"),
                 "config.json", "invalid JSON")
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"PK\x03\x04 definitely not a gguf file")
    assert_error(run_inproc(ckpt=str(fake), prompt="hi"), "not a GGUF file")
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\x00" * 16)
    assert_error(run_inproc(ckpt=str(other), prompt="hi"), "not a .gguf")


def test_gguf_unsupported(tmp_path):
    arch = _gguf(tmp_path / "gpt2.gguf", arch="gpt2")
    assert_error(run_cli(f"--ckpt={arch}", "--prompt=hi"), "architecture 'gpt2'")
    quant = _gguf(tmp_path / "q81.gguf", quant_tensor="blk.1.ffn_up.weight")
    assert_error(run_cli("--config=tiny_llama", f"--ckpt={quant}", "--prompt=hi"),
                 "blk.1.ffn_up.weight", "Q8_1")


def test_checkpoint_does_not_match_preset(hf_ckpt, tmp_path):
    ckpt = _copy(hf_ckpt, tmp_path / "deeper")
    cfg_file = os.path.join(ckpt, "config.json")
    with open(cfg_file) as f:
        cfg = json.load(f)
    cfg["num_hidden_layers"] = 3
    with open(cfg_file, "w") as f:
        json.dump(cfg, f)
    assert_error(run_inproc(config="tiny_llama", ckpt=ckpt, prompt="hi"),
                 "does not match preset tiny_llama", "num_layers is 3")


def test_tensor_shape_mismatch(hf_ckpt, tmp_path):
    from safetensors.numpy import load_file, save_file
    ckpt = _copy(hf_ckpt, tmp_path / "bad_tensor")
    file = os.path.join(ckpt, "model.safetensors")
    tensors = load_file(file)
    tensors["model.layers.1.mlp.up_proj.weight"] = np.zeros((100, 64), np.float32)
    save_file(tensors, file, metadata={"format": "pt"})
    assert_error(run_cli("--config=tiny_llama", f"--ckpt={ckpt}", "--prompt=hi"),
                 "model.layers.1.mlp.up_proj.weight", "(100, 64)")


# -- good input ------------------------------------------------------------------------------
def test_random_preset_token_ids():
    res = run_inproc(config="tiny_llama", prompt_ids="5,6,7,8", method="ar", max_new_tokens=6)
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr and "error:" not in res.stderr
    ids = [int(t) for t in res.stdout.split()]
    assert 1 <= len(ids) <= 6 and all(0 <= t < TINY["vocab_size"] for t in ids)
    assert len(stats_lines(res)) == 1


def test_text_prompts_lookahead_matches_ar(hf_ckpt, tmp_path):
    """A real tokenizer end to end: chat template, streaming, JSON output; greedy lookahead
    decoding (the preset's default method, in a subprocess) emits exactly plain decoding's
    tokens (in-process)."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"turns": ["hello world", "second turn"]}) + "\n"
                       + json.dumps({"question": "the quick brown fox"}) + "\n")
    common = dict(config="tiny_llama", ckpt=hf_ckpt, prompt_file=str(prompts), max_new_tokens=12,
                  chat=True)
    outs = {}
    for method in ("lookahead", "ar"):
        out = tmp_path / f"{method}.json"
        if method == "lookahead":
            res = run_cli("--config=tiny_llama", f"--ckpt={hf_ckpt}", f"--prompt_file={prompts}",
                          "--max_new_tokens=12", "--chat", f"--json_out={out}")
        else:
            res = run_inproc(**common, method="ar", json_out=str(out))
        assert res.returncode == 0, res.stderr
        assert "Traceback" not in res.stderr and "error:" not in res.stderr
        assert len(stats_lines(res)) == 2
        with open(out) as f:
            outs[method] = json.load(f)
        results = outs[method]["results"]
        assert outs[method]["method"] == method
        assert [r["prompt"] for r in results] == ["hello world", "the quick brown fox"]
        assert res.stdout == "".join(r["text"] + "\n" for r in results)
    assert outs["lookahead"]["lookahead"]["W"] == 4  # the preset's settings
    assert ([r["tokens"] for r in outs["lookahead"]["results"]]
            == [r["tokens"] for r in outs["ar"]["results"]])
    assert outs["ar"]["results"][0]["prompt_ids"][0] == 1  # "<s>" from the chat template


def test_interactive_reads_lines_until_empty(hf_ckpt):
    res = run_inproc(config="tiny_llama", ckpt=hf_ckpt, method="ar", max_new_tokens=4,
                     stdin="hello world\nthe lazy dog\n\nnot read\n")
    assert res.returncode == 0, res.stderr
    assert len(stats_lines(res)) == 2
    assert len(res.stdout.splitlines()) == 2


# -- presets -------------------------------------------------------------------------------------
def test_every_preset_loads():
    from lookahead_jax.store.presets import EMBEDDED, RANDOM, available_presets, load_preset
    names = available_presets()
    assert {"smollm2_135m", "tiny_llama", "llama7b", "llama13b", "llama70b", "codellama7b",
            "codellama13b", "codellama34b"} <= set(names)
    for name in names:
        preset = load_preset(name)
        assert preset.name == name
        assert preset.checkpoint is not None or preset.weights_hint  # a way to get weights
        # a shipped checkpoint is package data that exists wherever the package is installed
        assert preset.checkpoint in (EMBEDDED, RANDOM, None) or os.path.isfile(
            os.path.join(preset.checkpoint, "config.json")), preset.checkpoint
    la = {n: (p.lookahead.W, p.lookahead.N, p.lookahead.G)
          for n in ("llama7b", "llama13b", "codellama34b") for p in [load_preset(n)]}
    assert la == {"llama7b": (15, 5, 15), "llama13b": (10, 5, 10), "codellama34b": (7, 5, 7)}
    assert load_preset("codellama34b").model.num_kv_heads == 8
    assert load_preset("codellama7b").model.vocab_size == 32016


def test_smollm2_preset_matches_the_embedded_file():
    from lookahead_jax.store.model_store import smollm2_gguf
    from lookahead_jax.store.checkpoint import check_model_matches
    from lookahead_jax.store.presets import load_preset
    from models.config import ConfigError
    from models.gguf_loader import load_gguf_config
    try:
        path = smollm2_gguf(download=False)
    except ConfigError as e:
        pytest.skip(f"SmolLM2 not available ({e})")
    check_model_matches(load_preset("smollm2_135m"), load_gguf_config(path), str(path))


def test_compile_cache_directory(monkeypatch, tmp_path):
    """The CLI keeps compiled programs in `<model cache>/xla` unless JAX already has a cache
    directory (JAX_COMPILATION_CACHE_DIR: kept, as the test run's own is) or
    LOOKAHEAD_JAX_NO_COMPILE_CACHE is set."""
    import jax  # noqa: PLC0415

    from lookahead_jax.decode import enable_compile_cache  # noqa: PLC0415
    from lookahead_jax.store.model_store import CACHE_ENV  # noqa: PLC0415
    keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    before = {k: getattr(jax.config, k) for k in keys}
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "store"))
    try:
        jax.config.update(keys[0], str(tmp_path / "mine"))
        enable_compile_cache()
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "mine")
        jax.config.update(keys[0], None)
        monkeypatch.setenv("LOOKAHEAD_JAX_NO_COMPILE_CACHE", "1")
        enable_compile_cache()
        assert jax.config.jax_compilation_cache_dir is None
        monkeypatch.delenv("LOOKAHEAD_JAX_NO_COMPILE_CACHE")
        enable_compile_cache()
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "store" / "xla")
    finally:
        for k, v in before.items():
            jax.config.update(k, v)
