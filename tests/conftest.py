"""Shared test setup: GPU memory taken as needed; full float32 matmuls on accelerators; free
each test module's compiled programs when it ends.

GPU memory: by default the first JAX process on a GPU takes 75% of its memory at start, and a
child process that uses the GPU too (test_notebooks.py's notebook kernels inherit this
environment) then runs out of it. So the tests allocate GPU memory as they need it
(XLA_PYTHON_CLIENT_PREALLOCATE=false, set here before any backend starts; a value given in the
environment is kept).

Full float32 matmuls: many tests compare two decoding paths token for token (lookahead against
plain greedy, the kernel against the dense attention) or against float32 references. On CPU a
float32 matmul is full float32; jax's default precision is TF32 on a GPU and one bfloat16 pass
on a TPU, which perturb logits enough to flip near-tied greedy choices and exceed float32
tolerances. So on any backend but CPU every test runs with "highest" matmul precision (an
explicit precision, e.g. the kernel's bfloat16 dots, is unaffected).

One compilation cache for the whole run: much of the suite's time is XLA compiling programs,
and tests in different files (on pytest-xdist's two processes, and in the child processes that
rerun a file on 8 CPU devices) compile many of the same programs again. The run keeps all its
compiled programs, the small ones too (model initialisation's eager ops), in a temporary
directory (JAX_COMPILATION_CACHE_DIR, set here before jax is imported so the worker and child
processes inherit it; removed when the run ends; a directory given in the environment is used
instead and kept). The CLI's own cache in the model cache directory
(`lookahead_jax.decode.enable_compile_cache`) then stays out of the tests, so no run reuses
programs compiled by an earlier one.

Quick XLA compilation on CPU: for most tests' small programs compiling takes far longer than
running, so the run asks XLA's CPU backend for quick code generation (`quick_compile.py`: LLVM
without optimisation, the older fusion emitters, one codegen split). In CI's full run here the
suite took 29.5 min instead of 35.3 (30.4 in the file order before HEAVY_FIRST's below):
compile-bound files halve (test_loopahead.py 348 -> 164 s of test time, test_train_lad.py 205 ->
77 s), while the files that run thousands of sampled generations slowed down
(test_loopahead_sampling.py 347 -> 742 s), unoptimised code running slower: so their
long-running programs are compiled with LLVM's optimisation back
(`quick_compile.long_run_options`, an engine's `compiler_options`; its budget test alone: from
125 to 42 s; the suite in CI then took 21.1 min, test_loopahead_sampling.py 281 s of test time).
The flags change how a program is compiled, not what it computes (no fast math either way); at
most a result rounds differently in its last bit (where LLVM would fuse a multiply and an add),
which the lossless tests, comparing two decoding paths compiled the same way, do not depend on;
and the golden ids, recorded with XLA's defaults, reproduce under them (test_golden_ids.py).
They go before any XLA_FLAGS given in the environment, which thus win; child processes inherit
them; a flag the installed XLA does not know is left out (the fusion emitters' switch is gone in
JAX 0.12); LOOKAHEAD_JAX_TESTS_XLA_DEFAULTS=1 leaves XLA's defaults; on a machine with a GPU or
TPU plugin installed they are left out (LLVM's optimisation level applies to GPU code too).

Heaviest files first: with `-n 2 --dist loadfile` each process takes the next whole file when it
nears the end of its current one, so a long file taken last leaves the other process idle for
most of its run. `HEAVY_FIRST` (the files that take longest in CI, longest first) are collected
first and handed out in that order (pytest-xdist's own reordering, by test count, is switched
off); the rest follow in their usual order.

Freeing compiled programs: one pytest process compiles several hundred XLA programs; each
keeps its machine code mapped in memory for as long as something references it. Clearing JAX's
caches and collecting the module's engines after every module keeps the process far below the
kernel's limit on memory mappings (vm.max_map_count, 65530 by default), which a full run
otherwise reaches, and the next XLA compile then crashes."""

from __future__ import annotations

import gc
import os
import re
import shutil
import tempfile

from quick_compile import APPLIED_ENV, FAST_CPU_COMPILE

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def _accelerator_plugin_installed() -> bool:
    from importlib import metadata  # noqa: PLC0415
    names = {(d.metadata["Name"] or "").lower().replace("_", "-") for d in metadata.distributions()}
    return any(n.startswith(("jax-cuda", "jax-rocm", "libtpu")) for n in names)


