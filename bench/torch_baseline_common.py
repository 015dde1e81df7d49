"""The timing harness of hp-bench's PyTorch rows (torch_single, torch_ddp, torch_fsdp2).

Each baseline script keeps only how it wraps the model; this module holds the
rest, so every PyTorch row trains and is measured the same way:

- the model: the PyTorch GPT of tests/nn/gpt_reference.py (loaded from there,
  so parameter names and initialisation are those of hp::nn::GPT: the same
  seed gives the same weights), with AdamW and hp-bench's hyper-parameters;
- the data: hp-bench's token file with hp-train's batch rule, the per-rank
  batch of our rows, one intra-op thread;
- the timing: warm-up steps, then timed steps of zero_grad(set_to_none) +
  batch slice + forward + loss + backward + AdamW step (perf_counter, no
  barrier); after them the ranks gather their times (a step's time is the max
  over ranks), losses and memory (peak RSS growth since before the model was
  built), and rank 0 prints one line "HPBENCH_RESULT {json}";
- with --profile-ops DIR, torch.profiler (CPU ops, no shapes or stacks) over
  the timed steps, written per step as DIR/<row>.rank<r>.ops.json in the
  schema of our rows' files (bench/op_compare.h), so hp-bench compares them.

A baseline is run as run(Baseline(...)); unknown flags (hp-bench passes its
whole worker configuration) are ignored. Launched under hprun, which sets
RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT for the distributed rows.
"""
import argparse
import array
import importlib.util
import json
import os
import resource
import statistics
import sys
import time

try:
    import torch
    import torch.distributed as dist
except ImportError as e:
    sys.stderr.write(f"{os.path.basename(sys.argv[0])}: cannot import {e.name} ({e}); "
                     "run it with the project environment's Python, .venv/bin/python "
                     "(scripts/install-deps.sh)\n")
    sys.exit(3)

MARKER = "HPBENCH_RESULT "
# bench/op_compare.h's kProfiledStepsNote.
PROFILED_STEPS_NOTE = ("step times of a run with --profile-ops include the profiler's cost: "
                       "they are not the benchmark's")


class Baseline:
    """How one PyTorch row wraps the model; the harness does everything else.

    distributed: whether the row runs in a Gloo process group (all of hprun's
    ranks); a single-process row never creates one."""

    row = None
    distributed = True
    mixed_precision = False  # whether wrap() honours --param-dtype / --reduce-dtype

    def wrap(self, model, world):
        """The module the steps call; its parameters are the optimizer's. The
        model is already on `self.device` (set by run: cpu, or this rank's GPU),
        and `self.args` holds the parsed flags (param_dtype, reduce_dtype)."""
        return model

    def after_warmup(self):
        """Called once between the warm-up and the timed steps."""

    def result_fields(self, wrapped, steps):
        """Extra fields of the result (every rank computes them, rank 0's are
        printed): at least "collectives", counts per step by kind and "method"."""
        raise NotImplementedError


