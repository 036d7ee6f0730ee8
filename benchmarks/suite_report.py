"""A suite report as Markdown: the main table (every data set x method), the scaling-law fits
and the --check_auto verdict."""

from __future__ import annotations

from benchmarks.common import markdown_table

HEADERS = ["data set", "method", "prompts", "exact", "steps", "tokens", "S"]
LOOPED_HEADERS = ["loops/token", "loops/token vs plain", "advances/token"]


def _main_table(rows: list[dict]) -> str:
    looped = any("loops_per_token" in r for r in rows)
    law = any("S_law" in r for r in rows)
    headers = HEADERS + (["S (law)"] if law else []) + ["ms/step", "tokens/s", "speed-up"]
    headers += LOOPED_HEADERS if looped else []
    plain_loops = {r["dataset"]: r.get("loops_per_token") for r in rows if r["method"] == "plain"}
    table = []
    for r in rows:
        exact = "n/a (sampling)" if r["exact"] is None else f"{r['exact']}/{r['prompts']}"
        line = [r["dataset"], r["method"], r["prompts"], exact, r["steps"], r["tokens"], r["S"]]
        line += [r.get("S_law", "")] if law else []
        line += [r["step_ms"], r["tokens_per_s"],
                 f"{r['speedup']:.2f}x" if r.get("speedup") is not None else ""]
        if looped:
            lpt, base = r.get("loops_per_token"), plain_loops.get(r["dataset"])
            line += [lpt if lpt is not None else "", round(lpt / base, 3) if lpt and base else "",
                     r.get("advances_per_token", "")]
        table.append(line)
    return markdown_table(headers, table)


def _auto_section(chk: dict) -> list[str]:
    p = chk["predicted"]
    out = ["", f"--auto picks {chk['label']} (a={chk['fit']['a']:.3f}, "
               f"f={chk['fit']['f']:.2f}; predicted S {p['S']:.2f}, step cost "
               f"{p['cost']:.2f}, speed-up {p['speedup']:.2f}x):", ""]
    out.append(markdown_table(
        ["data set", "auto speed-up", "best measured", "its speed-up", "auto / best",
         "within 10%"],
        [[ds, f"{v['auto_speedup']:.2f}x", v["best"], f"{v['best_speedup']:.2f}x",
          v["ratio"], "yes" if v["within_10pct"] else "NO"]
         for ds, v in chk["datasets"].items()]))
    out += ["", f"--auto check: {'passed' if chk['passed'] else 'FAILED'}"]
    return out


def markdown_report(report: dict) -> str:
    """The results as Markdown: the main table, then fits and the --check_auto verdict."""
    m = report["machine"]
    out = [f"# Benchmark suite: {report.get('config') or 'engine'}", "",
           f"{m.get('jax_backend')} ({m.get('processor')}, {m.get('cpus')} CPUs), "
           f"{report['max_new_tokens']} new tokens, first {report['num_prompts']} prompts per "
           f"data set, sampling {report['sampling']}; compile time excluded "
           f"({report.get('compile_s', 0):.0f}s).", "", _main_table(report["summary"])]
    if report.get("skipped"):
        out += ["", "Skipped: " + "; ".join(report["skipped"]) + "."]
    if report.get("fits"):
        out += ["", "Scaling law S = (f - 1 + E(a, N-1, G)) / f, fitted:", ""]
        out.append(markdown_table(
            ["data set", "a", "f", "rmse of S", "settings"],
            [[k, v["a"], v["f"], v["rmse"] if v["rmse"] is not None else "", v["points"]]
             for k, v in report["fits"].items()]))
    if report.get("auto_check"):
        out += _auto_section(report["auto_check"])
    return "\n".join(out)
