// Assertions on tensors and small helpers shared by the test binaries.
#pragma once

#include <gtest/gtest.h>

#include <ATen/core/Tensor.h>

#include <string>

namespace hp::test {

// Exact equality of shape, dtype and every element.
testing::AssertionResult tensors_equal(const at::Tensor& actual, const at::Tensor& expected);

// |actual - expected| <= atol + rtol * |expected| elementwise, same shape.
testing::AssertionResult tensors_close(const at::Tensor& actual, const at::Tensor& expected,
                                       double rtol, double atol);

// This process's rank and the world size (0 and 1 outside hprun).
int rank();
int world_size();

}  // namespace hp::test
