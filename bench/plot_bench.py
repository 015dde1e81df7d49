#!/usr/bin/env python3
"""Plots hp-bench's JSON: one bar chart per measure, one bar per row.

usage: plot_bench.py bench.json bench.png

Panels: median step time (with the 10th-90th percentile range), tokens/s,
peak memory per rank (torch_ddp's bar is its RSS delta, hatched: a different
method, see the JSON's peak_bytes_method; the black ticks are every row's RSS
delta, measured alike; the red circles the memory plan's prediction for our
rows) and collectives per step stacked by kind. The pipeline rows (pp4*, torch_pp4*,
dp2_pp2, torch_dp2_pp2) carry their measured bubble inside the step-time bar. Failed rows
are labelled "failed".
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

KINDS = [("all_gather", "#55a868"), ("reduce_scatter", "#c44e52"),
         ("all_reduce", "#8172b3"), ("other", "#8c8c8c")]
ROW_COLORS = {
    "single": "#8c8c8c", "ddp": "#4c72b0", "fsdp": "#dd8452", "fsdp_ac": "#b5651d", "fsdp_fused": "#e6a26c",
    "fsdp_fused_prefetch": "#c44e52", "hsdp_fused_prefetch": "#8172b3", "tp": "#55a868",
    "fsdp_tp": "#937860",
    "torch_single": "#222222", "torch_ddp": "#000000", "torch_fsdp2": "#444444",
    "pp4": "#64b5cd", "pp4_gpipe": "#4a90a4", "pp4_interleaved": "#2f6f80",
    "pp4_zero_bubble": "#1b4f5c", "torch_pp4": "#555555", "torch_pp4_gpipe": "#666666",
    "torch_pp4_interleaved": "#777777", "torch_pp4_zero_bubble": "#888888",
    "dp2_pp2": "#8fd0a8", "torch_dp2_pp2": "#999999",
}


def value(row, key):
    v = row.get(key)
    return v if isinstance(v, (int, float)) else None


def bars(ax, rows, key, scale=1.0, fmt="{:.3g}", title="", hatch_torch=False):
    names = [r["name"] for r in rows]
    xs = range(len(rows))
    for x, r in zip(xs, rows):
        v = value(r, key)
        if v is None:
            label = "failed" if "error" in r else "skipped" if "skipped" in r else "n/a"
            ax.text(x, 0, label, ha="center", va="bottom",
                    rotation=90, fontsize=8)
            continue
        hatch = "//" if hatch_torch and r["name"].startswith("torch_") else None
        ax.bar(x, v * scale, color=ROW_COLORS.get(r["name"], "#999999"), hatch=hatch,
               edgecolor="white" if hatch else None)
        ax.text(x, v * scale, fmt.format(v * scale), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(list(xs))
    ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    ax.set_title(title, fontsize=10)


def main(path, out):
    with open(path) as f:
        report = json.load(f)
    rows = report["rows"]
    cfg = report["config"]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))

    ax = axes[0][0]
    bars(ax, rows, "step_time_s_median", fmt="{:.3f}", title="median step time (s), max over ranks")
    for x, r in enumerate(rows):
        lo, hi, med = value(r, "step_time_s_p10"), value(r, "step_time_s_p90"), value(
            r, "step_time_s_median")
        if None not in (lo, hi, med):
            ax.errorbar(x, med, yerr=[[med - lo], [hi - med]], color="black", capsize=3, lw=1)
        bubble = (r.get("pipeline") or {}).get("measured_bubble")
        if med is not None and isinstance(bubble, (int, float)):
            ax.text(x, med / 2, "bubble {:.0%}".format(bubble), ha="center", va="center",
                    rotation=90, fontsize=7, color="white")
    ax.set_ylabel("s")

    ax = axes[0][1]
    bars(ax, rows, "tokens_per_s", fmt="{:.0f}", title="tokens / s (all ranks)")

    ax = axes[1][0]
    gpu = cfg.get("device") == "cuda"
    if gpu:
        # Every row's bar is the caching allocator's peak: nothing to hatch,
        # and host RSS says nothing about GPU memory.
        bars(ax, rows, "peak_bytes_per_rank", scale=1 / 2**20, fmt="{:.1f}",
             title="GPU peak allocated per rank (MiB), CUDA caching allocator")
    else:
        bars(ax, rows, "peak_bytes_per_rank", scale=1 / 2**20, fmt="{:.1f}",
             title="peak memory per rank (MiB); torch_ rows hatched = RSS delta", hatch_torch=True)
    rss = [] if gpu else [(x, value(r, "peak_rss_delta_bytes_per_rank"))
                          for x, r in enumerate(rows)]
    rss = [(x, v / 2**20) for x, v in rss if v is not None]
    if rss:
        ax.scatter([x for x, _ in rss], [v for _, v in rss], marker="_", s=400, color="black",
                   zorder=3, label="RSS delta (every row, same method)")
    plan = [(x, value(r, "predicted_peak_bytes_per_rank")) for x, r in enumerate(rows)]
    plan = [(x, v / 2**20) for x, v in plan if v is not None]
    if plan:
        ax.scatter([x for x, _ in plan], [v for _, v in plan], marker="o", s=30,
                   facecolors="none", edgecolors="#c44e52", zorder=4,
                   label="memory plan's prediction (ours)")
    if rss or plan:
        ax.legend(fontsize=7, loc="upper left")
    ax.set_ylabel("MiB")

    ax = axes[1][1]
    names = [r["name"] for r in rows]
    for x, r in enumerate(rows):
        c = r.get("collectives_per_step")
        if not isinstance(c, dict):
            label = "failed" if "error" in r else "skipped" if "skipped" in r else "n/a"
            ax.text(x, 0, label, ha="center", va="bottom",
                    rotation=90, fontsize=8)
            continue
        bottom = 0.0
        for kind, color in KINDS:
            v = c.get(kind) or 0
            if v:
                ax.bar(x, v, bottom=bottom, color=color)
            bottom += v
        ax.text(x, bottom, "{:.1f}".format(bottom), ha="center", va="bottom", fontsize=7)
    handles = [plt.Rectangle((0, 0), 1, 1, color=color) for _, color in KINDS]
    ax.legend(handles, [k for k, _ in KINDS], fontsize=7, loc="upper right")
    ax.set_xticks(list(range(len(rows))))
    ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    ax.set_title("collectives per step (rank 0)", fontsize=10)

    m = cfg["model"]
    mp = cfg.get("mixed_precision", {})
    where = ("on GPUs, fully_shard rows {} / {} reduce".format(mp.get("param_dtype"),
                                                               mp.get("reduce_dtype"))
             if gpu else "fp32, 1 thread/rank")
    pp = cfg.get("pipeline")
    pp_note = ""
    if pp and any("pipeline" in r for r in rows):
        pp_note = "\npipeline rows: {} layers, 4 ranks, {} micro-batches of one shared batch".format(
            pp["layers"], pp["microbatches"])
        if any(r["name"].endswith("dp2_pp2") for r in rows):
            pp_note += " (dp2_pp2: 2 replicas, half of it each in {} micro-batches)".format(
                pp["microbatches"] // 2)
    fig.suptitle(
        "hp-bench: GPT vocab {} seq {} d {} heads {} layers {}, batch {}/rank, AdamW, {}; "
        "{} x {} timed steps{}".format(
            m["vocab"], m["seq"], m["d"], m["heads"], m["layers"], cfg["batch_per_rank"], where,
            cfg["rounds"], cfg["timed_steps_per_process"], pp_note), fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.93 if pp_note else 0.96))
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: plot_bench.py bench.json bench.png")
    main(sys.argv[1], sys.argv[2])
