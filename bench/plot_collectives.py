#!/usr/bin/env python3
"""Plots bench_collectives' JSON: bus bandwidth per op and size.

usage: plot_collectives.py collectives.json collectives.png
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src, dst):
    data = json.load(open(src))
    fig, (bw, ratio) = plt.subplots(1, 2, figsize=(11, 4))
    for op in ("all_gather", "reduce_scatter", "raw_c10d_allgather"):
        rows = [r for r in data["rows"] if r["op"] == op]
        bw.plot([r["bytes"] for r in rows], [r["busbw_GBps"] for r in rows], marker="o", label=op)
    bw.set_xscale("log", base=2)
    bw.set_xlabel("buffer bytes")
    bw.set_ylabel("bus bandwidth (GB/s)")
    bw.set_title(f"{data['config']['ranks']} ranks, {data['config']['backend']}")
    bw.legend()
    sizes = [r["bytes"] for r in data["ratios"]]
    ratio.plot(sizes, [r["reduce_scatter_over_all_gather"] for r in data["ratios"]], marker="o",
               label="reduce_scatter / all_gather (target <= 1.3)")
    ratio.plot(sizes, [r["all_gather_over_raw_c10d"] for r in data["ratios"]], marker="o",
               label="all_gather / raw c10d (target <= 1.05)")
    ratio.axhline(1.0, color="grey", lw=0.5)
    ratio.set_xscale("log", base=2)
    ratio.set_xlabel("buffer bytes")
    ratio.set_ylabel("time ratio")
    ratio.legend()
    fig.tight_layout()
    fig.savefig(dst, dpi=100)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
