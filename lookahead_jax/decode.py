"""Command-line decoding: `python -m lookahead_jax.decode --prompt "Write a haiku about JAX."`.

With no flags it loads the embedded default (SmolLM2-135M-Instruct, fetched on first use) and
decodes with lookahead decoding. Generated text streams to stdout as it is produced; each run
ends with one statistics line on stderr.

Prompts, one source at a time:
  --prompt "..."        one prompt
  --prompt_file FILE    a text file with one prompt per line (blank lines skipped), or a
                        `.jsonl` file with one JSON object per line whose prompt is its
                        "prompt" field (HumanEval), else the first of its "turns" (MT-Bench),
                        else its "question" (GSM8K); --limit takes the first few
  --prompt_ids 1,2,3    token ids, for presets without a tokenizer (tiny_llama's random weights)
  (none of these)       interactive: each line read from stdin is a fresh single-turn chat (no
                        conversation memory); an empty line or end of input stops

Devices: `--mesh=lookahead:2,model:4` shards the model over the `model` axis (tensor
parallelism) and runs lookahead parallelism over the `lookahead` axis; with
--coordinator_address / --num_processes / --process_id the same command runs on several hosts
(`jax.distributed`), and process 0 alone prints.

The flags are the fields of `Options` (each with its help text); the method is built by
`lookahead_jax.registry` from the method flags, which it checks. Bad input (unknown preset,
missing or broken checkpoint, empty prompt, a prompt too long for the cache, invalid sampling
or method settings, a bad flag) prints one `error: ...` line on stderr and exits with status 2.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import sys
from typing import Sequence, TextIO

import jax
from absl import app, flags, logging

from lookahead_jax.engine import Engine, preset_devices
from lookahead_jax.mesh import init_distributed, make_mesh, mesh_shape
from lookahead_jax.prompts import parse_prompt_ids, read_prompt_file
from lookahead_jax.registry import LOOPED_METHODS, METHODS, build_method
from lookahead_jax.sampling import Sampling
from lookahead_jax.store.checkpoint import load_model_and_tokenizer
from lookahead_jax.store.model_store import default_cache_dir
from lookahead_jax.store.presets import DTYPES, load_preset
from lookahead_jax.tuning import auto, roofline
from models.config import ConfigError, LoopedConfig
from pallas_kernels.attention import ATTENTION_NAMES
from pallas_kernels.platform import KernelUnavailable

EXIT_ERROR = 2
DEFAULT_CONFIG = "smollm2_135m"


def _flag(default, help_text: str, choices: Sequence[str] | None = None):
    return dataclasses.field(default=default, metadata={"help": help_text, "choices": choices})


@dataclasses.dataclass
class Options:
    """Everything one CLI run needs; each field is a flag of the same name."""

    config: str = _flag(DEFAULT_CONFIG, "Preset name: a file in configs/.")
    ckpt: str | None = _flag(None, "Checkpoint overriding the preset's: a .gguf file or a "
                             "Hugging Face directory (config.json + *.safetensors + tokenizer).")
    prompt: str | None = _flag(None, "One prompt.")
    prompt_file: str | None = _flag(None, "Prompts, one per line; or .jsonl with a prompt / "
                                    "turns (first) / question field.")
    prompt_ids: str | None = _flag(None, "One prompt as comma-separated token ids (presets "
                                   "without a tokenizer).")
    limit: int = _flag(0, "Use at most this many prompts of --prompt_file (0 = all).")
    max_new_tokens: int = _flag(128, "New tokens per prompt (at most).")
    temperature: float = _flag(0.0, "Sampling temperature; 0 = greedy.")
    top_k: int = _flag(0, "Keep the k most likely tokens; 0 = off.")
    top_p: float = _flag(1.0, "Nucleus sampling mass in (0, 1]; 1 = off.")
    seed: int = _flag(0, "PRNG seed (sampling and the window's first guesses).")
    dtype: str | None = _flag(None, "Parameter dtype (default: the preset's).", DTYPES)
    method: str | None = _flag(None, "Decoding method (default: lookahead when the preset "
                               "defines lookahead settings, else ar; loopspec and loopahead: "
                               "looped-model presets only).", METHODS)
    lad: str | None = _flag(None, "--method=loopahead: a drafter file or train_lad workdir "
                            "(default: native proposals only).")
    max_active: int | None = _flag(None, "--method=loopahead: the budget, tree nodes advanced "
                                   "per step (default 0: every eligible node).")
    lad_calls: int | None = _flag(None, "--method=loopahead: drafter calls per step "
                                  "(default: 1).")
    retain: str | None = _flag(None, "--method=loopahead, sampling: all (a chain keeps the "
                               "drafter's K tokens, the default) or calibrated (calls and "
                               "chain lengths from the drafter's calibration and --node_cost).",
                               ("all", "calibrated"))
    node_cost: float | None = _flag(None, "--method=loopahead --retain=calibrated: a tree "
                                    "node's execution cost in expected tokens (default 0.1).")
    suspend_below: float | None = _flag(None, "--method=loopahead, sampling: a child the "
                                        "feedback readout gives at least this chance keeps "
                                        "running (0: none pauses; 1: only the likeliest "
                                        "runs, fewer advances; default 0, or 1 with "
                                        "--max_active).")
    pl_tokens: int | None = _flag(None, "--method=prompt_lookup: draft tokens per step, at most "
                                  "(default: 10).")
    pl_ngram: int | None = _flag(None, "--method=prompt_lookup: longest suffix searched for "
                                 "earlier in the sequence, tried down to 1 (default: 3).")
    W: int | None = _flag(None, "Lookahead window width (overrides the preset).")
    N: int | None = _flag(None, "Lookahead n-gram size (overrides the preset).")
    G: int | None = _flag(None, "Lookahead verification candidates (overrides the preset).")
    prompt_seeding: bool | None = _flag(None, "Seed the n-gram pool with the prompt's n-grams "
                                        "(default: the preset's).")
    auto: bool = _flag(False, "Choose the fastest method for this device: measure its "
                       "step-cost curve, rank lookahead settings by the fitted scaling law "
                       "(--W/--N/--G fix a value), and fall back to prompt lookup or plain "
                       "decoding when no setting is predicted faster; why goes to stderr.")
    auto_device: str | None = _flag(None, "--auto: predict the step-cost curve for this "
                                    "device with the roofline model instead of measuring "
                                    "here (e.g. 'A100 80GB SXM', 'TPU v5e'; see "
                                    "python -m benchmarks.roofline).")
    auto_fit: str | None = _flag(None, "--auto: a JSON scaling-law fit (`benchmarks.suite "
                                 "--sweep` writes one; default: the fit shipped with the "
                                 "package).")
    cache_len: int | None = _flag(None, "KV cache slots (default: just enough).")
    attention: str | None = _flag(None, "Lookahead steps' attention: dense, the Pallas kernel "
                                  "(GPU/TPU), or auto (the kernel where there is one).",
                                  ATTENTION_NAMES)
    devices: int | None = _flag(None, "Lookahead parallelism over this many local devices "
                                "(default: all for presets that enable it, else 1).")
    mesh: str | None = _flag(None, "Device mesh 'lookahead:A,model:B': tensor parallelism over "
                             "B devices (parameters and KV cache sharded), lookahead "
                             "parallelism over A groups of them (default: the preset's, e.g. "
                             "llama70b model:8; else one device or --devices).")
    coordinator_address: str | None = _flag(None, "Multi-host: host:port of process 0 "
                                            "(jax.distributed; default: JAX's environment).")
    num_processes: int | None = _flag(None, "Multi-host: how many processes run this command.")
    process_id: int | None = _flag(None, "Multi-host: this process's index, 0 .. "
                                   "num_processes-1 (process 0 prints).")
    distributed_timeout: int = _flag(60, "Multi-host: seconds to wait for every process to "
                                     "join before failing.")
    chat: bool | None = _flag(None, "Wrap prompts in the chat template (default: the preset's).")
    json_out: str | None = _flag(None, "Write the prompts, outputs and stats to this JSON file.")


def define_flags() -> None:
    """Registers one absl flag per `Options` field (once). Importing this module registers
    none, so tests and other programs can call `run(Options(...))` directly."""
    if "max_new_tokens" in flags.FLAGS:
        return
    for f in dataclasses.fields(Options):
        help_text, choices = f.metadata["help"], f.metadata["choices"]
        kind = str(f.type).split(" ")[0]
        if choices:
            flags.DEFINE_enum(f.name, f.default, list(choices), help_text)
        elif kind == "bool":
            flags.DEFINE_bool(f.name, f.default, help_text)
        elif kind == "int":
            flags.DEFINE_integer(f.name, f.default, help_text)
        elif kind == "float":
            flags.DEFINE_float(f.name, f.default, help_text)
        else:
            flags.DEFINE_string(f.name, f.default, help_text)


def options_from_flags() -> Options:
    return Options(**{f.name: flags.FLAGS[f.name].value for f in dataclasses.fields(Options)})


# -- settings -> method --------------------------------------------------------------------------
def method_name(opts: Options, preset) -> str:
    lookahead_flags = any(v is not None for v in (opts.W, opts.N, opts.G, opts.prompt_seeding))
    if opts.method:
        return opts.method
    return "lookahead" if preset.lookahead is not None or lookahead_flags or opts.auto else "ar"


def build_cli_method(opts: Options, preset, sampling: Sampling, model_config=None, mesh=None):
    """The registry's method for the flags, checked against `model_config` (default: the
    preset's model shape, so bad settings fail before any weights load). mesh: the run's
    device mesh; its lookahead axis is lookahead parallelism's device count."""
    name = method_name(opts, preset)
    if name in LOOPED_METHODS and not isinstance(preset.model, LoopedConfig):
        raise ConfigError(f"--method={name} needs a looped model: preset {preset.name} is not "
                          f"one (use a looped preset, e.g. --config=tiny_ouro)")
    devices = opts.devices
    if mesh is not None:
        lookahead_axis = mesh_shape(mesh).lookahead
        if devices not in (None, lookahead_axis):
            raise ConfigError(f"--devices={devices} disagrees with the mesh's lookahead axis "
                              f"({lookahead_axis}): give --mesh alone")
        devices = lookahead_axis if name == "lookahead" else None
    elif devices is None and name == "lookahead":
        devices = preset_devices(preset)
    settings = dict(W=opts.W, N=opts.N, G=opts.G, prompt_seeding=opts.prompt_seeding,
                    pl_tokens=opts.pl_tokens, pl_ngram=opts.pl_ngram, lad=opts.lad,
                    max_active=opts.max_active, lad_calls=opts.lad_calls,
                    retain=opts.retain, node_cost=opts.node_cost,
                    suspend_below=opts.suspend_below,
                    attention=opts.attention, devices=devices)
    if name == "lookahead":
        settings["lookahead"] = preset.lookahead
        if mesh is not None and devices > 1:
            settings["mesh"] = mesh
    try:
        return build_method(name, sampling=sampling, model_config=model_config or preset.model,
                            **settings)
    except KernelUnavailable as e:
        raise ConfigError(f"--attention={opts.attention}: {e}") from None


