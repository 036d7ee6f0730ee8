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

Bad input (unknown preset, missing or broken checkpoint, empty prompt, a prompt too long for the
cache, invalid sampling or lookahead settings, a bad flag) prints one `error: ...` line on stderr
and exits with status 2.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Sequence, TextIO

from absl import app, flags, logging

from models.config import ConfigError

EXIT_ERROR = 2
DEFAULT_CONFIG = "smollm2_135m"
JSONL_FIELDS = ("prompt", "turns", "question")
LOOPED_METHODS = ("loopspec", "loopahead")  # decoding methods for looped models only

def define_flags() -> None:
    """Registers the CLI's absl flags (once). Importing this module registers none, so tests
    and other programs can call `run(Options(...))` without touching absl's global flags."""
    if "max_new_tokens" in flags.FLAGS:
        return
    f = flags
    f.DEFINE_string("config", DEFAULT_CONFIG, "Preset name: a file in configs/.")
    f.DEFINE_string("ckpt", None, "Checkpoint overriding the preset's: a .gguf file or a Hugging "
                    "Face directory (config.json + *.safetensors + tokenizer files).")
    f.DEFINE_string("prompt", None, "One prompt.")
    f.DEFINE_string("prompt_file", None, "Prompts, one per line; or .jsonl with a "
                    "prompt / turns (first) / question field.")
    f.DEFINE_string("prompt_ids", None, "One prompt as comma-separated token ids (for presets "
                    "without a tokenizer).")
    f.DEFINE_integer("limit", 0, "Use at most this many prompts of --prompt_file (0 = all).")
    f.DEFINE_integer("max_new_tokens", 128, "New tokens per prompt (at most).")
    f.DEFINE_float("temperature", 0.0, "Sampling temperature; 0 = greedy.")
    f.DEFINE_integer("top_k", 0, "Keep the k most likely tokens; 0 = off.")
    f.DEFINE_float("top_p", 1.0, "Nucleus sampling mass in (0, 1]; 1 = off.")
    f.DEFINE_integer("seed", 0, "PRNG seed (sampling and the window's first guesses).")
    f.DEFINE_enum("dtype", None, ["float32", "bfloat16"], "Parameter dtype (default: the "
                  "preset's).")
    f.DEFINE_enum("method", None, ["lookahead", "ar", "prompt_lookup", "loopspec", "loopahead"],
                  "Decoding method (default: lookahead when the preset defines lookahead "
                  "settings, else ar; prompt_lookup: drafts copied from earlier in the prompt "
                  "and output; loopspec and loopahead: looped-model presets only).")
    f.DEFINE_string("lad", None, "--method=loopahead: a train_lad workdir with the lookahead "
                    "drafter (default: native proposals only).")
    f.DEFINE_integer("pl_tokens", None, "--method=prompt_lookup: draft tokens per step, at most "
                     "(default: 10).")
    f.DEFINE_integer("pl_ngram", None, "--method=prompt_lookup: longest suffix of the sequence "
                     "searched for earlier in it, tried down to 1 (default: 3).")
    f.DEFINE_integer("W", None, "Lookahead window width (overrides the preset).")
    f.DEFINE_integer("N", None, "Lookahead n-gram size (overrides the preset).")
    f.DEFINE_integer("G", None, "Lookahead verification candidates (overrides the preset).")
    f.DEFINE_bool("auto", False, "Choose W, N, G automatically: measure this device's step-cost "
                  "curve and pick the settings the fitted scaling law predicts fastest (G = W; "
                  "--W/--N/--G, when given, fix that value); the choice and why go to stderr.")
    f.DEFINE_string("auto_fit", None, "--auto: a JSON scaling-law fit written by `python -m "
                    "benchmarks.suite --sweep` (default: benchmarks/results/scaling_fit.json when present, "
                    "else the fit of our stored SmolLM2 runs).")
    f.DEFINE_bool("prompt_seeding", None, "Seed the n-gram pool with the prompt's n-grams "
                  "(default: the preset's).")
    f.DEFINE_integer("cache_len", None, "KV cache slots (default: just enough).")
    f.DEFINE_enum("attention", None, ["dense", "pallas", "auto"], "Attention of the lookahead "
                  "steps: dense, the block-sparse Pallas kernel (GPU/TPU only), or auto (the "
                  "kernel where the platform has one, else dense). Default: dense.")
    f.DEFINE_integer("devices", None, "Lookahead parallelism: split each lookahead step's "
                     "window columns and candidates across this many local devices (default: "
                     "all local devices for presets that enable it, else 1).")
    f.DEFINE_bool("chat", None, "Wrap prompts in the chat template (default: the preset's); "
                  "raw text when false.")
    f.DEFINE_string("json_out", None, "Write the prompts, outputs and stats to this JSON file.")


