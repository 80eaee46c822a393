"""Plots of a bench/compare.py run: throughput by streams, goodput by offered rate.

    python bench/plot_compare.py [bench/results/compare.json] [--out docs/img/compare]
"""

from __future__ import annotations

import argparse
import json

SYSTEMS = ("disaggregated", "colocated", "transformers")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="?", default="bench/results/compare.json")
    parser.add_argument("--out", default="docs/img/compare")
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = json.load(open(args.results))
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for key in SYSTEMS:
        system = results[key]
        streams = sorted(system["throughput"], key=int)
        left.plot([int(n) for n in streams], [system["throughput"][n]["output_tokens_per_second"] for n in streams], marker="o", label=system["name"])
        by_rate = system.get("goodput", {}).get("by_rate", {})
        rates = sorted(by_rate, key=float)
        right.plot([float(r) for r in rates], [100 * by_rate[r]["goodput"]["share"] for r in rates], marker="o", label=system["name"])
    left.set(xlabel="concurrent streams", ylabel="output tokens/s", title="decode throughput")
    target = results["disaggregated"]["goodput"]
    right.set(
        xlabel="offered rate (requests/s)", ylabel="% of requests good",
        title=f"goodput (TTFT <= {target['ttft_target']:g} s, ITL <= {target['itl_target'] * 1e3:g} ms)",
    )
    right.axhline(90, color="grey", linestyle=":")
    for ax in (left, right):
        ax.legend()
    fig.tight_layout()
    fig.savefig(f"{args.out}.png", dpi=100)
    print(f"{args.out}.png")


if __name__ == "__main__":
    main()
