#!/usr/bin/env python3
"""Draws one training step of hp-train's --trace output as lanes.

usage: plot_timeline.py trace.rank0.json [trace.rank1.json ...] out.png [--step N]

Per rank: the compute lane (each unit's forward and backward, gathers it
waited for), one lane per collective kind (issue to completion) and the
time the rank spent blocked waiting for communication. The step shown is
--step N, by default the last one recorded.
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {
    "forward": "#4c72b0",
    "backward": "#dd8452",
    "unshard": "#8c8c8c",
    "all_gather": "#55a868",
    "all_gather_coalesced": "#55a868",
    "reduce_scatter": "#c44e52",
    "all_reduce": "#8172b3",
    "wait": "#000000",
}


def load(path):
    with open(path) as f:
        document = json.load(f)
    trace = document["traceEvents"]
    origin = document.get("otherData", {}).get("origin_unix_us")
    events = [e for e in trace if e.get("ph") == "X"]
    names = {}
    for e in trace:
        if e.get("ph") == "M" and e["name"] == "thread_name":
            names[e["tid"]] = e["args"]["name"]
    for e in events:
        e["lane"] = names.get(e["tid"], str(e["tid"]))
    return events, origin


def main(argv):
    step = None
    if "--step" in argv:
        i = argv.index("--step")
        step = int(argv[i + 1])
        argv = argv[:i] + argv[i + 2:]
    *inputs, out = argv
    loaded = [load(p) for p in inputs]
    ranks = [events for events, _ in loaded]
    # hp-train's ranks share one time origin (otherData.origin_unix_us);
    # traces without it, or from different runs, count from each process's
    # own start and would be drawn out of step.
    origins = {origin for _, origin in loaded}
    if len(inputs) > 1 and (None in origins or len(origins) > 1):
        print("plot_timeline.py: warning: the traces do not share one time origin "
              "(otherData.origin_unix_us); ranks may be drawn misaligned", file=sys.stderr)
    steps = [e for e in ranks[0] if e["cat"] == "step"]
    chosen = steps[-1] if step is None else next(e for e in steps if e["name"] == f"step {step}")
    t0, t1 = chosen["ts"], chosen["ts"] + chosen["dur"]
    lanes = ["compute", "all_gather", "reduce_scatter", "all_reduce", "wait"]
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.45 * len(lanes) * len(ranks)))
    yticks, ylabels = [], []
    for r, events in enumerate(ranks):
        for li, lane in enumerate(lanes):
            y = (len(ranks) - 1 - r) * (len(lanes) + 1) + (len(lanes) - li)
            yticks.append(y)
            ylabels.append(f"rank {r} {lane}")
            # Longest first, so a unit's span (the root's covers its blocks)
            # is drawn under the ones nested in it; nested units alternate shade.
            lane_events = []
            for e in events:
                kind = e["lane"]
                if kind.startswith("all_gather"):
                    kind = "all_gather"
                if kind == lane and e["ts"] + e["dur"] >= t0 and e["ts"] <= t1:
                    lane_events.append(e)
            lane_events.sort(key=lambda e: -e["dur"])
            for i, e in enumerate(lane_events):
                key = e["name"].split(" ")[0] if lane == "compute" else lane
                nested = lane == "compute" and i > 0 and key != "unshard"
                ax.broken_barh([((e["ts"] - t0) / 1000.0, max(e["dur"], 1) / 1000.0)],
                               (y - 0.4, 0.8), facecolors=COLORS.get(key, "#999999"),
                               edgecolor="white" if nested else None, linewidth=0.6,
                               alpha=0.55 if (lane == "compute" and i == 0) else 1.0)
    ax.set_yticks(yticks)
    ax.set_yticklabels(ylabels, fontsize=8)
    ax.set_xlabel("ms since the step began")
    ax.set_title(f"hp-train {chosen['name']} ({chosen['dur'] / 1000.0:.1f} ms): "
                 "forward (blue), backward (orange), gathers waited for (grey), "
                 "all-gather / reduce-scatter / all-reduce, blocked waits (black)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1:])