def _known_to_xla(flags: tuple[str, ...]) -> list[str]:
    """`flags` less those this jaxlib's XLA does not know (flags come and go between versions,
    and XLA aborts on an unknown one); asked once, of a child process starting a CPU backend,
    whose abort names them. Any other failure: none."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415
    env = dict(os.environ, XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu")
    try:
        r = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                           capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if r.returncode == 0:
        return list(flags)
    unknown = re.search(r"Unknown flags? in XLA_FLAGS: (.*)", r.stderr)
    if not unknown:
        return []
    known = [f for f in flags if f not in unknown.group(1).split()]
    return known if len(known) < len(flags) else []


# set by the first pytest process; xdist's workers and the child processes inherit the result
if (not os.environ.get("LOOKAHEAD_JAX_TESTS_XLA_DEFAULTS")
        and APPLIED_ENV not in os.environ
        and not _accelerator_plugin_installed()):
    _fast = " ".join(_known_to_xla(FAST_CPU_COMPILE))
    os.environ[APPLIED_ENV] = _fast
    os.environ["XLA_FLAGS"] = f"{_fast} {os.environ.get('XLA_FLAGS', '')}".strip()
# the run's compilation cache: created by the first pytest process, inherited by the others
_RUN_CACHE = None
if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    _RUN_CACHE = tempfile.mkdtemp(prefix="lookahead_jax_tests_xla_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _RUN_CACHE
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import jax  # noqa: E402
import pytest  # noqa: E402


# the files that take longest in CI, longest first (the 8-device reruns use both cores)
HEAVY_FIRST = ("test_loopahead_sampling.py", "test_sampling_generations.py", "test_mesh.py",
               "test_recursive.py", "test_loopahead.py", "test_parallel.py", "test_multihost.py",
               "test_mesh_memory.py", "test_golden_ids.py", "test_loopspec.py", "test_cli.py",
               "test_prompt_lookup.py", "test_notebooks.py", "test_registry.py",
               "test_loopahead_ablation.py", "test_train_lad.py", "test_serve.py",
               "test_roofline.py")


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: keep the collection's order
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files stay whole


def pytest_unconfigure(config):
    if _RUN_CACHE:  # only the process that created it (xdist's controller, or a plain run)
        shutil.rmtree(_RUN_CACHE, ignore_errors=True)


@pytest.fixture(autouse=True, scope="session")
def _full_float32_matmuls():
    if jax.default_backend() == "cpu":
        yield
        return
    before = jax.config.jax_default_matmul_precision
    jax.config.update("jax_default_matmul_precision", "highest")
    yield
    jax.config.update("jax_default_matmul_precision", before)


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    yield
    gc.collect()
    jax.clear_caches()
    gc.collect()


# The tiny_llama preset's shape (configs/tiny_llama.py).
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)


@pytest.fixture(scope="session")
def hf_ckpt(tmp_path_factory):
    """A tiny random Llama in Hugging Face format (tiny_llama's shape) with a BPE tokenizer
    and a minimal chat template."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

    path = tmp_path_factory.mktemp("tiny_hf")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **TINY, bos_token_id=1, eos_token_id=2, initializer_range=0.1))
    model.save_pretrained(path)

    corpus = ["hello world, this is a tiny tokenizer for the lookahead tests.",
              "the quick brown fox jumps over the lazy dog; JAX and Flax decode text."]
    tok = tiny_bpe_tokenizer(corpus, 300)
    assert len(tok) <= TINY["vocab_size"]
    tok.save_pretrained(path)
    return str(path)


def tiny_bpe_tokenizer(corpus: list[str], vocab_size: int):
    """A byte-level BPE tokenizer trained on `corpus` (repeated), with <unk>, <s>, </s> and a
    minimal chat template, as a transformers tokenizer."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: PLC0415

    tk = Tokenizer(models.BPE(unk_token=None))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(corpus * 20, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        chat_template="{% for m in messages %}<s>user: {{ m['content'] }}\n{% endfor %}"
                      "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="session")
def served_engine(hf_ckpt):
    """The tiny Llama with its tokenizer as one Engine for the serving tests (test_slots,
    test_serve): its compiled programs (the slots' lanes, the offline references) are shared."""
    from lookahead_jax import Engine  # noqa: PLC0415
    return Engine.from_preset("tiny_llama", ckpt=hf_ckpt)
