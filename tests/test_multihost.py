"""Multi-host decoding through `jax.distributed`, as two processes on localhost.

Each process is `python -m lookahead_jax.decode` with --coordinator_address, --num_processes
and --process_id, 4 CPU devices of its own (XLA_FLAGS), and CPU collectives over gloo; the
mesh lookahead:2,model:4 spans both processes' 8 devices. Pinned:
  * the two processes produce the same tokens as one device, greedy, sampling, and with weights
    read sharded from a Hugging Face checkpoint (one process on the same mesh equals one device:
    test_mesh.py); only process 0 prints and writes --json_out;
  * a process given an address where no coordinator listens fails with a clear error within
    its --distributed_timeout, and a process told a different process count than the
    coordinator's says so and exits (the coordinator then aborts within its timeout), instead
    of either hanging.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = ["--config=tiny_llama", "--prompt_ids=3,5,7,9,11,3,5,7", "--max_new_tokens=20",
        "--seed=1"]
TIMEOUT = 10  # --distributed_timeout of the failing runs (short: each test waits it out)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _env(devices: int) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", LOOKAHEAD_JAX_NO_COMPILE_CACHE="1",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    env.pop("JAX_COORDINATOR_ADDRESS", None)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # the test run's cache (conftest.py): not here
    return env


def _start(extra: list[str], devices: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "lookahead_jax.decode", *ARGS, *extra],
                            cwd=REPO, env=_env(devices), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _finish(p: subprocess.Popen, timeout: float) -> tuple[int, str, str]:
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        pytest.fail(f"no exit within {timeout} s (a hang): {err[-2000:]}")
    return p.returncode, out, err


def _tokens(path: str) -> list[int]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)["results"][0]["tokens"]


def _distributed(port: int, i: int, n: int, extra: list[str]) -> list[str]:
    return [f"--coordinator_address=localhost:{port}", f"--num_processes={n}",
            f"--process_id={i}", *extra]


# sampling on two processes is slow (CI's time); sampling on the same mesh in one process:
# test_mesh.py
@pytest.mark.parametrize("run", ["greedy", pytest.param("sampling", marks=pytest.mark.slow),
                                 "hf_checkpoint"])
def test_two_processes_equal_one(tmp_path, request, run):
    """hf_checkpoint: the weights come from a Hugging Face directory, each process reading
    only the slices of its own devices' shards."""
    sampling = {"greedy": [], "sampling": ["--temperature=1.0"],
                "hf_checkpoint": [f"--ckpt={request.getfixturevalue('hf_ckpt')}"]}[run]
    mesh = ["--mesh=lookahead:2,model:4", *sampling]
    # (one process on the same mesh equals one device: test_mesh.py)
    single = _start([*sampling, "--devices=1", f"--json_out={tmp_path / 'single.json'}"],
                    devices=1)
    code, single_out, err = _finish(single, 600)
    assert code == 0, err[-3000:]

    port = _free_port()
    procs = [_start(_distributed(port, i, 2, [*mesh, f"--json_out={tmp_path / f'p{i}.json'}"]),
                    devices=4) for i in range(2)]
    results = [_finish(p, 600) for p in procs]
    for code, _, err in results:
        assert code == 0, err[-3000:]
    assert _tokens(tmp_path / "p0.json") == _tokens(tmp_path / "single.json")
    assert not (tmp_path / "p1.json").exists()  # process 0 alone writes
    # and prints: the streamed ids end process 0's stdout (gloo's threads print their
    # connections to stdout too, interleaved with the first ids), not process 1's
    tail = " ".join(str(t) for t in _tokens(tmp_path / "p0.json")[-8:])
    outs = [" ".join(out.split()) for _, out, _ in results]
    assert outs[0].endswith(tail) and not outs[1].endswith(tail), outs
    assert "tokens/s" in results[0][2] and "tokens/s" not in results[1][2]


def test_wrong_coordinator_fails_fast():
    port = _free_port()  # nobody listens there
    t0 = time.monotonic()
    p = _start(_distributed(port, 1, 2, [f"--distributed_timeout={TIMEOUT}"]), devices=1)
    code, _, err = _finish(p, TIMEOUT + 60)
    assert code == 2, err[-2000:]
    assert f"cannot reach the coordinator at localhost:{port} within {TIMEOUT} s" in err
    assert "Traceback" not in err
    assert time.monotonic() - t0 < TIMEOUT + 60


def test_mismatched_process_count_fails():
    port = _free_port()
    extra = ["--mesh=lookahead:2,model:4", f"--distributed_timeout={TIMEOUT}"]
    t0 = time.monotonic()
    coordinator = _start(_distributed(port, 0, 2, extra), devices=4)
    other = _start(_distributed(port, 1, 3, extra), devices=4)
    code1, _, err1 = _finish(other, 3 * TIMEOUT + 60)
    code0, _, err0 = _finish(coordinator, 3 * TIMEOUT + 60)
    assert code1 != 0 and code0 != 0, (err0[-1500:], err1[-1500:])
    assert ("started with --num_processes=3, but the coordinator at "
            f"localhost:{port} runs 2 processes") in err1
    assert time.monotonic() - t0 < 3 * TIMEOUT + 60


def test_environment_alone_starts_distributed(monkeypatch):
    """JAX's own variables, without the flags, also start jax.distributed."""
    from lookahead_jax.decode import Options, _distributed  # noqa: PLC0415
    monkeypatch.delenv("JAX_COORDINATOR_ADDRESS", raising=False)
    assert not _distributed(Options())
    assert _distributed(Options(num_processes=2))
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "localhost:1234")
    assert _distributed(Options())
