#!/usr/bin/env python3
"""Checks hp::pp::compute_rows against PyTorch's own schedules, action for
action, on the PyTorch this build uses (2.15's wheel).

Usage: schedule_oracle.py PP_SCHEDULE_ROWS
  PP_SCHEDULE_ROWS: tests/pp's driver, printing compute_rows() as CSV.

What each schedule is compared with:
- GPipe and 1F1B: the order their executors run, recorded by driving
  ScheduleGPipe / Schedule1F1B._step_microbatches over a stand-in stage
  whose forward_one_chunk / backward_one_chunk note what they are called
  with (no communication: its send/recv op lists are empty). Also their
  _get_pipeline_order() lists from _schedule_visualizer.get_schedule_ops:
  GPipe's equals the executor's; 1F1B's numbers the last rank's forwards
  1..m where the executor runs 0..m-1, so that rank's forwards are
  renumbered (when they read 1..m) before comparing, and the script says so.
- Interleaved 1F1B and interleaved zero bubble: get_schedule_ops (their
  executor runs exactly these lists) for 2 stages per rank; with 1 stage per
  rank (which get_schedule_ops refuses) the schedule classes' pipeline_order
  over one stand-in stage, as get_schedule_ops builds them. PyTorch's idle
  steps (None) are dropped: the rows hold the actions only.
And the specs PyTorch refuses, the driver must refuse too.
Exit status 1 at any difference, with the first differing action per case;
77 (skipped) where this Python's torch has no torch.distributed.pipelining
schedules to compare with (Debian's 1.13).
"""
import subprocess
import sys
import time
from unittest import mock

try:
    import torch
    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
    from torch.distributed.pipelining.stage import PipelineStage
except ImportError as e:
    print(f"skipped: {sys.executable} has no PyTorch pipelining schedules to compare with ({e})")
    sys.exit(77)

RANKS = (2, 3, 4, 8)
# Per p, a micro-batch count that is no multiple of p and that the looped
# schedules accept (a multiple of max(1, m // p) rounds).
NOT_A_MULTIPLE = {2: 3, 3: 4, 4: 10, 8: 12}
PYTORCH_CLASS = {
    "interleaved": schedules.ScheduleInterleaved1F1B,
    "zero-bubble": schedules.ScheduleInterleavedZeroBubble,
}
VISUALIZER_NAME = {
    "gpipe": "GPipe",
    "1f1b": "1F1B",
    "interleaved": "Interleaved1F1B",
    "zero-bubble": "InterleavedZeroBubble",
}


def stand_in_stage(p, stages, rank=0):
    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank = rank
    stage.group_size = p
    stage.num_stages = stages
    stage.stage_index = rank
    stage.submod = None
    stage.is_first = rank == 0
    stage.is_last = rank == stages - 1
    return stage


def executor_order(cls, p, m, rank):
    """The actions cls's executor runs on `rank`, in order."""
    stage = stand_in_stage(p, p, rank)
    for name in ("get_fwd_recv_ops", "get_fwd_send_ops", "get_bwd_recv_ops", "get_bwd_send_ops"):
        getattr(stage, name).return_value = []
    order = []
    stage.forward_one_chunk.side_effect = lambda i, *a, **k: order.append(f"{rank}F{i}")
    stage.backward_one_chunk.side_effect = lambda i, *a, **k: order.append(f"{rank}B{i}")
    schedule = cls(stage, m)
    schedule._initialize_stage = lambda *a, **k: None  # shape inference: needs a real stage
    schedule._step_microbatches(arg_mbs=[()] * m, kwarg_mbs=[{}] * m)
    return order


def actions(rows):
    return [[str(a) for a in row if a is not None] for row in rows]


def renumber_last_rank_forwards(rows, p, m):
    """1F1B's _get_pipeline_order() numbers the last rank's forwards 1..m."""
    last = rows[p - 1]
    forwards = [a for a in last if "F" in a]
    if forwards != [f"{p - 1}F{i}" for i in range(1, m + 1)]:
        return rows, False
    return rows[:-1] + [[f"{p - 1}F{int(a.split('F')[1]) - 1}" if "F" in a else a for a in last]], True