def check_options(opts: Options) -> None:
    """The CLI's own flags (the method's are the registry's): fails before weights load."""
    if opts.max_new_tokens < 1:
        raise ConfigError(f"--max_new_tokens must be >= 1, got {opts.max_new_tokens}")
    if opts.cache_len is not None and opts.cache_len < 1:
        raise ConfigError(f"--cache_len must be >= 1, got {opts.cache_len}")
    if opts.limit < 0:
        raise ConfigError(f"--limit must be >= 0, got {opts.limit}")
    sources = [n for n, v in (("--prompt", opts.prompt), ("--prompt_file", opts.prompt_file),
                              ("--prompt_ids", opts.prompt_ids)) if v is not None]
    if len(sources) > 1:
        raise ConfigError(f"give one of --prompt, --prompt_file, --prompt_ids, not "
                          f"{' and '.join(sources)}")
    if opts.prompt is not None and not opts.prompt.strip():
        raise ConfigError("empty prompt: --prompt is blank")
    if opts.auto_fit and not opts.auto:
        raise ConfigError("--auto_fit only applies with --auto")
    if opts.auto_device is not None:
        if not opts.auto:
            raise ConfigError("--auto_device only applies with --auto")
        names = [d.name for d in roofline.DEVICES]
        if opts.auto_device not in names:
            raise ConfigError(f"--auto_device must be one of {names}, got {opts.auto_device!r}")
    if opts.dtype is not None and opts.dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {opts.dtype!r}")


