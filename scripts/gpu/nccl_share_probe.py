"""Whether NCCL accepts several ranks on one GPU: run under
`python3 -m torch.distributed.run --nproc-per-node N nccl_share_probe.py`.

Every rank takes GPU 0 and runs an all_reduce, an all_gather_into_tensor and a
reduce_scatter_tensor on NCCL, checking each result against the arithmetic
done here. With HP_PROBE_HOSTID=1 each rank first sets NCCL_HOSTID to a value
of its own (before NCCL's first init), so that NCCL sees each rank as its own
host. Prints one line, "ok" or the error, and exits 0 only if all three
collectives gave the expected values.
"""
import os
import sys

import torch
import torch.distributed as dist


def main() -> int:
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    if os.environ.get("HP_PROBE_HOSTID") == "1":
        os.environ["NCCL_HOSTID"] = f"hp-probe-rank-{rank}"
    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    try:
        dist.init_process_group("nccl", device_id=device)
        x = torch.full((4,), float(rank + 1), device=device)
        dist.all_reduce(x)
        expect_sum = world * (world + 1) / 2
        out = torch.empty(3 * world, device=device)
        dist.all_gather_into_tensor(out, torch.full((3,), float(rank), device=device))
        part = torch.empty(2, device=device)
        dist.reduce_scatter_tensor(part, torch.arange(2 * world, device=device, dtype=torch.float))
        torch.cuda.synchronize()
        ok = (torch.all(x == expect_sum).item()
              and torch.equal(out.cpu(), torch.arange(world).float().repeat_interleave(3))
              and torch.equal(part.cpu(), torch.arange(2 * rank, 2 * rank + 2).float() * world))
        print(f"rank {rank}: {'ok' if ok else 'WRONG VALUES'}", flush=True)
        dist.destroy_process_group()
        return 0 if ok else 1
    except Exception as e:  # the probe reports NCCL's refusal, it does not hide it
        print(f"rank {rank}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
              flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
