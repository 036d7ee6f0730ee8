"""The test run's quick XLA CPU compilation (applied by conftest.py, which says why and what it
costs) and its counterpart for the few programs that run long."""

from __future__ import annotations

import os

UNOPTIMISED = "--xla_backend_optimization_level=0"  # LLVM without optimisation
FAST_CPU_COMPILE = (UNOPTIMISED, "--xla_cpu_use_fusion_emitters=false",
                    "--xla_cpu_parallel_codegen_split_count=1")
# the flags the run applies (those the installed XLA knows), set by the first pytest process
APPLIED_ENV = "LOOKAHEAD_JAX_TESTS_FAST_COMPILE"


def long_run_options() -> dict[str, int] | None:
    """Compiler options for a program that samples thousands of rows. The test run compiles for
    quick compilation (most tests' programs run for far less time than they take to compile),
    and such a program then runs several times slower; this gives it LLVM's default
    optimisation back (None when the run keeps XLA's defaults). Alone, the budget test of
    test_loopahead_sampling.py took 125 s with the run's flags, 42 s with this, and 49 s with
    the fusion emitters switched back on as well. (A real model's programs are compile-bound:
    test_recursive.py's shipped-model tests took 154 s with the run's flags and 398 s with
    this.)"""
    if UNOPTIMISED in os.environ.get(APPLIED_ENV, "").split():
        return {"xla_backend_optimization_level": 3}
    return None
