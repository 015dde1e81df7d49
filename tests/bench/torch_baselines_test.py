#!/usr/bin/env python3
"""hp-bench's PyTorch rows through their shared harness (bench/torch_baseline_common.py):
each baseline prints one result line with the keys the driver reads,
torch_single's first loss is the reference GPT's loss on the single row's
first batch, the pipeline baseline's first loss on 4 ranks (1F1B and
interleaved zero bubble, and torch_dp2_pp2's FSDP2 x 1F1B on a (dp, pp) =
(2, 2) mesh, its replicas' mean) is the reference GPT's on the shared batch
within the rounding of its micro-batch means, its stage split is hp::pp's, and
--profile-ops writes the per-step op profile of our rows'
schema (bench/op_compare.h), rounds merged weighted by their steps.

Usage: torch_baselines_test.py HPRUN   (run by the build's Python, HP_PYTHON)
A tiny model and two timed steps keep it to a few seconds per row.
"""
import array
import json
import math
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.join(HERE, "..", "..", "bench")
sys.path.insert(0, BENCH)
import torch_baseline_common as common  # noqa: E402

import torch  # noqa: E402

FLAGS = {"--vocab": 64, "--seq": 8, "--d": 16, "--heads": 2, "--layers": 1, "--ctx": 8,
         "--batch": 2, "--worker-steps": 2, "--warmup": 1, "--seed": 7}
KEYS = {"row", "ranks", "torch_version", "threads", "parameters", "steps", "warmup",
        "step_times_s", "losses", "first_loss", "peak_rss_delta_bytes_per_rank", "collectives",
        "kernel_s_per_step_per_rank", "page_faults_per_step_per_rank", "host_s_per_step_per_rank",
        "units", "device"}


def result_of(argv):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, f"{argv} exited {out.returncode}:\n{out.stdout}{out.stderr}"
    lines = [l for l in out.stdout.splitlines() if common.MARKER in l]
    assert len(lines) == 1, f"expected one result line, got:\n{out.stdout}"
    return json.loads(lines[0].split(common.MARKER, 1)[1])


def check_result(r, row, ranks, steps=FLAGS["--worker-steps"], units=FLAGS["--layers"] + 1):
    if "skipped" in r:  # torch_fsdp2 or a pipeline row on a PyTorch without them
        assert row in ("torch_fsdp2", "torch_dp2_pp2") or row.startswith("torch_pp4"), r
        return
    missing = KEYS - set(r)
    assert not missing, f"{row}: missing {missing}"
    assert r["row"] == row and r["ranks"] == ranks, r
    assert len(r["step_times_s"]) == steps, r
    assert len(r["peak_rss_delta_bytes_per_rank"]) == ranks, r
    for key in ("kernel_s_per_step_per_rank", "page_faults_per_step_per_rank"):
        assert len(r[key]) == ranks and all(v >= 0 for v in r[key]), (key, r)
    assert all(math.isfinite(v) for v in r["losses"] + [r["first_loss"]]), r
    # On the CPU the host's issue time is the whole step, measured around
    # the same call.
    assert r["device"] == "cpu" and r["units"] == units, r
    assert len(r["host_s_per_step_per_rank"]) == ranks, r
    assert all(0 < v for v in r["host_s_per_step_per_rank"]), r
    assert "method" in r["collectives"], r