@dataclasses.dataclass
class Options:
    """Everything one CLI run needs; `options_from_flags` fills it from the parsed flags."""

    config: str = DEFAULT_CONFIG
    ckpt: str | None = None
    prompt: str | None = None
    prompt_file: str | None = None
    prompt_ids: str | None = None
    limit: int = 0
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    dtype: str | None = None
    method: str | None = None
    W: int | None = None
    N: int | None = None
    G: int | None = None
    prompt_seeding: bool | None = None
    cache_len: int | None = None
    attention: str | None = None
    devices: int | None = None
    chat: bool | None = None
    json_out: str | None = None
    lad: str | None = None
    pl_tokens: int | None = None
    pl_ngram: int | None = None
    auto: bool = False
    auto_fit: str | None = None


def options_from_flags() -> Options:
    return Options(**{f.name: flags.FLAGS[f.name].value for f in dataclasses.fields(Options)})


# -- prompts -------------------------------------------------------------------------------------
def parse_prompt_ids(text: str) -> list[int]:
    """"1, 2,3" -> [1, 2, 3]; raises ConfigError on anything else."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise ConfigError("empty prompt: --prompt_ids has no token ids")
    try:
        return [int(p) for p in parts]
    except ValueError:
        raise ConfigError(f"--prompt_ids must be comma-separated integers, got {text!r}") from None


def _jsonl_prompt(obj, where: str) -> str:
    if not isinstance(obj, dict):
        raise ConfigError(f"{where}: expected a JSON object")
    for field in JSONL_FIELDS:
        value = obj.get(field)
        if field == "turns" and isinstance(value, list) and value:
            value = value[0]
        if isinstance(value, str):
            return value
    raise ConfigError(f"{where}: no string field {' / '.join(JSONL_FIELDS)}")


def read_prompt_file(path: str, limit: int = 0) -> list[str]:
    """Prompts from a text file (one per line) or a .jsonl file (see the module docstring)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        raise ConfigError(f"--prompt_file {path}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"--prompt_file {path}: is a directory") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"--prompt_file {path}: not UTF-8 text ({e.reason})") from None
    except OSError as e:
        raise ConfigError(f"--prompt_file {path}: cannot read: {e.strerror or e}") from None
    prompts = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if path.endswith(".jsonl"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{i}: invalid JSON ({e.msg})") from None
            prompts.append(_jsonl_prompt(obj, f"{path}:{i}"))
        else:
            prompts.append(line)
        if limit and len(prompts) >= limit:
            break
    if not prompts:
        raise ConfigError(f"--prompt_file {path}: no prompts in it")
    return prompts


# -- settings ------------------------------------------------------------------------------------
def resolve_settings(opts: Options, preset):
    """Checks the decoding flags against the preset -> (method, Sampling, LookaheadConfig|None,
    devices).

    Everything here fails before any weights are loaded."""
    from lookahead_jax.config import LookaheadConfig  # noqa: PLC0415
    from lookahead_jax.engine import resolve_method  # noqa: PLC0415
    from lookahead_jax.sampling import Sampling  # noqa: PLC0415

    sampling = Sampling(temperature=opts.temperature, top_k=opts.top_k, top_p=opts.top_p)
    if opts.max_new_tokens < 1:
        raise ConfigError(f"--max_new_tokens must be >= 1, got {opts.max_new_tokens}")
    if opts.cache_len is not None and opts.cache_len < 1:
        raise ConfigError(f"--cache_len must be >= 1, got {opts.cache_len}")
    if opts.limit < 0:
        raise ConfigError(f"--limit must be >= 0, got {opts.limit}")
    overrides = {k: v for k, v in (("W", opts.W), ("N", opts.N), ("G", opts.G),
                                    ("prompt_seeding", opts.prompt_seeding)) if v is not None}
    method = opts.method or ("lookahead" if preset.lookahead is not None or overrides
                             or opts.auto else "ar")
    if opts.auto_fit and not opts.auto:
        raise ConfigError("--auto_fit only applies with --auto")
    if opts.auto:
        from models.looped import LoopedConfig  # noqa: PLC0415
        if method != "lookahead" or isinstance(preset.model, LoopedConfig):
            raise ConfigError("--auto chooses lookahead settings: it needs --method=lookahead "
                              "and a Llama-family preset")
        overrides = {k: v for k, v in overrides.items() if k == "prompt_seeding"}  # W/N/G: grid
        from lookahead_jax.auto import resolve_fit  # noqa: PLC0415
        resolve_fit(opts.auto_fit)  # a missing or broken fit file fails before weights load
    if opts.devices is not None and opts.devices < 1:
        raise ConfigError(f"--devices must be >= 1, got {opts.devices}")
    if method in LOOPED_METHODS:
        from models.looped import LoopedConfig  # noqa: PLC0415
        if not isinstance(preset.model, LoopedConfig):
            raise ConfigError(f"--method={method} needs a looped model: preset {preset.name} "
                              f"is not one (use a looped preset, e.g. --config=tiny_ouro)")
    pl = [n for n, v in (("pl_tokens", opts.pl_tokens), ("pl_ngram", opts.pl_ngram))
          if v is not None]
    if pl and method != "prompt_lookup":
        raise ConfigError(f"--{'/--'.join(pl)} only apply to --method=prompt_lookup")
    if method == "prompt_lookup":
        prompt_lookup_method(opts, sampling)  # bad settings fail here, before any weights load
    if method in ("ar", "prompt_lookup", *LOOPED_METHODS):
        if overrides:
            raise ConfigError(f"--{'/--'.join(overrides)} only apply to --method=lookahead")
        if opts.attention == "pallas":
            raise ConfigError("--attention=pallas only applies to --method=lookahead")
        if (opts.devices or 1) > 1:
            raise ConfigError("--devices only applies to --method=lookahead")
        return method, sampling, None, 1
    devices = opts.devices
    if devices is None:
        import jax  # noqa: PLC0415
        devices = len(jax.local_devices()) if preset.parallel else 1
    lookahead = dataclasses.replace(preset.lookahead or LookaheadConfig(), **overrides)
    from pallas_kernels.attention import KernelUnavailable  # noqa: PLC0415
    try:  # the method's own checks (e.g. sampling support, the attention kernel's platform)
        resolve_method(method, sampling, lookahead, opts.attention or "dense", devices)
    except KernelUnavailable as e:
        raise ConfigError(f"--attention={opts.attention}: {e}") from None
    return method, sampling, lookahead, devices


def prompt_lookup_method(opts: Options, sampling):
    """The PromptLookup method of --pl_tokens / --pl_ngram (defaults where not given)."""
    from lookahead_jax.prompt_lookup import (  # noqa: PLC0415
        DEFAULT_NGRAM, DEFAULT_TOKENS, PromptLookup)
    return PromptLookup(sampling,
                        num_tokens=DEFAULT_TOKENS if opts.pl_tokens is None else opts.pl_tokens,
                        max_ngram=DEFAULT_NGRAM if opts.pl_ngram is None else opts.pl_ngram)


def _one_line(msg: str) -> str:
    return " ".join(str(msg).split()) or "unknown error"


# -- running -------------------------------------------------------------------------------------
def run(opts: Options, stdin: TextIO | None = None, stdout: TextIO | None = None,
        stderr: TextIO | None = None) -> int:
    """One CLI run. Returns the exit status (0, or 2 after printing `error: ...` on stderr)."""
    stdin = stdin or sys.stdin
    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr
    try:
        return _run(opts, stdin, stdout, stderr)
    except (ConfigError, OSError) as e:  # every loader error is a ConfigError
        stdout.flush()
        print(f"error: {_one_line(e)}", file=stderr, flush=True)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("", file=stderr)
        return 130


def _run(opts: Options, stdin: TextIO, stdout: TextIO, stderr: TextIO) -> int:
    from lookahead_jax.engine import Engine  # noqa: PLC0415
    from lookahead_jax.presets import (  # noqa: PLC0415
        load_model_and_tokenizer, load_preset, resolve_dtype)

    preset = load_preset(opts.config)
    sources = [n for n, v in (("--prompt", opts.prompt), ("--prompt_file", opts.prompt_file),
                              ("--prompt_ids", opts.prompt_ids)) if v is not None]
    if len(sources) > 1:
        raise ConfigError(f"give one of --prompt, --prompt_file, --prompt_ids, not "
                          f"{' and '.join(sources)}")
    method, sampling, lookahead, devices = resolve_settings(opts, preset)
    method_name = method
    resolve_dtype(opts.dtype, preset)
    chat = preset.chat if opts.chat is None else opts.chat
    if opts.json_out:  # fail before the (slow) generation, not after it
        _make_parent(opts.json_out)

    texts: list[str] | None = None
    ids: list[int] | None = None
    if opts.prompt is not None:
        if not opts.prompt.strip():
            raise ConfigError("empty prompt: --prompt is blank")
        texts = [opts.prompt]
    elif opts.prompt_file is not None:
        texts = read_prompt_file(opts.prompt_file, opts.limit)
    elif opts.prompt_ids is not None:
        ids = parse_prompt_ids(opts.prompt_ids)

    model, tokenizer, source = load_model_and_tokenizer(preset, opts.ckpt, opts.dtype)
    engine = Engine(model, tokenizer, lookahead=lookahead, chat=chat, cache_len=opts.cache_len,
                    attention=opts.attention or "dense", devices=devices)
    if tokenizer is None and ids is None:
        raise ConfigError(
            f"preset {preset.name} with {source} has no tokenizer: give token ids with "
            f"--prompt_ids=1,2,3, or --ckpt with a tokenizer")
    if opts.lad and method != "loopahead":
        raise ConfigError("--lad only applies to --method=loopahead")
    if method == "loopahead":
        from lookahead_jax.loopahead import LadDrafter, LoopAhead  # noqa: PLC0415
        method = LoopAhead(sampling, drafter=LadDrafter.load(opts.lad, model.config)
                           if opts.lad else None)
    elif method == "prompt_lookup":
        method = prompt_lookup_method(opts, sampling)
    auto_choice = None
    if opts.auto:
        auto_choice = _auto_settings(opts, engine, lookahead, texts, ids, chat, stderr)
        lookahead = engine.lookahead = auto_choice.config
    gen_kw = dict(method=method, max_new_tokens=opts.max_new_tokens, sampling=sampling,
                  lookahead=lookahead, seed=opts.seed)
    records = []

    def decode_one(prompt: str | None, prompt_ids: list[int] | None):
        shown = [""]
        if prompt is not None:  # text in, text streamed out
            prompt_ids = engine.encode(prompt, chat)

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
            text = engine.decode(result.tokens[0]) if tokenizer is not None else None
        stdout.write("\n")
        stdout.flush()
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

    if opts.json_out:
        _write_json(opts.json_out, {
            "config": preset.name, "checkpoint": source, "method": method_name,
            "dtype": opts.dtype or preset.dtype, "chat": chat, "seed": opts.seed,
            "max_new_tokens": opts.max_new_tokens, "sampling": dataclasses.asdict(sampling),
            "lookahead": dataclasses.asdict(lookahead) if lookahead else None,
            "attention": opts.attention or "dense", "results": records,
            **({"auto": auto_choice.to_dict()} if auto_choice else {})})
    return status


def _auto_settings(opts: Options, engine, base, texts, ids, chat: bool, stderr: TextIO):
    """--auto: ranks (W, N, G) candidates by predicted speed-up on this device (fixing the
    --W/--N/--G given), prints why on stderr, returns the `auto.AutoChoice`."""
    from lookahead_jax import auto  # noqa: PLC0415
    if ids is not None:
        prompt_len = len(ids)
    elif texts:
        prompt_len = max(len(engine.encode(t, chat)) for t in texts)
    else:  # interactive: prompts not known yet
        prompt_len = 64
    Ws = (opts.W,) if opts.W is not None else auto.GRID_W
    Ns = (opts.N,) if opts.N is not None else auto.GRID_N
    grid = auto.candidate_grid(Ws, Ns, (opts.G,) if opts.G is not None else None)
    print(f"auto: measuring the step-cost curve at cache length "
          f"{prompt_len + opts.max_new_tokens // 2} ...", file=stderr, flush=True)
    choice = auto.choose_settings(engine, prompt_len=prompt_len,
                                  max_new_tokens=opts.max_new_tokens, fit=opts.auto_fit,
                                  grid=grid, base=base)
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
    preset and settings skips XLA compilation. LOOKAHEAD_JAX_NO_COMPILE_CACHE=1 turns it off."""
    if os.environ.get("LOOKAHEAD_JAX_NO_COMPILE_CACHE"):
        return
    import jax  # noqa: PLC0415
    from lookahead_jax.model_store import default_cache_dir  # noqa: PLC0415
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
