#!/usr/bin/env python3
"""The torch_fsdp2 row of hp-bench: PyTorch's own FSDP2 on CPU over Gloo.

Launched by hp-bench as

  hprun -n 2 PYTHON bench/torch_fsdp2_baseline.py --tokens FILE --vocab 512 ...

Everything but the wrapper is torch_ddp_baseline.py's (imported from beside
this file): the GPT of tests/nn/gpt_reference.py with the same seed, the same
token file and batch rule, per-rank batch, AdamW hyper-parameters, one
intra-op thread, and the same timing. The model is wrapped as FSDP2 is meant
to be used: fully_shard on each block, then on the root, over a 1-D CPU
device mesh of all ranks (defaults: reshard after forward, no mixed
precision). Collectives are counted by wrapping torch.distributed's
all_gather_into_tensor and reduce_scatter_tensor, which FSDP2 calls.

FSDP2 (torch.distributed.fsdp.fully_shard, CPU meshes included) needs
PyTorch >= 2.4; on an older torch (Debian's 1.13) rank 0 prints a result
that says the row was skipped and why, and every rank exits with status 0.
"""
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import torch_ddp_baseline as base  # noqa: E402  (exits with a message without torch)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

MARKER = base.MARKER
MIN_VERSION = (2, 4)


def torch_version():
    parts = torch.__version__.split("+")[0].split(".")
    return tuple(int(p) for p in parts[:2] if p.isdigit())


def import_fully_shard():
    """FSDP2's entry point: public from 2.6, under _composable in 2.4 and 2.5."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard
    return fully_shard


class CollectiveCounter:
    """Counts FSDP2's all-gathers and reduce-scatters. FSDP2 calls them
    through the torch.distributed module (all_gather_into_tensor and
    reduce_scatter_tensor up to 2.14, all_gather_single and
    reduce_scatter_single from 2.15, each straight on the process group), so
    wrapping the module's functions that exist sees every call once."""

    KINDS = (("all_gather_into_tensor", "all_gather"), ("all_gather_single", "all_gather"),
             ("reduce_scatter_tensor", "reduce_scatter"),
             ("reduce_scatter_single", "reduce_scatter"), ("all_reduce", "all_reduce"))

    def __init__(self):
        self.counts = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
        for attr, kind in self.KINDS:
            if hasattr(dist, attr):
                setattr(dist, attr, self._wrap(getattr(dist, attr), kind))

    def _wrap(self, fn, kind):
        def counted(*args, **kwargs):
            self.counts[kind] += 1
            return fn(*args, **kwargs)
        return counted

    def reset(self):
        for k in self.counts:
            self.counts[k] = 0


def skip(reason):
    """Rank 0 reports the row as skipped; no process group is needed."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(MARKER + json.dumps({"row": "torch_fsdp2", "skipped": reason,
                                   "torch_version": torch.__version__}), flush=True)
    sys.exit(0)


def main():
    args = base.parse_args()
    if torch_version() < MIN_VERSION:
        skip(f"PyTorch {torch.__version__} has no FSDP2: torch.distributed.fsdp.fully_shard "
             f"on CPU needs PyTorch >= {MIN_VERSION[0]}.{MIN_VERSION[1]}")
    fully_shard = import_fully_shard()
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    ref = base.load_reference()
    tokens = base.read_tokens(args.tokens)
    assert int(tokens.max()) < args.vocab, "token file holds ids beyond --vocab"

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))

    rss_before_model = base.current_rss_bytes()
    cfg = {"vocab_size": args.vocab, "context": args.ctx, "n_layer": args.layers,
           "n_head": args.heads, "n_embd": args.d}
    torch.manual_seed(args.seed)
    model = ref.GPT(cfg)
    for block in model.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    units = len(model.h) + 1
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(args.beta1, args.beta2),
                            eps=args.eps, weight_decay=args.weight_decay)
    global_batch = args.batch * world
    counter = CollectiveCounter()

    def step(s):
        opt.zero_grad(set_to_none=True)
        x, y = base.batch_for_step(tokens, s, global_batch, args.seq, rank, world)
        loss = ref.loss_of(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    first_loss = float("nan")
    for s in range(args.warmup):
        loss = step(s)
        if s == 0:
            first_loss = loss.item()

    counter.reset()
    times, losses = [], []
    for i in range(args.worker_steps):
        t0 = time.perf_counter()
        loss = step(args.warmup + i)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if args.warmup == 0 and i == 0:
            first_loss = losses[-1]
    per_step = {k: v / max(1, args.worker_steps) for k, v in counter.counts.items()}
    rss_delta = base.peak_rss_bytes() - rss_before_model

    mine = torch.tensor(times + losses + [float(rss_delta), first_loss], dtype=torch.float64)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)

    if rank == 0:
        n = args.worker_steps
        allr = torch.stack(gathered)
        out = {
            "row": "torch_fsdp2",
            "ranks": world,
            "torch_version": torch.__version__,
            "threads": torch.get_num_threads(),
            "parameters": sum(p.numel() for p in model.parameters()),
            "units": units,
            "steps": n,
            "warmup": args.warmup,
            "step_times_s": allr[:, :n].max(dim=0).values.tolist(),
            "losses": allr[:, n:2 * n].mean(dim=0).tolist(),
            "first_loss": float(allr[:, 2 * n + 1].mean()),
            "peak_rss_delta_bytes_per_rank": [int(v) for v in allr[:, 2 * n].tolist()],
            "collectives": {
                "all_gather_per_step": per_step["all_gather"],
                "reduce_scatter_per_step": per_step["reduce_scatter"],
                "all_reduce_per_step": per_step["all_reduce"],
                "method": "calls to torch.distributed's all-gather (all_gather_into_tensor, "
                          "all_gather_single), reduce-scatter (reduce_scatter_tensor, "
                          "reduce_scatter_single) and all_reduce during the timed steps, rank 0",
            },
        }
        print(MARKER + json.dumps(out), flush=True)
    dist.barrier()
    # As torch_ddp_baseline.py: leave without tearing the process group down.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
