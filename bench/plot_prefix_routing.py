"""Plot bench_prefix_routing.py's JSON results into a PNG for docs/.

    .venv/bin/pip install matplotlib   # only this script needs it
    .venv/bin/python bench/plot_prefix_routing.py docs/bench/prefix_routing.json docs/bench/prefix_routing.png
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src: str, dst: str) -> None:
    res = json.load(open(src))
    names = [n for n in res if n != "saturation"]
    fig, axes = plt.subplots(1, 3 if "saturation" in res else 2, figsize=(14, 4.2))
    ax = axes[0]
    ax.bar(names, [100 * res[n]["hit_rate"] for n in names], color=["#999", "#69c", "#2a7"][: len(names)])
    ax.set_ylabel("engine prefix-cache hit rate (%)")
    ax.set_ylim(0, 100)
    ax.set_title("cache hits (engines' own counters)")
    ax = axes[1]
    x = range(len(names))
    for k, (p, color) in enumerate((("ttft_p50", "#7bd"), ("ttft_p90", "#37a"), ("ttft_p99", "#135"))):
        ax.bar([i + (k - 1) * 0.27 for i in x], [1e3 * res[n][p] for n in names], width=0.27, color=color,
               label=p.replace("ttft_", ""))
    ax.set_xticks(list(x), names)
    ax.set_ylabel("time to first token (ms)")
    ax.set_title("TTFT")
    ax.legend()
    if "saturation" in res:
        ax = axes[2]
        rates = sorted(res["saturation"], key=float)
        for n in names:
            ax.plot([float(r) for r in rates], [100 * res["saturation"][r][n] for r in rates], marker="o", label=n)
        ax.set_xlabel("offered load (requests/s)")
        ax.set_ylabel("goodput: requests within the SLO (%)")
        ax.set_title("ramp to saturation")
        ax.legend()
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
