#!/usr/bin/env python3
"""The torch_ddp row of hp-bench: PyTorch's DistributedDataParallel on CPU over Gloo.

Launched by hp-bench as

  hprun -n 2 PYTHON bench/torch_ddp_baseline.py --tokens FILE --vocab 512 ...

with PYTHON the build's (.venv/bin/python: the PyTorch whose libtorch our
rows run on, so both sides use the same kernels; hprun sets RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT). The model is the
PyTorch GPT of tests/nn/gpt_reference.py (imported from there, so parameter
names and initialisation are those of hp::nn::GPT: the same seed gives the same
weights), trained on the same token file with hp-train's batch rule, the same
per-rank batch and AdamW hyper-parameters as our rows, one intra-op thread.
FSDP2 is the other baseline (torch_fsdp2_baseline.py, which reuses this
file's model, data and timing).

Per step (no barrier): zero_grad(set_to_none) + batch slice + forward + loss +
backward + AdamW step, timed with perf_counter. After the timed steps the
ranks gather their times (the step's time is the max over ranks), losses and
memory; rank 0 prints one line "HPBENCH_RESULT {json}".

Unknown flags (hp-bench passes its whole worker configuration) are ignored.
"""
import argparse
import array
import importlib.util
import json
import os
import resource
import sys
import time

try:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
except ImportError as e:
    sys.stderr.write(f"torch_ddp_baseline.py: cannot import {e.name} ({e}); "
                     "run it with the project environment's Python, .venv/bin/python "
                     "(scripts/install-deps.sh)\n")
    sys.exit(3)

MARKER = "HPBENCH_RESULT "


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


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    args, _unknown = p.parse_known_args()
    return args


def main():
    args = parse_args()
    torch.set_num_threads(1)
    ref = load_reference()
    tokens = read_tokens(args.tokens)
    assert int(tokens.max()) < args.vocab, "token file holds ids beyond --vocab"

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    rss_before_model = current_rss_bytes()
    cfg = {"vocab_size": args.vocab, "context": args.ctx, "n_layer": args.layers,
           "n_head": args.heads, "n_embd": args.d}
    torch.manual_seed(args.seed)
    model = ref.GPT(cfg)
    ddp = DDP(model)  # defaults: bucket_cap_mb 25, first bucket 1 MiB, no gradient views
    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr, betas=(args.beta1, args.beta2),
                            eps=args.eps, weight_decay=args.weight_decay)
    global_batch = args.batch * world

    def step(s):
        opt.zero_grad(set_to_none=True)
        x, y = batch_for_step(tokens, s, global_batch, args.seq, rank, world)
        loss = ref.loss_of(ddp(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    first_loss = float("nan")
    for s in range(args.warmup):
        loss = step(s)
        if s == 0:
            first_loss = loss.item()

    times, losses = [], []
    for i in range(args.worker_steps):
        t0 = time.perf_counter()
        loss = step(args.warmup + i)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if args.warmup == 0 and i == 0:
            first_loss = losses[-1]
    rss_delta = peak_rss_bytes() - rss_before_model
    logging = ddp._get_ddp_logging_data()

    mine = torch.tensor(times + losses + [float(rss_delta), first_loss], dtype=torch.float64)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)

    if rank == 0:
        n = args.worker_steps
        allr = torch.stack(gathered)
        bucket_sizes = logging.get("rebuilt_bucket_sizes") or logging.get("bucket_sizes", "")
        buckets = len([b for b in str(bucket_sizes).split(",") if b.strip()])
        out = {
            "row": "torch_ddp",
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
            "collectives": {
                "all_reduce_per_step": buckets,
                "method": "DDP's bucket count after its bucket rebuild "
                          "(_get_ddp_logging_data()['rebuilt_bucket_sizes']): one allreduce per "
                          "bucket per backward; the parameter broadcast at construction is "
                          "outside the timed steps",
            },
            "ddp": {
                "bucket_sizes_bytes": bucket_sizes,
                "bucket_cap_bytes": logging.get("bucket_cap_bytes"),
                "gloo_num_threads": logging.get("gloo_num_threads"),
                "gradient_as_bucket_view": logging.get("gradient_as_bucket_view"),
                "avg_backward_comm_time_ns": logging.get("avg_backward_comm_time"),
                "avg_backward_compute_comm_overlap_time_ns":
                    logging.get("avg_backward_compute_comm_overlap_time"),
                "avg_backward_compute_time_ns": logging.get("avg_backward_compute_time"),
                "note": "DDP's own sampled timings (rank 0), for reference; not comparable "
                        "with our exposed_comm_fraction",
            },
        }
        print(MARKER + json.dumps(out), flush=True)
    dist.barrier()
    # Leave without tearing the process group down: in one of several full
    # hp-bench runs a rank of this script span in the kernel after printing
    # its result until hprun's timeout (destroy_process_group / interpreter
    # teardown of ProcessGroupGloo and the TCPStore). Nothing is left to do.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
