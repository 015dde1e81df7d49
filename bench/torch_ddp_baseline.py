#!/usr/bin/env python3
"""The torch_ddp row of hp-bench: PyTorch's DistributedDataParallel on CPU over Gloo.

Launched by hp-bench as

  hprun -n 2 PYTHON bench/torch_ddp_baseline.py --tokens FILE --vocab 512 ...

with PYTHON the build's (.venv/bin/python: the PyTorch whose libtorch our
rows run on, so both sides use the same kernels). Model, data and timing are
torch_baseline_common.py's (beside this file), shared with torch_single and
torch_fsdp2; this file only wraps the model in DDP with its defaults and
reports DDP's buckets.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_baseline_common as common  # noqa: E402  (exits with a message without torch)

from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402


class DdpBaseline(common.Baseline):
    row = "torch_ddp"

    def wrap(self, model, world):
        # Defaults: bucket_cap_mb 25, first bucket 1 MiB, no gradient views.
        if self.device.type == "cuda":
            return DDP(model, device_ids=[self.device.index])
        return DDP(model)

    def result_fields(self, wrapped, steps):
        logging = wrapped._get_ddp_logging_data()
        bucket_sizes = logging.get("rebuilt_bucket_sizes") or logging.get("bucket_sizes", "")
        buckets = len([b for b in str(bucket_sizes).split(",") if b.strip()])
        return {
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


if __name__ == "__main__":
    common.run(DdpBaseline(), __doc__.splitlines()[0])
