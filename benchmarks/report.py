"""Write the measured sections of docs/benchmarks.md from the kept results (benchmarks/results/*.json).

    python benchmarks/report.py            # rewrite every generated section from its result
    python benchmarks/report.py --check    # exit 1 if the doc differs from what the results give

`benchmarks/record.py` runs a script and keeps its result; this renders each result into the doc with its
renderer (report_engine.py, report_serving.py, report_media.py, report_scale.py; shared helpers in report_format.py),
between `<!-- results:NAME -->` and `<!-- /results:NAME -->` (what is between is replaced whole; the prose around it
is the method, written by hand). The shipped checkpoints' training records render the same way. Each section starts
with the command, the commit, the date and the machine the figures come from. `make bench-doc` runs this.
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
ASSETS = ROOT / "streamserve" / "assets"


# shipped checkpoints' own training records, rendered like results: their name -> their folder under assets/
TRAINING = {"training_default": "default", "training_draft": "default-draft", "training_policy": "default-policy"}


def renderers() -> dict[str, Callable[[dict[str, Any]], str]]:
    import report_engine
    import report_media
    import report_scale
    import report_serving

    out: dict[str, Callable[[dict[str, Any]], str]] = {}
    for module in (report_engine, report_serving, report_media, report_scale):
        out.update(module.RENDERERS)
    out.update(dict.fromkeys(TRAINING, report_engine.render_training))
    out["training_policy"] = report_engine.render_policy_training
    return out


def record_of(name: str) -> dict[str, Any] | None:
    """The kept result `name` (a training record of a shipped checkpoint for TRAINING's names), or None."""
    if name in TRAINING:
        path = ASSETS / TRAINING[name] / "training.json"
        if not path.is_file():
            return None
        result = json.loads(path.read_text())
        args = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in result.get("args", {}).items() if v != "None")
        tool = "train_policy" if name == "training_policy" else "train_tiny"
        return {"command": f"python -m streamserve.tools.{tool} {args}".strip(), "result": result}
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def rendered(doc: str) -> str:
    for name, render in renderers().items():
        start, end = f"<!-- results:{name} -->", f"<!-- /results:{name} -->"
        rec = record_of(name) if start in doc else None
        if rec is None:
            continue
        section = f"{start}\n{render(rec)}\n{end}"
        doc = re.sub(re.escape(start) + ".*?" + re.escape(end), lambda _, text=section: text, doc, flags=re.S)
    return doc


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="only check that the doc is what the results give")
    args = p.parse_args()
    doc = DOC.read_text()
    unrendered = sorted(p.stem for p in RESULTS.glob("*.json") if p.stem not in renderers())
    if unrendered:
        print(f"no renderer for the kept results {unrendered}: add one to a report_*.py", file=sys.stderr)
        return 1
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
