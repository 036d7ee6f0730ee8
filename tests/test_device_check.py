"""`python -m benchmarks.device_check`: the smoke run of every part (so the script cannot rot
before it meets a device), the end-to-end part on a real checkpoint, the time budget, what
counts as a failure, and the refusal to run the full check without an accelerator."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import pytest

from benchmarks import device_check as dc

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_module(*args: str, timeout: int = 300):
    env = {**os.environ, "PYTHONPATH": REPO}
    return subprocess.run([sys.executable, "-m", "benchmarks.device_check", *args], cwd=REPO,
                          env=env, text=True, capture_output=True, timeout=timeout)


def test_smoke_run_measures_every_part(tmp_path):
    res = run_module("--smoke", f"--out={tmp_path}")
    assert res.returncode == 0, res.stderr[-3000:]
    rec = json.loads((tmp_path / "device_check.json").read_text())
    md = (tmp_path / "device_check.md").read_text()
    assert md in res.stdout  # the summary printed is the Markdown written
    assert rec["smoke"] and rec["status"] == "ok"
    parts = rec["parts"]

    kernel = parts["kernel"]  # compiled on a GPU/TPU host, interpreted elsewhere
    assert kernel["exact"] and kernel["interpret"] == (jax.default_backend() not in
                                                       ("gpu", "tpu"))
    assert all(r["max_err_f32"] <= 1e-4 and r["kernel_us"] > 0 and r["dense_us"] > 0
               for r in kernel["rows"])

    plain = parts["plain"]
    assert plain["ms_per_token"] > 0 and plain["copy_GBps"] > 0 and plain["roofline_ms"] > 0
    assert plain["tokens"] == 2 * dc.smoke_shapes().new_tokens
    assert plain["bytes_per_token"] > plain["kv_bytes"] > 0

    look = parts["lookahead"]
    assert look["attentions"] == ["dense", "pallas"]
    (row,) = look["rows"]
    assert row["setting"] == "(5,3,5)" and row["T"] == 20
    for att in ("dense", "pallas"):
        assert row[f"{att}_ms"] > 0
        assert row[f"{att}_x_plain"] == pytest.approx(row[f"{att}_ms"] / look["plain_ms"])
    # S comes from the committed SmolLM2 results; the implied speed-up is S / the multiple
    committed = dc.smollm2_step_compression()["(5,3,5)"]
    assert row["smollm2_S"] == committed and "mt_bench" in committed
    best = min(row["dense_x_plain"], row["pallas_x_plain"])
    assert row["implied_speedup"]["mt_bench"] == pytest.approx(committed["mt_bench"] / best)
    assert "implied" in md

    cost = parts["step_cost"]
    assert [r["T"] for r in cost["rows"]] == [1, 2, 4, 8] and cost["rows"][0]["x_T1"] == 1.0
    assert "no --ckpt given" in parts["ckpt"]["skipped"]


def test_ckpt_part_decodes_mt_bench_losslessly(hf_ckpt):
    """The end-to-end part on a real (tiny) Hugging Face checkpoint with a tokenizer: plain and
    lookahead greedy on the shipped MT-Bench prompts, token-identical."""
    out = dc.part_ckpt(hf_ckpt, "tiny_llama", 2, 10, (3, 3, 2), dc.Budget(600))
    assert out["prompts"] == 2 and out["identical"] == 2
    assert out["setting"] == [3, 3, 2] and out["S"] >= 1.0
    assert out["plain_tokens_per_s"] > 0 and out["lookahead_tokens_per_s"] > 0
    assert out["speedup"] == pytest.approx(out["lookahead_tokens_per_s"] /
                                           out["plain_tokens_per_s"])
    assert len(dc.mt_bench_prompts(10)) == 10  # what ships in benchmarks/data


def test_spent_budget_skips_the_parts_and_says_why(tmp_path):
    rec = dc.run(out_dir=str(tmp_path), smoke=True, budget_s=0, log=lambda s: None)
    assert set(rec["parts"]) == {"kernel", "plain", "lookahead", "step_cost", "ckpt"}
    for name, part in rec["parts"].items():
        assert "time budget" in part["skipped"], name
    md = (tmp_path / "device_check.md").read_text()
    assert md.count("skipped:") == 5


def test_failures_fail_the_run():
    parts = {"kernel": {"exact": False}, "plain": {"error": "OOM"},
             "ckpt": {"prompts": 10, "identical": 9}}
    assert dc.failures({"parts": parts}) == [
        "plain failed", "kernel not exact", "1 outputs differ from plain greedy"]
    assert dc.failures({"parts": {"kernel": {"exact": True}, "ckpt": {"skipped": "x"}}}) == []


@pytest.mark.skipif(jax.default_backend() != "cpu",
                    reason="on an accelerator host the command runs the full check")
def test_full_check_refuses_a_cpu_only_jax():
    res = run_module(timeout=120)
    assert res.returncode == 2
    assert "no accelerator" in res.stderr and "--smoke" in res.stderr
    assert "Traceback" not in res.stderr
