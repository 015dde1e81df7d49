// A directory format for exchanging named tensors with a Python process,
// used by the PyTorch parity test (tests/nn/gpt_reference.py reads and
// writes the same format with numpy.fromfile / ndarray.tofile only).
//
//   <dir>/<stem>.json      {"tensors": [{"name", "dtype", "shape", "file"}, ...]}
//   <dir>/<stem>-<i>.bin   raw little-endian, C order; dtype float32, float64 or int64
#pragma once

#include <ATen/core/Tensor.h>

#include <map>
#include <string>

namespace hp::test {

void write_raw_tensors(const std::string& dir, const std::string& stem,
                       const std::map<std::string, at::Tensor>& tensors);

std::map<std::string, at::Tensor> read_raw_tensors(const std::string& dir, const std::string& stem);

}  // namespace hp::test