def load_reference():
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(here, "..", "tests", "nn", "gpt_reference.py")
    spec = importlib.util.spec_from_file_location("gpt_reference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def current_rss_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def peak_rss_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def read_tokens(path):
    """The token file: little-endian uint16 ids, as int64 (no numpy needed:
    a pip PyTorch does not bring it)."""
    ids = array.array("H")
    with open(path, "rb") as f:
        ids.frombytes(f.read())
    if sys.byteorder == "big":
        ids.byteswap()
    return torch.tensor(ids, dtype=torch.int64)


def batch_for_step(tokens, step, global_batch, seq, rank, world):
    """tools/hp_train/batches.h: global sample i of step s is the window of seq+1
    tokens starting at ((s*B + i) * T) mod (len - T - 1); rank r of D takes
    samples [r*B/D, (r+1)*B/D)."""
    m = tokens.numel() - seq - 1
    local = global_batch // world
    starts = [((step * global_batch + rank * local + j) * seq) % m for j in range(local)]
    windows = torch.stack([tokens[s:s + seq + 1] for s in starts])
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def parse_args(description, add_arguments=None):
    """hp-bench's worker flags (unknown ones ignored); add_arguments(parser), when
    given, adds a row's own."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--tokens", required=True)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--ctx", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="per rank")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--beta1", type=float, default=0.9)
    p.add_argument("--beta2", type=float, default=0.95)
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--worker-steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--profile-ops", default="", help="directory of the per-op profiles")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--param-dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--reduce-dtype", default="", choices=("", "fp32", "bf16"))
    if add_arguments is not None:
        add_arguments(p)
    args, _unknown = p.parse_known_args()
    return args


def timed_steps(step, warmup, steps, after_warmup, profiler=None, device=None):
    """Runs warmup + steps steps, the timed ones under `profiler` if any; returns
    (first loss, timed seconds, timed losses, seconds of the whole timed loop, the
    process's kernel seconds over the timed loop, the median step's minor page faults and the
    host's seconds to issue the timed steps: from a step's start to the return of `step`, before
    anything waits for the GPU). On a GPU (`device` cuda) a step's time is its GPU time, between
    two CUDA events on the current stream, as our rows time it."""
    first_loss = float("nan")
    for s in range(warmup):
        loss = step(s)
        if s == 0:
            first_loss = loss.item()
    after_warmup()
    times, losses = [], []
    if profiler is not None:
        profiler.start()
    usage_start = resource.getrusage(resource.RUSAGE_SELF)
    host_s = 0.0
    t_start = time.perf_counter()
    step_faults = []
    for i in range(steps):
        faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt  # outside the timing
        t0 = time.perf_counter()
        if device is not None and device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            loss = step(warmup + i)
            host_s += time.perf_counter() - t0
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop) * 1e-3)
        else:
            loss = step(warmup + i)
            times.append(time.perf_counter() - t0)
            host_s += times[-1]
        step_faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before)
        losses.append(loss.item())
        if warmup == 0 and i == 0:
            first_loss = losses[-1]
    timed_s = time.perf_counter() - t_start
    usage_end = resource.getrusage(resource.RUSAGE_SELF)
    if profiler is not None:
        profiler.stop()
    kernel_s = usage_end.ru_stime - usage_start.ru_stime
    return first_loss, times, losses, timed_s, kernel_s, statistics.median(step_faults), host_s


def op_profiler(directory):
    """torch.profiler over the CPU ops (no shapes, stacks or memory); None without a directory."""
    if not directory:
        return None
    return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                  record_shapes=False, with_stack=False, profile_memory=False)


def merge_per_step(a, b):
    """bench/op_compare.h's merge_per_step: two per-step profiles as one of their summed
    steps (steps-weighted means; an op missing on one side is 0 there; None stays None)."""
    na, nb = a["steps"], b["steps"]

    def mean(x, y, key):
        vx = 0.0 if x is None else x.get(key)
        vy = 0.0 if y is None else y.get(key)
        return None if vx is None or vy is None else (vx * na + vy * nb) / (na + nb)

    by_a = {o["name"]: o for o in a["ops"]}
    by_b = {o["name"]: o for o in b["ops"]}
    out = dict(b)
    out["steps"] = na + nb
    out["wall_us"] = mean(a, b, "wall_us")
    out["allocations"] = mean(a, b, "allocations")
    keys = ("count", "self_cpu_time", "cpu_time_total", "self_allocations")
    out["ops"] = [{"name": name, **{k: mean(by_a.get(name), by_b.get(name), k) for k in keys}}
                  for name in sorted(by_a.keys() | by_b.keys())]
    out["ops"].sort(key=lambda o: -o["self_cpu_time"])
    return out


def write_ops_file(directory, row, rank, steps, profiler, wall_s):
    """DIR/<row>.rank<r>.ops.json, per step, in the schema of hp::OpProfileResult::to_json()
    plus bench/op_compare.h's fields: key_averages()'s count, self_cpu_time_total and
    cpu_time_total (us) divided by the timed steps. Allocations are not counted here. A file
    already there (an earlier round of the run) is merged in, as our workers do."""
    ops = [{"name": e.key, "count": e.count / steps,
            "self_cpu_time": e.self_cpu_time_total / steps,
            "cpu_time_total": e.cpu_time_total / steps, "self_allocations": None}
           for e in profiler.key_averages()]
    ops.sort(key=lambda o: (-o["self_cpu_time"], o["name"]))
    out = {"time_unit": "us", "wall_us": wall_s * 1e6 / steps, "allocations": None, "ops": ops,
           "row": row, "rank": rank, "steps": steps, "source": "torch " + torch.__version__,
           "per": "step", "note": PROFILED_STEPS_NOTE}
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{row}.rank{rank}.ops.json")
    if os.path.exists(path):
        with open(path) as f:
            out = merge_per_step(json.load(f), out)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


def gather_rows(mine, world, distributed):
    """Every rank's vector, stacked (world x len)."""
    if not distributed:
        return mine.unsqueeze(0)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    return torch.stack(gathered)


def run(baseline, description):
    """Trains, times and reports one PyTorch row, then exits the process."""
    args = parse_args(description)
    torch.set_num_threads(1)
    ref = load_reference()
    tokens = read_tokens(args.tokens)
    assert int(tokens.max()) < args.vocab, "token file holds ids beyond --vocab"

    rank, world = 0, 1
    device = torch.device("cpu")
    if args.device == "cuda":
        # One GPU per local rank; ranks sharing one on purpose (HP_SHARE_GPUS=1)
        # need an NCCL host id each, as our library sets (docs/gpu.md).
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        count = torch.cuda.device_count()
        assert count > 0, "--device cuda: torch sees no GPU"
        if local_world > count:
            assert os.environ.get("HP_SHARE_GPUS") == "1", (
                f"{local_world} local ranks for {count} GPU(s): set HP_SHARE_GPUS=1 to share")
            os.environ.setdefault("NCCL_HOSTID", f"{os.uname().nodename}:hp-local-rank-{local_rank}")
            if int(os.environ.get("WORLD_SIZE", "1")) == local_world:
                os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        device = torch.device("cuda", local_rank % count)
        torch.cuda.set_device(device)
    baseline.device = device
    baseline.args = args
    if baseline.distributed:
        if device.type == "cuda":
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()

    rss_before_model = current_rss_bytes()
    cfg = {"vocab_size": args.vocab, "context": args.ctx, "n_layer": args.layers,
           "n_head": args.heads, "n_embd": args.d}
    torch.manual_seed(args.seed)
    model = ref.GPT(cfg).to(device)
    wrapped = baseline.wrap(model, world)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=args.lr, betas=(args.beta1, args.beta2),
                            eps=args.eps, weight_decay=args.weight_decay)
    global_batch = args.batch * world

    def step(s):
        opt.zero_grad(set_to_none=True)
        x, y = batch_for_step(tokens, s, global_batch, args.seq, rank, world)
        x, y = x.to(device), y.to(device)
        loss = ref.loss_of(wrapped(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    profiler = op_profiler(args.profile_ops)

    def after_warmup():
        baseline.after_warmup()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    first_loss, times, losses, profiled_s, kernel_s, faults, host_s = timed_steps(
        step, args.warmup, args.worker_steps, after_warmup, profiler, device)
    cuda_peaks = [0.0, 0.0]
    if device.type == "cuda":
        cuda_peaks = [float(torch.cuda.max_memory_allocated(device)),
                      float(torch.cuda.max_memory_reserved(device))]
    extra = baseline.result_fields(wrapped, args.worker_steps)
    rss_delta = peak_rss_bytes() - rss_before_model
    if profiler is not None:  # after the measurements: reading the events allocates
        write_ops_file(args.profile_ops, baseline.row, rank, args.worker_steps, profiler,
                       profiled_s)
    n = args.worker_steps
    mine = torch.tensor(times + losses + [float(rss_delta), first_loss, kernel_s / n, faults,
                                          host_s / n] + cuda_peaks,
                        dtype=torch.float64, device=device)
    allr = gather_rows(mine, world, baseline.distributed).cpu()
    if rank == 0:
        out = {
            "row": baseline.row,
            "ranks": world,
            "torch_version": torch.__version__,
            "threads": torch.get_num_threads(),
            "parameters": sum(p.numel() for p in model.parameters()),
            "steps": n,
            "warmup": args.warmup,
            "step_times_s": allr[:, :n].max(dim=0).values.tolist(),
            "losses": allr[:, n:2 * n].mean(dim=0).tolist(),
            "first_loss": float(allr[:, 2 * n + 1].mean()),
            "peak_rss_delta_bytes_per_rank": [int(v) for v in allr[:, 2 * n].tolist()],
            "kernel_s_per_step_per_rank": allr[:, 2 * n + 2].tolist(),
            "page_faults_per_step_per_rank": allr[:, 2 * n + 3].tolist(),
            "host_s_per_step_per_rank": allr[:, 2 * n + 4].tolist(),
            "units": args.layers + 1,
            "device": device.type,
        }
        if device.type == "cuda":
            out["param_dtype"] = args.param_dtype if baseline.mixed_precision else "fp32"
            out["cuda_peak_allocated_bytes_per_rank"] = [int(v) for v in allr[:, 2 * n + 5].tolist()]
            out["cuda_peak_reserved_bytes_per_rank"] = [int(v) for v in allr[:, 2 * n + 6].tolist()]
        out.update(extra)
        print(MARKER + json.dumps(out), flush=True)
    if baseline.distributed:
        dist.barrier()
    # Leave without tearing the process group down: in one of several full
    # hp-bench runs a rank of a baseline span in the kernel after printing
    # its result until hprun's timeout (destroy_process_group / interpreter
    # teardown of ProcessGroupGloo and the TCPStore). Nothing is left to do.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