def pytorch_rows(kind, p, v, m):
    """[(what, rows)]: every PyTorch list the rows must equal."""
    if kind in ("gpipe", "1f1b"):
        cls = schedules.ScheduleGPipe if kind == "gpipe" else schedules.Schedule1F1B
        executor = [executor_order(cls, p, m, r) for r in range(p)]
        ir = actions(get_schedule_ops(VISUALIZER_NAME[kind], p, m))
        # _get_pipeline_order() ends each rank with REDUCE_GRAD and its wait.
        ir = [[a for a in row if "REDUCE_GRAD" not in a] for row in ir]
        what = "get_schedule_ops"
        if kind == "1f1b":
            ir, renumbered = renumber_last_rank_forwards(ir, p, m)
            if renumbered:
                what += " (last rank's forwards renumbered 1..m -> 0..m-1)"
        return [("executor", executor), (what, ir)]
    if v >= 2:
        return [("get_schedule_ops", actions(get_schedule_ops(VISUALIZER_NAME[kind], p, m, v)))]
    schedule = PYTORCH_CLASS[kind]([stand_in_stage(p, p)], m)
    return [("pipeline_order", actions(schedule.pipeline_order[r] for r in range(p)))]


def refuses(kind, p, v, m):
    """Whether PyTorch's schedule class refuses the spec."""
    try:
        if kind in ("gpipe", "1f1b"):
            cls = schedules.ScheduleGPipe if kind == "gpipe" else schedules.Schedule1F1B
            cls(stand_in_stage(p, p), m)
        else:
            PYTORCH_CLASS[kind]([stand_in_stage(p, p * v) for _ in range(v)], m)
    except ValueError:
        return True
    return False


def run_driver(driver, kind, p, v, m):
    return subprocess.run([driver, kind, str(p), str(v), str(m)], capture_output=True, text=True)


def first_difference(expected, got):
    if len(expected) != len(got):
        return f"{len(got)} rows, expected {len(expected)}"
    for rank, (want, have) in enumerate(zip(expected, got)):
        for i in range(max(len(want), len(have))):
            w = want[i] if i < len(want) else "(end)"
            h = have[i] if i < len(have) else "(end)"
            if w != h:
                return (f"rank {rank}, position {i}: {h}, expected {w}\n"
                        f"    expected: {','.join(want)}\n    got:      {','.join(have)}")
    return None


def main():
    driver = sys.argv[1]
    start = time.time()
    cases = []
    for p in RANKS:
        for m in sorted({p, 2 * p, NOT_A_MULTIPLE[p]}):
            cases += [("gpipe", p, 1, m), ("1f1b", p, 1, m)]
            for v in (1, 2):
                cases += [("interleaved", p, v, m), ("zero-bubble", p, v, m)]
    failures = 0
    compared = 0
    for kind, p, v, m in cases:
        result = run_driver(driver, kind, p, v, m)
        if result.returncode != 0:
            print(f"FAIL {kind} p={p} v={v} m={m}: the driver refused it: {result.stderr.strip()}")
            failures += 1
            continue
        got = [line.split(",") if line else [] for line in result.stdout.splitlines()]
        for what, expected in pytorch_rows(kind, p, v, m):
            compared += 1
            difference = first_difference(expected, got)
            if difference:
                print(f"FAIL {kind} p={p} v={v} m={m} against PyTorch's {what}: {difference}")
                failures += 1
            elif "renumbered" in what and p == 2 and m == 2:
                print(f"note: 1F1B compared with PyTorch's {what}")
    # Specs PyTorch refuses: the driver must refuse them too.
    refused = [("1f1b", 4, 1, 3), ("interleaved", 4, 2, 9), ("zero-bubble", 3, 2, 7), ("interleaved", 8, 2, 17)]
    for kind, p, v, m in refused:
        if not refuses(kind, p, v, m):
            print(f"FAIL {kind} p={p} v={v} m={m}: PyTorch {torch.__version__} accepts it; the case list is stale")
            failures += 1
        result = run_driver(driver, kind, p, v, m)
        if result.returncode != 2:
            print(f"FAIL {kind} p={p} v={v} m={m}: PyTorch refuses it, the driver gave status {result.returncode}")
            failures += 1
    print(f"{len(cases)} specs, {compared} comparisons with PyTorch {torch.__version__}, {len(refused)} refused specs: "
          f"{failures} failures ({time.time() - start:.1f} s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