def _one_line(msg) -> str:
    return " ".join(str(msg).split()) or "unknown error"


# -- running -------------------------------------------------------------------------------------
def run(opts: Options, stdin: TextIO | None = None, stdout: TextIO | None = None,
        stderr: TextIO | None = None) -> int:
    """One CLI run. Returns the exit status (0, or 2 after printing `error: ...` on stderr)."""
    stdin, stdout, stderr = stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr
    try:
        return _run(opts, stdin, stdout, stderr)
    except (ConfigError, OSError) as e:  # every loader error is a ConfigError
        stdout.flush()
        print(f"error: {_one_line(e)}", file=stderr, flush=True)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("", file=stderr)
        return 130


def _distributed(opts: Options) -> bool:
    """Multi-host: any of the flags, or JAX's own JAX_COORDINATOR_ADDRESS in the environment."""
    return any(v is not None for v in (opts.coordinator_address, opts.num_processes,
                                       opts.process_id)) or bool(
        os.environ.get("JAX_COORDINATOR_ADDRESS"))


def _run(opts: Options, stdin: TextIO, stdout: TextIO, stderr: TextIO) -> int:
    preset = load_preset(opts.config)
    check_options(opts)
    if _distributed(opts):  # before anything starts a JAX backend
        env = "from the environment"
        print(f"distributed: process {opts.process_id if opts.process_id is not None else env}"
              f" of {opts.num_processes or env}, coordinator "
              f"{opts.coordinator_address or os.environ.get('JAX_COORDINATOR_ADDRESS', env)}; "
              f"every process must join within "
              f"{opts.distributed_timeout} s (else they abort with DEADLINE_EXCEEDED)",
              file=stderr, flush=True)
        init_distributed(opts.coordinator_address, opts.num_processes, opts.process_id,
                         timeout_s=opts.distributed_timeout)
    if jax.process_index() != 0:  # every process runs the program; process 0 prints
        stdout = stderr = io.StringIO()
    mesh_text = opts.mesh or preset.mesh
    mesh = make_mesh(mesh_text) if mesh_text else None
    sampling = Sampling(temperature=opts.temperature, top_k=opts.top_k, top_p=opts.top_p)
    if opts.auto:
        if method_name(opts, preset) != "lookahead" or isinstance(preset.model, LoopedConfig):
            raise ConfigError("--auto chooses the method (lookahead, prompt lookup or plain) "
                              "for a Llama-family preset: drop --method, or drop --auto")
        auto.resolve_fit(opts.auto_fit)  # a missing or broken fit file fails before weights
    method = build_cli_method(opts, preset, sampling, mesh=mesh)  # fails before weights load
    chat = preset.chat if opts.chat is None else opts.chat
    if opts.json_out:  # fail before the (slow) generation, not after it
        _make_parent(opts.json_out)
    texts = read_prompt_file(opts.prompt_file, opts.limit) if opts.prompt_file else (
        [opts.prompt] if opts.prompt is not None else None)
    ids = parse_prompt_ids(opts.prompt_ids) if opts.prompt_ids is not None else None

    model, tokenizer, source = load_model_and_tokenizer(preset, opts.ckpt, opts.dtype, mesh=mesh)
    if tokenizer is None and ids is None:
        raise ConfigError(f"preset {preset.name} with {source} has no tokenizer: give token "
                          f"ids with --prompt_ids=1,2,3, or --ckpt with a tokenizer")
    engine = Engine(model, tokenizer, lookahead=getattr(method, "config", None), chat=chat,
                    cache_len=opts.cache_len, attention=opts.attention or "dense",
                    devices=getattr(method, "devices", 1), mesh=mesh)
    if preset.model is None:  # the method could only be checked against the loaded model
        method = build_cli_method(opts, preset, sampling, model.config, mesh=mesh)
    else:  # the loaded shape equals the preset's (checked at load); its positions may differ
        method.check(model.config)
    auto_choice = None
    if opts.auto:
        auto_choice = _auto_settings(opts, engine, texts, ids, chat, stderr)
        chosen = ({"lookahead": auto_choice.config} if auto_choice.method == "lookahead"
                  else {})
        method = engine.build_method(auto_choice.method, sampling, **chosen)
    gen_kw = dict(method=method, max_new_tokens=opts.max_new_tokens, seed=opts.seed)
    records = []

    def decode_one(prompt: str | None, prompt_ids: list[int] | None):
        result, prompt_ids, text = _stream_one(engine, prompt, prompt_ids, chat, gen_kw, stdout)
        print(result.stats.line(), file=stderr, flush=True)
        records.append({"prompt": prompt, "prompt_ids": list(prompt_ids),
                        "tokens": result.tokens[0], "text": text,
                        "stats": result.stats.to_dict()})

    status = 0
    if texts is not None:
        for t in texts:
            decode_one(t, None)
    elif ids is not None:
        decode_one(None, ids)
    else:
        status = _interactive(decode_one, preset.name, stdin, stderr)
    if opts.json_out and jax.process_index() == 0:  # one file, whatever the process count
        lookahead = getattr(method, "config", None)
        _write_json(opts.json_out, {
            "config": preset.name, "checkpoint": source, "method": method.name,
            "dtype": opts.dtype or preset.dtype, "chat": chat, "seed": opts.seed,
            "max_new_tokens": opts.max_new_tokens, "sampling": dataclasses.asdict(sampling),
            "lookahead": dataclasses.asdict(lookahead) if lookahead else None,
            "attention": opts.attention or "dense", "results": records,
            **({"auto": auto_choice.to_dict()} if auto_choice else {})})
    return status