def check_op_profile(directory):
    path = os.path.join(directory, "torch_single.rank0.ops.json")
    with open(path) as f:
        p = json.load(f)
    assert p["row"] == "torch_single" and p["rank"] == 0, p
    assert p["steps"] == FLAGS["--worker-steps"] and p["time_unit"] == "us", p
    assert p["note"] == common.PROFILED_STEPS_NOTE, p
    names = {o["name"]: o for o in p["ops"]}
    # Every linear of the reference GPT runs an addmm or a matmul each step.
    assert "aten::addmm" in names or "aten::mm" in names, sorted(names)
    for o in p["ops"]:
        assert set(o) == {"name", "count", "self_cpu_time", "cpu_time_total",
                          "self_allocations"}, o
        assert o["self_cpu_time"] <= o["cpu_time_total"] + 1e-9, o
    selfs = [o["self_cpu_time"] for o in p["ops"]]
    assert selfs == sorted(selfs, reverse=True), "ops not sorted by self time"
    a = {"steps": 2, "wall_us": 100, "allocations": None,
         "ops": [{"name": "aten::mm", "count": 1, "self_cpu_time": 10, "cpu_time_total": 10,
                  "self_allocations": None}]}
    b = {"steps": 1, "wall_us": 400, "allocations": None,
         "ops": [{"name": "aten::mm", "count": 4, "self_cpu_time": 40, "cpu_time_total": 40,
                  "self_allocations": None},
                 {"name": "aten::add", "count": 3, "self_cpu_time": 30, "cpu_time_total": 30,
                  "self_allocations": None}]}
    m = common.merge_per_step(a, b)
    assert m["steps"] == 3 and m["wall_us"] == 200, m  # (2 * 100 + 400) / 3
    assert m["ops"][0] == {"name": "aten::mm", "count": 2, "self_cpu_time": 20,
                           "cpu_time_total": 20, "self_allocations": None}, m
    assert m["ops"][1]["count"] == 1 and m["ops"][1]["self_cpu_time"] == 10, m


def reference_first_loss(tokens_path):
    """The single row's first step: rank 0 of 1 takes the first --batch samples."""
    torch.set_num_threads(1)
    ref = common.load_reference()
    tokens = common.read_tokens(tokens_path)
    torch.manual_seed(FLAGS["--seed"])
    model = ref.GPT({"vocab_size": FLAGS["--vocab"], "context": FLAGS["--ctx"],
                     "n_layer": FLAGS["--layers"], "n_head": FLAGS["--heads"],
                     "n_embd": FLAGS["--d"]})
    x, y = common.batch_for_step(tokens, 0, FLAGS["--batch"], FLAGS["--seq"], 0, 1)
    with torch.no_grad():
        return ref.loss_of(model(x), y).item()


PP_FLAGS = {"--pp-layers": 8, "--pp-microbatches": 4, "--batch": 4, "--worker-steps": 1,
            "--warmup": 0}


def reference_pipeline_loss(tokens_path):
    """The whole reference GPT of --pp-layers blocks on the pipeline's one shared batch."""
    torch.set_num_threads(1)
    ref = common.load_reference()
    tokens = common.read_tokens(tokens_path)
    torch.manual_seed(FLAGS["--seed"])
    model = ref.GPT({"vocab_size": FLAGS["--vocab"], "context": FLAGS["--ctx"],
                     "n_layer": PP_FLAGS["--pp-layers"], "n_head": FLAGS["--heads"],
                     "n_embd": FLAGS["--d"]})
    x, y = common.batch_for_step(tokens, 0, PP_FLAGS["--batch"], FLAGS["--seq"], 0, 1)
    with torch.no_grad():
        return ref.loss_of(model(x), y).item()


