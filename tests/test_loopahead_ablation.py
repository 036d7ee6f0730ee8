"""`python -m benchmarks.loopahead_ablation` (LoopAhead's ablation: drafter on / off x
scheduling on / off at a budget, LoopSpec at the same depths) end to end on the shipped
tiny_ouro and its shipped drafter, with the test's own prompt files: every row equals plain
greedy, each scheduling-on row carries scheduling's effect, the shares are shares; sampling
at temperature 1 reports acceptance and leaves exactness to the chi-square tests."""

from __future__ import annotations

import os

import pytest

from lookahead_jax.sampling import Sampling

from test_suite import write_data

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAD = os.path.join(REPO, "checkpoints", "tiny_ouro_lad")


def _run(tmp_path, budgets, **kw) -> dict:
    """The ablation on one GSM8K prompt of the test's own files, 8 new tokens."""
    from benchmarks import loopahead_ablation as ab  # noqa: PLC0415
    if not os.path.isdir(LAD):
        pytest.skip(f"no shipped drafter at {LAD}")
    os.makedirs(tmp_path / "data")
    data = write_data(tmp_path / "data", n=1)
    return ab.run("tiny_ouro", LAD, budgets, ["gsm8k"], 1, 8, data_dir=data,
                  ckpt=os.path.join(REPO, "checkpoints", "tiny_ouro"), log=lambda m: None,
                  **kw)


def test_ablation_table(tmp_path):
    from benchmarks import loopahead_ablation as ab  # noqa: PLC0415
    rec = _run(tmp_path, [4])
    rows = rec["rows"]
    assert [(r["lad"], r["scheduling"]) for r in rows] == [
        (True, True), (True, False), (False, True), (False, False), (None, None)]
    assert all(r["exact"] for r in rows)
    assert rows[-1]["budget"] is None and rows[-1]["method"].startswith("LoopSpec (d1=1, d2=2)")
    for r in rows:
        assert 0 < r["loops_vs_plain"] <= 1.0 and r["cpu_speedup"] > 0
        assert 0 <= r["discarded_advance_share"] <= 1 and 0 <= r["discarded_full_share"] <= 1
        assert ("sched_gain" in r) == bool(r["scheduling"])
    on, off = rows[0], rows[1]
    assert on["sched_gain"] == pytest.approx(off["loops_vs_plain"] / on["loops_vs_plain"])
    md = ab.table(rec)
    assert "| 4 | LAD on, scheduling on |" in md and "| n/a | LoopSpec" in md
    assert rec["suspend_below"] is None and ab.result_name(rec) == "loopahead_ablation_tiny_ouro"


def test_ablation_sampling(tmp_path):
    from benchmarks import loopahead_ablation as ab  # noqa: PLC0415
    rec = _run(tmp_path, [0], sampling=Sampling(1.0), seed=3, node_costs=(0.2,))
    assert rec["sampling"] == {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "seed": 3}
    # the method's default threshold (no child pauses), recorded and in the file's name
    assert rec["suspend_below"] == 0.0
    assert ab.result_name(rec) == "loopahead_ablation_tiny_ouro_t1_s0"
    rows = rec["rows"]
    assert all(r["exact"] is None and 0 <= r["acceptance"] <= 1 for r in rows)
    assert any(r["acceptance"] > 0 for r in rows)
    md = ab.table(rec)
    assert "n/a (sampling)" in md
    # the shipped drafter is calibrated: rows with calibrated retention, scheduling on / off
    assert [(r["lad"], r["node_cost"], r["scheduling"]) for r in rows[:4]] == [
        (True, None, True), (True, None, False), (True, 0.2, True), (True, 0.2, False)]
    assert "sched_gain" in rows[2] and "LAD on (calibrated, node cost 0.2), scheduling on" in md


def test_suspend_below_reaches_every_loopahead_row(capsys):
    from benchmarks import loopahead_ablation as ab  # noqa: PLC0415
    from lookahead_jax.engine import Engine  # noqa: PLC0415
    if not os.path.isdir(LAD):
        pytest.skip(f"no shipped drafter at {LAD}")
    engine = Engine.from_preset("tiny_ouro", ckpt=os.path.join(REPO, "checkpoints", "tiny_ouro"))
    for budget, want, got in ((0, None, 0.0), (0, 0.25, 0.25), (4, None, 1.0), (4, 0.0, 0.0)):
        methods = ab.ablation_methods(engine, LAD, budget, sampling=Sampling(0.7),
                                      node_costs=(0.3,), suspend_below=want)
        looped = [m for (label, *_), m in methods.items() if not label.startswith("LoopSpec")]
        assert len(looped) == 6 and {m.suspend_below for m in looped} == {got}
    ab.define_flags()
    for argv, msg in ((["--suspend_below=0.1"], "applies to sampling"),
                      (["--suspend_below=2", "--temperature=0.7"], "must lie in [0, 1]")):
        ab.FLAGS(["ablation", f"--lad={LAD}", *argv])
        try:
            assert ab.main([]) == 2
            assert msg in capsys.readouterr().err
        finally:
            ab.FLAGS.unparse_flags()


def test_the_run_threshold_and_file_name_follow_the_rows():
    """A sampling run without --suspend_below records the rows' default threshold, "auto" (and
    `_sauto` in the file's name) when budgets make it differ; greedy records none."""
    from benchmarks import loopahead_ablation as ab  # noqa: PLC0415
    rows = lambda *ts: [{"suspend_below": t} for t in ts]  # noqa: E731
    hot = Sampling(0.7)
    assert ab.threshold_of(rows(0.0, 0.0, None), hot, None) == 0.0
    assert ab.threshold_of(rows(0.0, 1.0, None), hot, None) == "auto"
    assert ab.threshold_of(rows(1.0, 1.0), hot, 1.0) == 1.0
    assert ab.threshold_of(rows(None), Sampling(), None) is None
    rec = {"config": "m", "sampling": {"temperature": 0.7}}
    assert ab.result_name({**rec, "suspend_below": "auto"}) == "loopahead_ablation_m_t0.7_sauto"
    assert ab.result_name({**rec, "suspend_below": 1.0}) == "loopahead_ablation_m_t0.7_s1"
