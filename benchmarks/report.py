"""Write the measured sections of docs/benchmarks.md from the kept results (benchmarks/results/*.json).

    python benchmarks/report.py            # rewrite every generated section from its result
    python benchmarks/report.py --check    # exit 1 if the doc differs from what the results give

`benchmarks/record.py` runs a script and keeps its result; this renders each result that has a renderer here into
the doc, between `<!-- results:NAME -->` and `<!-- /results:NAME -->` (what is between is replaced whole; the prose
around it is the method, written by hand). Each section starts with the command, the commit, the date and the
machine the figures come from. `make bench-doc` runs this.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "benchmarks.md"


def provenance(rec: dict[str, Any]) -> str:
    m = rec["machine"]
    changed = " with uncommitted changes" if rec.get("work_tree_changed") else ""
    return (f"Measured by `{rec['command']}` at commit {rec['commit']}{changed} on {rec['date'][:10]}: "
            f"{m.get('cpu', m['platform'])}, {m['cpus']} CPUs ({', '.join(m.get('cpu_flags', []))}), "
            f"{m.get('memory_gib', '?')} GiB, torch {m.get('torch', '?')}, load average "
            f"{m['load_before'][0]} before and {m['load_after'][0]} after ({rec['seconds'] / 60:.0f} min).")


def table(head: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def render_cpu_decode(rec: dict[str, Any]) -> str:
    res = rec["result"]
    out = [provenance(rec)]
    for model in ("smollm2-135m-instruct", "default"):
        if model not in res:
            continue
        r = res[model]
        names = [k for k, v in r.items() if isinstance(v, dict) and "tok_s" in v]
        rows = []
        for n in names:
            c = r[n]
            comp = c.get("compile")
            compiled = ("" if comp is None else
                        f"{'+'.join(str(s) for s in comp['compile_s']) or '-'} s"
                        f"{', failed' if comp['failed'] else ''}; {comp['timed_steps_eager']} timed steps eager"
                        f"{'' if c.get('same_tokens_as_eager', True) else '; tokens differ from eager'}")
            rows.append([f"`{n}`", f"{c['weight_bytes_per_token'] / 1e6:.0f} MB", c["tok_s"],
                         f"{min(c['tok_s_reps'])}–{max(c['tok_s_reps'])}", f"{c['bandwidth_fraction']:.0%}",
                         f"{c['matching_prefix']}/{c['tokens']}", compiled])
        out += [f"\n**{model}** ({Path(r['path']).name}; read rate during its reps: copy "
                f"{r['read_rate']['copy_read_gb_s']} GB/s)\n",
                table(["contender", "weights read/token", "tok/s (median)", "reps", "of the copy's read rate",
                       "greedy tokens as float32", "compiled: compile seconds; check"], rows)]
        ratios = r["ratios"]
        keep = [k for k in ratios if k.endswith(("_over_llamacpp", "_over_transformers_fp32"))
                or k == "engine_defaults_over_engine_auto"]
        out.append("\nRatios (tok/s, same run): " + ", ".join(f"{k.removeprefix('engine_')} **{ratios[k]}×**"
                                                            for k in keep) + ".")
        peer = r.get("llamacpp", {}).get("build")
        if peer:
            out.append(f"\nllama.cpp: llama-cpp-python {peer['llama_cpp_python']} built with "
                       f"{', '.join(peer['features'])}.")
    return "\n".join(out)


def render_compile_background(rec: dict[str, Any]) -> str:
    r = rec["result"]
    rows = []
    for key, label in (("baseline", "eager, no compile running (`--cpu-compile off`)"),
                       ("during_cold_compile", "while a cold compile runs (the default: the worker at SCHED_IDLE, "
                        "stopped while the engine works)"),
                       ("during_cold_compile_normal_priority", "while a cold compile runs, the worker at normal "
                        "priority, never stopped"),
                       ("warm_start", "a second start, its compiled step in the cache"),
                       ("compiled", "compiled, once ready")):
        if key in r:
            p = r[key]
            rows.append([label, p["ticks"], p["p50_ms"], p["p95_ms"], p["max_ms"], p["deadline_misses"]])
    cold, warm = r["during_cold_compile"], r["warm_start"]
    normal = r.get("during_cold_compile_normal_priority")
    return "\n".join([
        provenance(rec), "",
        table(["the loop's ticks (200 ms period)", "ticks", "p50 ms", "p95 ms", "max ms", "deadline misses"], rows),
        "", f"Model {r['model']}. A cold compile took {cold['compile_s']} s in the worker while the loop ran (the "
            f"engine served compiled {cold['ready_after_s']} s after its load); a second start in a fresh process "
            f"loaded the library that compile left ({warm.get('workers', '?')} workers started) and served compiled "
            f"{warm['ready_after_s']} s after its load ({warm['load_s']} s to load)."
            + (f" At normal priority the cold compile took {normal['compile_s']} s." if normal else "")])


def render_step_costs(rec: dict[str, Any]) -> str:
    r = rec["result"]
    sizes = sorted(int(k.split("_")[1]) for k in r if k.startswith("threads_") and k.endswith("_tokens_ms"))
    many = str(r["threads"])
    rows = [[n, r[f"threads_{n}_tokens_ms"]["1"], r[f"threads_{n}_tokens_ms"][many],
             r[f"threads_{n}_tokens_ms"]["many_over_one"]] for n in sizes]
    v, d32, draft = r["verify_ms"], r["decode_32_sessions_ms"], r["draft_forward_ms"]
    costs = [["verification of T tokens (all logits) against a one-token step, 290 tokens cached",
              "; ".join(f"{t}: {ms} ms" for t, ms in v.items()),
              ", ".join(f"r({t}) {x}" for t, x in r["verify_ratio"].items())],
             ["a decode step of 32 sessions: one padded attention call against one per session",
              f"{d32['batched_attention']} vs {d32['per_session']} ms", f"{d32['per_session_over_batched']}×"],
             ["the shipped draft model's one-token forward against the target's",
              f"{draft['draft']} vs {draft['target']} ms", f"{draft['draft_over_target']}"]]
    return "\n".join([provenance(rec), "", table(["", "measured", "ratio"], costs), "",
                      table(["step tokens", "1 thread ms", f"{many} threads ms", f"{many} threads ÷ 1"], rows), "",
                      f"All threads pay from **{r['threads_pay_from_tokens']} tokens** on (every larger step "
                      "ran faster on them): `CPU_SMALL_STEP_TOKENS`."])


RENDERERS: dict[str, Callable[[dict[str, Any]], str]] = {
    "cpu_decode": render_cpu_decode, "compile_background": render_compile_background,
    "step_costs": render_step_costs}


def rendered(doc: str) -> str:
    for name, render in RENDERERS.items():
        path = RESULTS / f"{name}.json"
        start, end = f"<!-- results:{name} -->", f"<!-- /results:{name} -->"
        if not path.is_file() or start not in doc:
            continue
        section = f"{start}\n{render(json.loads(path.read_text()))}\n{end}"
        doc = re.sub(re.escape(start) + ".*?" + re.escape(end), lambda _, text=section: text, doc, flags=re.S)
    return doc


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="only check that the doc is what the results give")
    args = p.parse_args()
    doc = DOC.read_text()
    new = rendered(doc)
    if args.check:
        if new != doc:
            print("docs/benchmarks.md differs from benchmarks/results/: run python benchmarks/report.py",
                  file=sys.stderr)
            return 1
        return 0
    DOC.write_text(new)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