def _stream_one(engine: Engine, prompt: str | None, prompt_ids: list[int] | None, chat: bool,
                gen_kw: dict, stdout: TextIO):
    """Generates for one prompt, streaming text (or token ids) to stdout as it comes.
    Returns (result, the prompt's ids, the output text or None)."""
    if prompt is not None:  # text in, text streamed out
        prompt_ids = engine.encode(prompt, chat)
        shown = [""]

        def on_text(_, piece):
            stdout.write(piece)
            stdout.flush()
            shown[0] += piece

        result = engine.generate([prompt], chat=chat, on_text=on_text, **gen_kw)
        text = result.texts[0]
        if text.startswith(shown[0]):  # a trailing piece held back mid-character
            stdout.write(text[len(shown[0]):])
    else:  # token ids in, token ids streamed out

        def on_tokens(_, new):
            stdout.write(" ".join(str(t) for t in new) + " ")
            stdout.flush()

        result = engine.generate_ids([prompt_ids], on_tokens=on_tokens, **gen_kw)
        text = engine.decode(result.tokens[0]) if engine.tokenizer is not None else None
    stdout.write("\n")
    stdout.flush()
    return result, prompt_ids, text


def _auto_settings(opts: Options, engine: Engine, texts, ids, chat: bool, stderr: TextIO):
    """--auto: ranks (W, N, G) candidates by predicted speed-up on this device (fixing the
    --W/--N/--G given), prints why on stderr, returns the `auto.AutoChoice`."""
    if ids is not None:
        prompt_len = len(ids)
    elif texts:
        prompt_len = max(len(engine.encode(t, chat)) for t in texts)
    else:  # interactive: prompts not known yet
        prompt_len = 64
    grid = auto.candidate_grid((opts.W,) if opts.W is not None else auto.GRID_W,
                               (opts.N,) if opts.N is not None else auto.GRID_N,
                               (opts.G,) if opts.G is not None else None)
    how = (f"predicting for {opts.auto_device}" if opts.auto_device
           else "measuring")
    print(f"auto: {how} the step-cost curve at cache length "
          f"{prompt_len + opts.max_new_tokens // 2} ...", file=stderr, flush=True)
    choice = auto.choose_settings(engine, prompt_len=prompt_len,
                                  max_new_tokens=opts.max_new_tokens, fit=opts.auto_fit,
                                  grid=grid, base=engine.lookahead, device=opts.auto_device)
    print(choice.report(), file=stderr, flush=True)
    return choice


