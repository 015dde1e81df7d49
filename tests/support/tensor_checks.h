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

// Runs `fn` and returns the message of the exception of type E it throws;
// fails the test (returning "") when it throws nothing or something else.
template <typename E, typename Fn>
std::string message_of(Fn&& fn) {
  try {
    fn();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected a different exception type, got: " << e.what();
    return "";
  }
  ADD_FAILURE() << "expected an exception, none was thrown";
  return "";
}

}  // namespace hp::test
