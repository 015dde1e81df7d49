#!/usr/bin/env python3
"""hp-bench's torch_pp4* and torch_dp2_pp2 rows: PyTorch's torch.distributed.pipelining, CPU, Gloo.

Launched by hp-bench as

  hprun -n 4 PYTHON bench/torch_pipeline_baseline.py --tokens FILE ... \\
      --row torch_pp4 --pp-schedule 1f1b --pp-stages-per-rank 1 [--pp-data-parallel 2]

the PyTorch twin of our pipeline rows (bench/pipeline_worker.cpp), the same
in everything but the executor:

- the model: the GPT of tests/nn/gpt_reference.py with --pp-layers blocks,
  built whole on every rank from the same random seed (--seed: the weights
  hp::nn::GPT draws from it), then
  cut into ranks x stages-per-rank stages as our rows cut it (--pp-split:
  even, the same number of blocks per stage, or hp::pp::plan_stages's
  balanced boundaries; plan_stages() below; stage s on rank s mod ranks) and
  the other stages dropped;
- the data: the one shared batch of --batch samples per step (hp-train's
  batch rule, as our pipeline rows read it), cut into --pp-microbatches;
- the schedule: PipelineStage for each of the rank's stages with
  ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B or
  ScheduleInterleavedZeroBubble, the loss the mean cross-entropy of a
  micro-batch (scale_grads: gradients of the mean over micro-batches), then
  AdamW over the rank's stages;
- the timing: as torch_baseline_common.py's rows (warm-up, then timed steps,
  a step's time the max over ranks), one intra-op thread;
- the measured bubble: per rank and step, 1 - (wall time inside the stages'
  forward_one_chunk, backward_one_chunk and backward_weight_one_chunk and the
  schedule's loss, which the schedule calls after waiting for their received
  inputs) / (wall time of schedule.step()); the driver averages it over the
  steps, then the ranks, as ours (bench/pipeline_bubble.h);
- peak memory: the process's peak RSS over the timed steps' run (VmHWM, reset
  through /proc/self/clear_refs once the other stages are dropped, so the
  whole model's build does not count) minus VmRSS before the model was
  built; ru_maxrss where the reset is refused.

With --pp-data-parallel D > 1 (torch_dp2_pp2) the ranks form a (dp, pp) =
(D, ranks / D) device mesh, row-major as ours (rank = replica * P + pipeline
rank), composed as torchtitan composes them: pipeline outer, each stage
module fully_shard'ed (FSDP2) over the dp dim, every block then the stage,
reshard_after_forward=False (the pipeline runs several forwards of a unit
before its backward), the PipelineStage over the pp dim's group. Replica r
trains on its 1/D of the batch (batch_for_step's rank r of D) in
--pp-microbatches / D micro-batches, the micro-batches of the pp rows' size;
the losses reported are the replicas' mean.

A PyTorch without torch.distributed.pipelining or one of these schedules
(Debian's 1.13) makes rank 0 print a result that says the row was skipped
and why; every rank exits with status 0.
"""
import gc
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_baseline_common as common  # noqa: E402  (exits with a message without torch)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
             "interleaved": "ScheduleInterleaved1F1B",
             "zero-bubble": "ScheduleInterleavedZeroBubble"}
LOOPED = ("interleaved", "zero-bubble")
BUBBLE_METHOD = (
    "per rank and step, 1 - (wall time inside PipelineStage.forward_one_chunk, "
    "backward_one_chunk, backward_weight_one_chunk and the schedule's _maybe_compute_loss, "
    "which the schedule calls after waiting for their received tensors) / (wall time of "
    "schedule.step()); mean over steps, then ranks")


def add_arguments(p):
    p.add_argument("--row", default="torch_pp4")
    p.add_argument("--pp-schedule", default="1f1b", choices=sorted(SCHEDULES))
    p.add_argument("--pp-stages-per-rank", type=int, default=1)
    p.add_argument("--pp-layers", type=int, default=8)
    p.add_argument("--pp-microbatches", type=int, default=8)
    p.add_argument("--pp-data-parallel", type=int, default=1)
    p.add_argument("--pp-split", default="even", choices=("even", "balanced"))