def check_pipeline(hprun, flags, tokens_path):
    import torch_pipeline_baseline as pipeline
    # hp::pp::plan_stages's balanced split (tests/pp/stage_test.cpp: 8 blocks
    # over 4 stages give 2, 3, 2, 1).
    assert pipeline.plan_stages(8, 4) == [0, 2, 5, 7], pipeline.plan_stages(8, 4)
    assert pipeline.plan_stages(8, 8) == list(range(8))
    # hp-bench's default even cut (bench/pipeline_worker.cpp, split_points).
    assert pipeline.plan_stages(8, 4, "even") == [0, 2, 4, 6]
    assert pipeline.plan_stages(10, 4, "even") == [0, 3, 6, 8]
    reference = reference_pipeline_loss(tokens_path)
    pp_flags = flags + [str(v) for kv in PP_FLAGS.items() for v in kv]
    # (row, schedule, stages per rank, data-parallel ranks): dp 2 makes a
    # (dp, pp) = (2, 2) mesh, each replica on half of the batch in half of
    # the micro-batches.
    for row, schedule, v, dp in (("torch_pp4", "1f1b", 1, 1),
                                 ("torch_pp4_zero_bubble", "zero-bubble", 2, 1),
                                 ("torch_dp2_pp2", "1f1b", 1, 2)):
        r = result_of([hprun, "-n", "4", "--timeout", "120", sys.executable, script_of("pipeline"),
                       *pp_flags, "--row", row, "--pp-schedule", schedule,
                       "--pp-stages-per-rank", str(v), "--pp-data-parallel", str(dp)])
        check_result(r, row, 4, steps=1, units=PP_FLAGS["--pp-layers"] + 1)
        if "skipped" in r:
            assert pipeline.import_pipelining() is None or (
                dp > 1 and pipeline.import_fully_shard() is None), r
            continue
        p = r["pipeline"]
        assert p["schedule"] == schedule and p["stages_per_rank"] == v, p
        assert p["data_parallel"] == dp, p
        assert p["microbatches"] == PP_FLAGS["--pp-microbatches"] // dp, p
        assert p["split"] == "even", p
        assert p["stage_begins"] == pipeline.plan_stages(8, 4 // dp * v, "even"), p
        if dp > 1:
            # FSDP2 reduces each unit of rank 0's stage (its 4 blocks and the
            # stage) once per step under the pipeline, and gathers each at
            # least once (this step, with no warm-up before it, also runs the
            # set-up's gathers).
            c = r["collectives"]
            assert c["reduce_scatter_per_step"] == 5 <= c["all_gather_per_step"], c
        for compute, step in zip(p["compute_s_per_rank_per_step"], p["step_s_per_rank_per_step"]):
            assert len(compute) == len(step) == 1, p
            assert 0 < compute[0] <= step[0], p
        # The mean of the micro-batch means against one mean over the batch:
        # the same terms summed in another order, in float32, each of the
        # B*T token losses' rounding at most a unit in the last place of the loss.
        tokens = PP_FLAGS["--batch"] * FLAGS["--seq"]
        bound = tokens * torch.finfo(torch.float32).eps * abs(reference)
        assert abs(r["first_loss"] - reference) <= bound, (schedule, r["first_loss"], reference)


def script_of(name):
    return os.path.join(BENCH, f"torch_{name}_baseline.py")


def main():
    hprun = sys.argv[1]
    with tempfile.TemporaryDirectory() as tmp:
        tokens_path = os.path.join(tmp, "tokens.u16")
        ids = torch.randint(0, FLAGS["--vocab"], (4096,),
                            generator=torch.Generator().manual_seed(1))
        with open(tokens_path, "wb") as f:
            f.write(array.array("H", ids.tolist()).tobytes())  # little-endian on x86
        flags = [str(v) for kv in FLAGS.items() for v in kv] + ["--tokens", tokens_path,
                                                                 "--unknown-flag", "1"]
        single = result_of([sys.executable, script_of("single"), *flags])
        check_result(single, "torch_single", 1)
        assert single["collectives"]["all_reduce_per_step"] == 0, single
        # The same model, data and kernels on one thread: the same loss, exactly.
        assert single["first_loss"] == reference_first_loss(tokens_path), \
            (single["first_loss"], reference_first_loss(tokens_path))
        profile_dir = os.path.join(tmp, "ops")
        check_result(result_of([sys.executable, script_of("single"), *flags,
                                "--profile-ops", profile_dir]), "torch_single", 1)
        check_op_profile(profile_dir)
        ddp = result_of([hprun, "-n", "2", "--timeout", "120", sys.executable, script_of("ddp"),
                         *flags])
        check_result(ddp, "torch_ddp", 2)
        assert "ddp" in ddp, ddp
        fsdp2 = result_of([hprun, "-n", "2", "--timeout", "120", sys.executable,
                           script_of("fsdp2"), *flags])
        check_result(fsdp2, "torch_fsdp2", 2)
        assert "skipped" in fsdp2 or fsdp2["units"] == FLAGS["--layers"] + 1, fsdp2
        check_pipeline(hprun, flags, tokens_path)
    print("torch baselines: OK")


if __name__ == "__main__":
    main()
