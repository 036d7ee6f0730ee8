"""Shared test setup: free each test module's compiled programs when it ends.

One pytest process compiles several hundred XLA programs; each keeps its machine code mapped
in memory for as long as something references it. Clearing JAX's caches and collecting the
module's engines after every module keeps the process far below the kernel's limit on memory
mappings (vm.max_map_count, 65530 by default), which a full run otherwise reaches, and the
next XLA compile then crashes."""

from __future__ import annotations

import gc

import jax
import pytest


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    yield
    gc.collect()
    jax.clear_caches()
    gc.collect()