def _interactive(decode_one, name: str, stdin: TextIO, stderr: TextIO) -> int:
    """Reads prompts from stdin until an empty line or end of input; each is a fresh single-turn
    chat. A prompt that fails (e.g. too long for the cache) is reported and the loop goes on."""
    tty = stdin.isatty()
    if tty:
        print(f"{name}: type a prompt (each line is a new single-turn chat; an empty line or "
              f"Ctrl-D quits)", file=stderr)
    status = 0
    while True:
        if tty:
            print("> ", end="", file=stderr, flush=True)
        line = stdin.readline()
        if not line or not line.strip():
            return status
        try:
            decode_one(line.rstrip("\n"), None)
        except ConfigError as e:
            print(f"error: {_one_line(e)}", file=stderr, flush=True)
            status = EXIT_ERROR


def _make_parent(path: str) -> None:
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--json_out {path}: cannot create its directory: {e.strerror or e}"
                          ) from None


def _write_json(path: str, obj) -> None:
    _make_parent(path)
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=1)
            f.write("\n")
    except OSError as e:
        raise ConfigError(f"--json_out {path}: cannot write: {e.strerror or e}") from None


# -- entry point ---------------------------------------------------------------------------------
def parse_flags(argv: Sequence[str]) -> list[str]:
    """absl flag parsing that reports a bad flag as one `error:` line and exits with status 2."""
    try:
        rest = flags.FLAGS(list(argv))
    except flags.Error as e:
        print(f"error: {_one_line(e)} (see --helpshort)", file=sys.stderr)
        sys.exit(EXIT_ERROR)
    if flags.FLAGS["verbosity"].using_default_value:  # absl's INFO default is noisy (TPU probe)
        flags.FLAGS.verbosity = logging.WARNING
    return rest


def enable_compile_cache() -> None:
    """Keeps compiled programs on disk (`<model cache>/xla`), so a second run of the same
    preset and settings skips XLA compilation. A cache directory already configured
    (JAX_COMPILATION_CACHE_DIR) is kept as it is; LOOKAHEAD_JAX_NO_COMPILE_CACHE=1 turns the
    default one off."""
    if os.environ.get("LOOKAHEAD_JAX_NO_COMPILE_CACHE") or jax.config.jax_compilation_cache_dir:
        return
    jax.config.update("jax_compilation_cache_dir", os.path.join(default_cache_dir(), "xla"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


def main(argv: Sequence[str]) -> int:
    if len(argv) > 1:
        print(f"error: unexpected arguments {' '.join(argv[1:])!r} (flags take --name=value)",
              file=sys.stderr)
        return EXIT_ERROR
    enable_compile_cache()
    return run(options_from_flags())


def cli() -> None:
    """The console entry point: flags, then `main`."""
    define_flags()
    app.run(main, flags_parser=parse_flags)


if __name__ == "__main__":
    cli()
