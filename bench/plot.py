"""The benchmark's plot: throughput, p50 and p99 latency of every scenario, and the throughput
relative to the backend direct, at 1 connection and at saturation.

Runs in the benchmark's own virtualenv (matplotlib is not a dependency of the project):

    build/bench-peer-venv/bin/python bench/plot.py bench/results/…/results.json docs/benchmarks.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

DRY_RUN_BELOW = 5.0
COLOURS = {1: "#4C72B0", 32: "#DD8452"}


def main(source: Path, image: Path) -> None:
    data: dict[str, Any] = json.loads(source.read_text())
    results = [r for r in data["results"] if not r["variant"]]
    order: list[str] = []
    titles: dict[str, str] = {}
    for r in results:
        if r["scenario"] not in order:
            order.append(r["scenario"])
            titles[r["scenario"]] = r["title"]
    order.reverse()  # the first scenario at the top
    conns = sorted({r["connections"] for r in results})
    by = {(r["scenario"], r["connections"]): r for r in results}
    direct = {c: by[("direct", c)]["rps"] for c in conns if ("direct", c) in by}

    panels: list[tuple[str, Any, bool]] = [
        ("Throughput (req/s; pgbench: tx/s)", lambda r: r["rps"], False),
        ("p50 latency (ms, log)", lambda r: r["latency_ms"]["p50"], True),
        ("p99 latency (ms, log)", lambda r: r["latency_ms"]["p99"], True),
        (
            "Throughput relative to the backend direct",
            lambda r: r["rps"] / direct.get(r["connections"], r["rps"]),
            False,
        ),
    ]
    height = 0.8 / max(len(conns), 1)
    fig, axes = plt.subplots(2, 2, figsize=(15, 4 + 0.45 * len(order)), sharey=True)
    for ax, (title, value, log) in zip(axes.flat, panels, strict=True):
        for index, c in enumerate(conns):
            ys = [i + (index - (len(conns) - 1) / 2) * height for i in range(len(order))]
            xs = [value(by[(s, c)]) if (s, c) in by else 0.0 for s in order]
            bars = ax.barh(ys, xs, height=height, color=COLOURS.get(c), label=f"{c} conn.")
            labels = [f"{x:,.2f}" if x < 10 else f"{x:,.0f}" for x in xs]
            ax.bar_label(bars, labels=labels, padding=2, fontsize=7)
        ax.set_title(title, fontsize=10)
        if log:
            ax.set_xscale("log")
        ax.margins(x=0.18)
        ax.grid(axis="x", alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_yticks(range(len(order)))
        ax.set_yticklabels([titles[s] for s in order], fontsize=8)
    axes[0][0].legend(loc="lower right", fontsize=8)
    duration = float(data["args"]["duration"])
    dry = " — DRY RUN, not a record" if duration < DRY_RUN_BELOW else ""
    fig.suptitle(
        f"idemproxy benchmark, {data['when']}, {duration:g} s per run{dry}\n"
        f"{data['facts']['CPU']}; one run on a shared box: compare ratios, not absolute values",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(image, dpi=110)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