def plan_stages(blocks, num_stages, split="balanced"):
    """Each stage's first block index: hp-bench's even cut (split="even"), or
    hp::pp::plan_stages's balanced split. Balanced: every stage starts with one block, the prologue and the epilogue count as
    one block each on the first and last stage, and each further block goes
    to the least-loaded stage, the earliest on a tie."""
    assert 1 <= num_stages <= blocks, (num_stages, blocks)
    if split == "even":
        # hp-bench's even cut: earlier stages one block more where it does
        # not divide (bench/pipeline_worker.cpp, split_points).
        return [s * (blocks // num_stages) + min(s, blocks % num_stages)
                for s in range(num_stages)]
    count = [1] * num_stages
    load = [1] * num_stages
    load[0] += 1
    load[-1] += 1
    for _ in range(blocks - num_stages):
        s = min(range(num_stages), key=lambda i: (load[i], i))
        count[s] += 1
        load[s] += 1
    begins, first = [], 0
    for c in count:
        begins.append(first)
        first += c
    return begins


class Stage(nn.Module):
    """Stage `index` of the whole reference GPT: its modules, shared, under the
    whole model's names (wte, wpe, h.<i>, ln_f, lm_head)."""

    def __init__(self, model, index, num_stages, blocks):
        super().__init__()
        self.first, self.last = index == 0, index == num_stages - 1
        if self.first:
            self.wte, self.wpe = model.wte, model.wpe
        self.h = nn.ModuleDict({str(i): model.h[i] for i in blocks})
        if self.last:
            self.ln_f, self.lm_head = model.ln_f, model.lm_head

    def forward(self, x):
        if self.first:
            t = x.size(1)
            x = self.wte(x) + self.wpe(torch.arange(t, dtype=torch.long, device=x.device))
        for block in self.h.values():
            x = block(x)
        if self.last:
            x = self.lm_head(self.ln_f(x))
        return x


def reset_peak_rss():
    """Resets VmHWM to the current RSS; False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_since_reset():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return common.peak_rss_bytes()


class ComputeClock:
    """Wall time inside the wrapped calls (the outermost only, should one call
    another), summed until read."""

    def __init__(self):
        self.seconds = 0.0
        self.depth = 0

    def wrap(self, obj, name):
        fn = getattr(obj, name)

        def timed(*args, **kwargs):
            self.depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1
                if self.depth == 0:
                    self.seconds += time.perf_counter() - t0
        setattr(obj, name, timed)

    def take(self):
        s, self.seconds = self.seconds, 0.0
        return s


def import_pipelining():
    """torch.distributed.pipelining if it has every schedule of SCHEDULES, else None."""
    try:
        from torch.distributed import pipelining
        from torch.distributed.pipelining import schedules
    except ImportError:
        return None
    if not all(hasattr(schedules, name) for name in SCHEDULES.values()):
        return None
    return pipelining


def import_fully_shard():
    """FSDP2's fully_shard and init_device_mesh (torch_fsdp2_baseline.py's
    version rule), or None where this PyTorch lacks them."""
    import torch_fsdp2_baseline as fsdp2
    if fsdp2.torch_version() < fsdp2.MIN_VERSION:
        return None
    try:
        from torch.distributed.device_mesh import init_device_mesh
        return fsdp2.import_fully_shard(), init_device_mesh
    except ImportError:
        return None


def skip(row, reason):
    """Rank 0 reports the row as skipped; every rank exits with status 0."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(common.MARKER + json.dumps({"row": row, "torch_version": torch.__version__,
                                          "skipped": reason}), flush=True)
    sys.exit(0)


