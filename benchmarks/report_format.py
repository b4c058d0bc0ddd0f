"""What every rendered section of docs/benchmarks.md shares: the provenance line and Markdown tables."""

from __future__ import annotations

from typing import Any


def provenance(rec: dict[str, Any]) -> str:
    """The line each section starts with: the command, the commit, the date and the machine of a kept result."""
    m = rec["machine"]
    changed = " with uncommitted changes" if rec.get("work_tree_changed") else ""
    flags = f" ({', '.join(m['cpu_flags'])})" if m.get("cpu_flags") else ""
    memory = f", {m['memory_gib']} GiB" if m.get("memory_gib") else ""
    load = (f", load average {m['load_before'][0]} before and {m['load_after'][0]} after" if m.get("load_before")
            else "")
    note = f" Note: {rec['note']}." if rec.get("note") else ""
    return (f"Measured by `{rec['command']}` at commit {rec['commit']}{changed} on {rec['date'][:10]}: "
            f"{m.get('cpu', m['platform'])}, {m['cpus']} CPUs{flags}{memory}, torch {m.get('torch', '?')}{load} "
            f"({minutes(rec['seconds'])}).{note}")


def minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def table(head: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def num(x: float | int | None, digits: int = 1) -> str:
    """A figure as the doc prints it: thousands separated, `digits` decimals under 1,000, none above."""
    if x is None:
        return "–"
    if isinstance(x, int) or abs(x) >= 1000:
        return f"{round(x):,}"
    return f"{x:.{digits}f}"


def ratio(x: float) -> str:
    return f"**{x:.2f}×**"


def pair(a: float | None, b: float | None, digits: int = 1) -> str:
    """`p50 / p99` style."""
    return f"{num(a, digits)} / {num(b, digits)}"


def yes(flag: bool) -> str:
    return "yes" if flag else "**no**"
