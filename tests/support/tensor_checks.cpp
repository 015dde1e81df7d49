#include "tests/support/tensor_checks.h"

#include <ATen/ATen.h>

#include <sstream>

#include "hp/distributed/world.h"

namespace hp::test {

testing::AssertionResult tensors_equal(const at::Tensor& actual, const at::Tensor& expected) {
  if (actual.sizes() != expected.sizes()) {
    return testing::AssertionFailure() << "shape " << actual.sizes() << " != expected "
                                       << expected.sizes();
  }
  if (actual.scalar_type() != expected.scalar_type()) {
    return testing::AssertionFailure() << "dtype " << actual.scalar_type() << " != expected "
                                       << expected.scalar_type();
  }
  if (!at::equal(actual, expected)) {
    std::ostringstream out;
    out << "values differ:\nactual\n" << actual << "\nexpected\n" << expected;
    return testing::AssertionFailure() << out.str();
  }
  return testing::AssertionSuccess();
}

testing::AssertionResult tensors_close(const at::Tensor& actual, const at::Tensor& expected,
                                       double rtol, double atol) {
  if (actual.sizes() != expected.sizes()) {
    return testing::AssertionFailure() << "shape " << actual.sizes() << " != expected "
                                       << expected.sizes();
  }
  at::Tensor a = actual.to(at::kDouble), e = expected.to(at::kDouble);
  at::Tensor excess = (a - e).abs() - (atol + rtol * e.abs());
  if (excess.numel() > 0 && excess.max().item<double>() > 0) {
    return testing::AssertionFailure()
           << "max |actual - expected| = " << (a - e).abs().max().item<double>()
           << " exceeds atol " << atol << " + rtol " << rtol << " * |expected|";
  }
  return testing::AssertionSuccess();
}

int rank() { return hp::dist::is_initialized() ? hp::dist::get_rank() : 0; }
int world_size() { return hp::dist::is_initialized() ? hp::dist::get_world_size() : 1; }

}  // namespace hp::test
