"""Running a test file on 8 CPU devices.

XLA creates 8 CPU devices only in a process started with
XLA_FLAGS=--xla_force_host_platform_device_count=8, before JAX starts. A test file that needs
them marks those tests `@needs8` (they skip, saying why, in a normal run) and has one test
that reruns the file in a child process with the flag:

    @pytest.mark.skipif(ON_8_CPU_DEVICES, reason="already running on 8 CPU devices")
    def test_on_8_cpu_devices():
        rerun_on_8_cpu_devices(__file__, min_passed=10)

On a GPU or TPU host the child runs on CPU devices too, so what the tests inspect (collectives,
memory) is always the CPU program's.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import jax
import pytest

DEVICES = 8
ON_8_CPU_DEVICES = jax.default_backend() == "cpu" and len(jax.devices()) >= DEVICES
needs8 = pytest.mark.skipif(not ON_8_CPU_DEVICES,
                            reason="needs 8 CPU devices: run by test_on_8_cpu_devices in its own "
                                   "process with --xla_force_host_platform_device_count=8")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rerun_on_8_cpu_devices(path: str, min_passed: int, timeout: int = 1800) -> None:
    """Runs the test file `path` in a child pytest on 8 CPU devices; fails unless it passes
    with at least `min_passed` tests passed (so the `needs8` tests really ran)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") +
                          f" --xla_force_host_platform_device_count={DEVICES}").strip())
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        os.path.abspath(path)], env=env, cwd=REPO, capture_output=True,
                       text=True, timeout=timeout)
    tail = r.stdout[-6000:] + r.stderr[-3000:]
    assert r.returncode == 0, tail
    passed = re.search(r"(\d+) passed", r.stdout)
    assert passed and int(passed.group(1)) >= min_passed, tail
