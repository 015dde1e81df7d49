// The CUDA caching allocator's own counters for one device, as
// torch.cuda.max_memory_allocated / max_memory_reserved report them.
//
// allocated: bytes in blocks handed to tensors (rounded to the allocator's
// 512-byte granularity); reserved: bytes the allocator holds from the driver
// (segments, whether in use or cached). The CUDA context and NCCL's own
// buffers are in neither. Read through libtorch's device-generic allocator
// interface, so this file needs no CUDA headers; on a libtorch without it
// (1.13) or without CUDA, cuda_memory_stats() raises an ArgumentError naming
// what is missing.
//
// Threads: the counters are the allocator's, safe to read from any thread.
#pragma once

#include <cstdint>

namespace hp {

struct CudaMemoryStats {
  int64_t allocated_bytes = 0;
  int64_t peak_allocated_bytes = 0;  // since the process began or the last reset
  int64_t reserved_bytes = 0;
  int64_t peak_reserved_bytes = 0;
};

// The counters of CUDA device `device_index`.
CudaMemoryStats cuda_memory_stats(int device_index);

// Sets both peaks to the current values, so that the next peak covers one
// phase (a step).
void reset_cuda_peak_memory(int device_index);

}  // namespace hp
