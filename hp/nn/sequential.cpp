#include "hp/nn/sequential.h"

#include "hp/util/error.h"

namespace hp::nn {

at::Tensor SequentialImpl::forward(const at::Tensor& input) {
  HP_CHECK_ARG(!is_empty(), "hp::nn::Sequential: forward of an empty Sequential; push_back "
               "modules first");
  at::Tensor x = input;
  for (size_t i = 0; i < size(); ++i) x = call_one(i, x);
  return x;
}

}  // namespace hp::nn
