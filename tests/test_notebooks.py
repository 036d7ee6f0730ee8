"""The notebooks run top to bottom: `notebooks/quickstart.ipynb` (SmolLM2, plain vs lookahead)
and `notebooks/train_lad.ipynb` (a drafter trained for the tiny looped model, then plain,
LoopSpec and LoopAhead), each executed with nbclient (from a child process) in a fresh kernel
of this interpreter, with small settings (`LOOKAHEAD_NB_SMALL=1`) and the notebooks
directory as working directory, as Jupyter starts them. A cell error fails the test; the
outputs must hold the generated text and a plot. The committed notebooks carry no outputs."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

nbformat = pytest.importorskip("nbformat")
for _needed in ("nbclient", "ipykernel"):
    if importlib.util.find_spec(_needed) is None:
        pytest.skip(f"{_needed} is not installed", allow_module_level=True)

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
CELL_TIMEOUT_S = 900

# Runs in a child process, so that no Jupyter client state (zmq sockets, event-loop threads)
# stays in the test process: argv = notebook, executed copy, kernel spec dir, cwd, timeout.
# The only kernel, `python3`, is this interpreter, whatever kernels the machine has.
_RUNNER = """
import sys
import nbclient, nbformat
from ipykernel.kernelspec import write_kernel_spec
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
src, dst, kernels, cwd, timeout = sys.argv[1:6]
write_kernel_spec(kernels + "/python3")
specs = KernelSpecManager(kernel_dirs=[kernels], ensure_native_kernel=False)
nb = nbformat.read(src, as_version=4)
km = KernelManager(kernel_name="python3", kernel_spec_manager=specs)
try:
    nbclient.NotebookClient(nb, km=km, timeout=int(timeout),
                            resources={"metadata": {"path": cwd}}).execute()
finally:
    nbformat.write(nb, dst)
"""


def execute(name: str, tmp_path) -> list[dict]:
    """Runs notebooks/<name> with small settings in a fresh kernel; returns every code cell's
    outputs. A failing cell fails the test with the error."""
    # the kernel inherits this environment; its temporary files (train_lad's workdir) go to
    # tmp_path, which pytest removes
    env = {**os.environ, "LOOKAHEAD_NB_SMALL": "1", "TMPDIR": str(tmp_path)}
    dst = tmp_path / f"executed_{name}"
    (tmp_path / "kernels").mkdir()
    res = subprocess.run([sys.executable, "-c", _RUNNER, str(NOTEBOOKS / name), str(dst),
                          str(tmp_path / "kernels"), str(NOTEBOOKS), str(CELL_TIMEOUT_S)],
                         env=env, capture_output=True, text=True, timeout=2 * CELL_TIMEOUT_S)
    if res.returncode != 0:
        pytest.fail(f"{name} failed:\n{res.stderr[-4000:]}")
    nb = nbformat.read(dst, as_version=4)
    return [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs]


def text_of(outputs: list[dict]) -> str:
    parts = []
    for out in outputs:
        if out.output_type == "stream":
            parts.append(out.text)
        elif "data" in out and "text/plain" in out.data:
            parts.append(out.data["text/plain"])
    return "".join(parts)


def has_png(outputs: list[dict]) -> bool:
    return any("image/png" in out.get("data", {}) for out in outputs)


def test_quickstart(tmp_path):
    from lookahead_jax.store.model_store import smollm2_gguf  # noqa: PLC0415
    from models.config import ConfigError  # noqa: PLC0415
    try:
        smollm2_gguf(download=False)
    except ConfigError:
        pytest.skip("SmolLM2 not fetched (python -m lookahead_jax.store.model_store)")
    outputs = execute("quickstart.ipynb", tmp_path)
    text = text_of(outputs)
    assert "lookahead_jax is installed: nothing to install" in text  # the install cell
    for heading in ("=== plain greedy (method='ar') ===", "=== lookahead ==="):
        after = text.split(heading, 1)[1].split("===", 1)[0]
        assert after.strip(), f"no generated text after {heading!r}"
    assert "token ids identical: True" in text
    assert "step compression S:" in text and "tokens/s:" in text
    assert has_png(outputs)


def test_train_lad(tmp_path):
    outputs = execute("train_lad.ipynb", tmp_path)
    text = text_of(outputs)
    generated = [line for line in text.splitlines() if line.startswith("--- generated text: ")]
    assert len(generated) == 2, text  # one per prompt (the tiny model's text may be anything)
    for method in ("plain (ar)", "LoopSpec", "LoopAhead"):
        assert f"{method:22s} identical to plain greedy: True" in text
    assert "loops/token" in text
    assert has_png(outputs)


@pytest.mark.parametrize("name", ["quickstart.ipynb", "train_lad.ipynb"])
def test_committed_without_outputs(name):
    """Outputs (plots, timings of one machine) are not committed: the files stay small and
    their diffs readable."""
    path = NOTEBOOKS / name
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code)
    assert path.stat().st_size < 50_000


@pytest.mark.parametrize("name", ["quickstart.ipynb", "train_lad.ipynb"])
def test_install_cell_installs_from_a_clone_with_the_tpu_extra(name):
    """No placeholder owner in an address: the install cell installs the clone it finds (or
    /content/lookahead_jax on Colab) with the `notebooks` extra, plus `tpu` on a TPU host that
    has no libtpu."""
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    text = "\n".join(c.source for c in nb.cells)
    assert "OWNER" not in text and "github.com" not in text
    install = next(c.source for c in nb.cells if c.cell_type == "code" and "pip" in c.source)
    assert '"tpu,notebooks" if NEED_LIBTPU else "notebooks"' in install
    assert '"-e", f"{ROOT}[{extras}]"' in install and "/content/lookahead_jax" in install
