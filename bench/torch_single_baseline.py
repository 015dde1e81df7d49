#!/usr/bin/env python3
"""The torch_single row of hp-bench: PyTorch in one process, no process group, no wrapper.

Launched by hp-bench as

  hprun -n 1 PYTHON bench/torch_single_baseline.py --tokens FILE --vocab 512 ...

It is the PyTorch peer of our `single` row: the same model, data (one rank's
batch), steps and AdamW, through torch_baseline_common.py's harness (beside
this file), which torch_ddp and torch_fsdp2 share. It makes no collectives.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_baseline_common as common  # noqa: E402  (exits with a message without torch)


class SingleBaseline(common.Baseline):
    row = "torch_single"
    distributed = False

    def result_fields(self, wrapped, steps):
        return {"collectives": {"all_gather_per_step": 0, "reduce_scatter_per_step": 0,
                                "all_reduce_per_step": 0,
                                "method": "none: one process, no process group"}}


if __name__ == "__main__":
    common.run(SingleBaseline(), __doc__.splitlines()[0])