def main():
    args = common.parse_args(__doc__.splitlines()[0], add_arguments)
    assert args.device == "cpu", "the pipeline rows run on the CPU (Gloo)"
    pipelining = import_pipelining()
    if pipelining is None:
        skip(args.row, f"PyTorch {torch.__version__} lacks torch.distributed.pipelining's "
                       + ", ".join(sorted(SCHEDULES.values())))
    dp = args.pp_data_parallel
    fsdp = import_fully_shard() if dp > 1 else None
    if dp > 1 and fsdp is None:
        skip(args.row, f"PyTorch {torch.__version__} lacks FSDP2 (fully_shard on a CPU device "
                       "mesh) to shard the stages over the dp dim")

    torch.set_num_threads(1)
    ref = common.load_reference()
    tokens = common.read_tokens(args.tokens)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert dp >= 1 and world % dp == 0 and args.pp_microbatches % dp == 0, (world, dp)
    pp_ranks = world // dp
    replica, pp_rank = rank // pp_ranks, rank % pp_ranks  # row-major (dp, pp), as ours
    v, m = args.pp_stages_per_rank, args.pp_microbatches // dp
    assert (v == 1) == (args.pp_schedule not in LOOPED), (args.pp_schedule, v)
    num_stages = pp_ranks * v
    assert args.batch % args.pp_microbatches == 0, (args.batch, args.pp_microbatches)
    pp_group, counter = None, None
    if dp > 1:
        fully_shard, init_device_mesh = fsdp
        mesh = init_device_mesh("cpu", (dp, pp_ranks), mesh_dim_names=("dp", "pp"))
        pp_group = mesh["pp"].get_group()

    rss_before_model = common.current_rss_bytes()
    cfg = {"vocab_size": args.vocab, "context": args.ctx, "n_layer": args.pp_layers,
           "n_head": args.heads, "n_embd": args.d}
    torch.manual_seed(args.seed)
    model = ref.GPT(cfg)
    parameters = sum(p.numel() for p in model.parameters())
    begins = plan_stages(args.pp_layers, num_stages, args.pp_split) + [args.pp_layers]
    mine = list(range(pp_rank, num_stages, pp_ranks))
    modules = [Stage(model, s, num_stages, range(begins[s], begins[s + 1])) for s in mine]
    del model
    gc.collect()
    hwm_reset = reset_peak_rss()
    if dp > 1:
        # torchtitan's order: every block a unit, then the stage as the root,
        # all keeping their parameters gathered from forward to backward.
        for mod in modules:
            for block in mod.h.values():
                fully_shard(block, mesh=mesh["dp"], reshard_after_forward=False)
            fully_shard(mod, mesh=mesh["dp"], reshard_after_forward=False)
        import torch_fsdp2_baseline as fsdp2
        counter = fsdp2.CollectiveCounter()

    device = torch.device("cpu")
    stages = [pipelining.PipelineStage(mod, s, num_stages, device, group=pp_group)
              for mod, s in zip(modules, mine)]
    loss_fn = ref.loss_of
    schedule_class = getattr(pipelining.schedules, SCHEDULES[args.pp_schedule])
    if args.pp_schedule in LOOPED:
        schedule = schedule_class(stages, n_microbatches=m, loss_fn=loss_fn)
    else:
        schedule = schedule_class(stages[0], n_microbatches=m, loss_fn=loss_fn)
    clock = ComputeClock()
    for stage in stages:
        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            clock.wrap(stage, name)
    clock.wrap(schedule, "_maybe_compute_loss")
    params = [p for mod in modules for p in mod.parameters()]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(args.beta1, args.beta2), eps=args.eps,
                            weight_decay=args.weight_decay)
    has_first, has_last = 0 in mine, num_stages - 1 in mine
    compute_s, pipeline_s = [], []

    def step(s):
        opt.zero_grad(set_to_none=True)
        # Every rank reads the one batch; the first stage takes its ids, the last its targets.
        # With dp > 1 replica r takes its 1/dp of the batch.
        x, y = common.batch_for_step(tokens, s, args.batch, args.seq, replica, dp)
        losses = []
        clock.take()
        t0 = time.perf_counter()
        schedule.step(*((x,) if has_first else ()), target=y if has_last else None,
                      losses=losses)
        pipeline_s.append(time.perf_counter() - t0)
        compute_s.append(clock.take())
        opt.step()
        return torch.stack(losses).mean().detach() if has_last else torch.zeros(())

    first_loss, times, losses, _timed_s, kernel_s, faults, host_s = common.timed_steps(
        step, args.warmup, args.worker_steps, counter.reset if counter else lambda: None)
    n = args.worker_steps
    rss_delta = (peak_rss_since_reset() if hwm_reset else common.peak_rss_bytes()) - \
        rss_before_model
    row = (times + losses + compute_s[-n:] + pipeline_s[-n:] +
           [float(rss_delta), first_loss if has_last else 0.0, kernel_s / n, faults, host_s / n])
    allr = common.gather_rows(torch.tensor(row, dtype=torch.float64), world, True)
    # Each replica's loss lives on its last stage's rank: their mean is the batch's.
    last_ranks = [r * pp_ranks + (num_stages - 1) % pp_ranks for r in range(dp)]
    if rank == 0:
        if counter is None:
            collectives = {"all_gather_per_step": 0, "reduce_scatter_per_step": 0,
                           "all_reduce_per_step": 0,
                           "method": "none: the schedule moves activations and gradients "
                                     "point to point (isend / irecv), not counted"}
        else:
            per_step = {k: c / n for k, c in counter.counts.items()}
            collectives = {"all_gather_per_step": per_step["all_gather"],
                           "reduce_scatter_per_step": per_step["reduce_scatter"],
                           "all_reduce_per_step": per_step["all_reduce"],
                           "method": "FSDP2's calls to torch.distributed's all-gather, "
                                     "reduce-scatter and all_reduce during the timed steps, "
                                     "rank 0; the pipeline's point-to-point not counted"}
        out = {
            "row": args.row,
            "ranks": world,
            "torch_version": torch.__version__,
            "threads": torch.get_num_threads(),
            "parameters": parameters,
            "steps": n,
            "warmup": args.warmup,
            "step_times_s": allr[:, :n].max(dim=0).values.tolist(),
            "losses": allr[last_ranks, n:2 * n].mean(dim=0).tolist(),
            "first_loss": float(allr[last_ranks, 4 * n + 1].mean()),
            "peak_rss_delta_bytes_per_rank": [int(x) for x in allr[:, 4 * n].tolist()],
            "kernel_s_per_step_per_rank": allr[:, 4 * n + 2].tolist(),
            "page_faults_per_step_per_rank": allr[:, 4 * n + 3].tolist(),
            "host_s_per_step_per_rank": allr[:, 4 * n + 4].tolist(),
            "units": args.pp_layers + 1,
            "device": "cpu",
            "collectives": collectives,
            "pipeline": {
                "schedule": args.pp_schedule,
                "torch_schedule": SCHEDULES[args.pp_schedule],
                "stages_per_rank": v,
                "microbatches": m,
                "data_parallel": dp,
                "layers": args.pp_layers,
                "split": args.pp_split,
                "stage_begins": begins[:-1],
                "compute_s_per_rank_per_step": allr[:, 2 * n:3 * n].tolist(),
                "step_s_per_rank_per_step": allr[:, 3 * n:4 * n].tolist(),
                "bubble_method": BUBBLE_METHOD,
                "peak_method": "VmHWM after a reset once the other stages were dropped"
                               if hwm_reset else "ru_maxrss (VmHWM reset refused)",
            },
        }
        print(common.MARKER + json.dumps(out), flush=True)
    dist.barrier()
    # As torch_baseline_common.run: leave without tearing the process group down.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
