#!/usr/bin/env python3
"""The torch_fsdp2 row of hp-bench: PyTorch's own FSDP2 on CPU over Gloo.

Launched by hp-bench as

  hprun -n 2 PYTHON bench/torch_fsdp2_baseline.py --tokens FILE --vocab 512 ...

Everything but the wrapper is torch_baseline_common.py's (beside this file),
shared with torch_single and torch_ddp: the GPT of tests/nn/gpt_reference.py
with the same seed, the same token file and batch rule, per-rank batch, AdamW
hyper-parameters, one intra-op thread, and the same timing. The model is wrapped as FSDP2 is meant
to be used: fully_shard on each block, then on the root, over a 1-D CPU
device mesh of all ranks (no mixed precision; every block but the last
reshards after forward, the last keeps its parameters for the backward that
follows at once, as torchtitan applies FSDP2 and as our rows run). Collectives are counted by wrapping torch.distributed's
all_gather_into_tensor and reduce_scatter_tensor, which FSDP2 calls.

FSDP2 (torch.distributed.fsdp.fully_shard, CPU meshes included) needs
PyTorch >= 2.4; on an older torch (Debian's 1.13) rank 0 prints a result
that says the row was skipped and why, and every rank exits with status 0.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_baseline_common as common  # noqa: E402  (exits with a message without torch)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

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
        print(common.MARKER + json.dumps({"row": "torch_fsdp2", "skipped": reason,
                                          "torch_version": torch.__version__}), flush=True)
    sys.exit(0)


class Fsdp2Baseline(common.Baseline):
    row = "torch_fsdp2"
    mixed_precision = True

    def wrap(self, model, world):
        fully_shard = import_fully_shard()
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(self.device.type, (world,))
        # Mixed precision as our rows apply it (tools/hp_train/parallelize.cpp):
        # every unit computes and gathers in the param dtype and reduces in
        # the reduce dtype; only the root returns fp32 logits.
        block_kwargs, root_kwargs = {}, {}
        dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
        if self.args.param_dtype != "fp32" or self.args.reduce_dtype:
            from torch.distributed.fsdp import MixedPrecisionPolicy
            param = dtypes[self.args.param_dtype]
            reduce = dtypes[self.args.reduce_dtype or self.args.param_dtype]
            block_kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce)
            root_kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce,
                                                            output_dtype=torch.float32)
        for i, block in enumerate(model.h):
            fully_shard(block, mesh=mesh, reshard_after_forward=i + 1 < len(model.h),
                        **block_kwargs)
        fully_shard(model, mesh=mesh, **root_kwargs)
        self.units = len(model.h) + 1
        self.counter = CollectiveCounter()
        return model

    def after_warmup(self):
        self.counter.reset()

    def result_fields(self, wrapped, steps):
        per_step = {k: v / max(1, steps) for k, v in self.counter.counts.items()}
        return {
            "units": self.units,
            "collectives": {
                "all_gather_per_step": per_step["all_gather"],
                "reduce_scatter_per_step": per_step["reduce_scatter"],
                "all_reduce_per_step": per_step["all_reduce"],
                "method": "calls to torch.distributed's all-gather (all_gather_into_tensor, "
                          "all_gather_single), reduce-scatter (reduce_scatter_tensor, "
                          "reduce_scatter_single) and all_reduce during the timed steps, rank 0",
            },
        }


if __name__ == "__main__":
    if torch_version() < MIN_VERSION:
        skip(f"PyTorch {torch.__version__} has no FSDP2: torch.distributed.fsdp.fully_shard "
             f"on CPU needs PyTorch >= {MIN_VERSION[0]}.{MIN_VERSION[1]}")
    common.run(Fsdp2Baseline(), __doc__.splitlines()[0])
