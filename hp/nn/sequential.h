// hp::nn::Sequential: torch::nn::Sequential whose modules are called
// through their hooks (N1 in docs/features.md).
//
//   hp::nn::Sequential blocks(torch::nn::TransformerEncoderLayer(options),
//                             torch::nn::TransformerEncoderLayer(options));
//   for (auto& block : *blocks) hp::fully_shard(block);
//   at::Tensor y = blocks(x);
//
// torch::nn::Sequential calls each module's forward directly, so a
// fully_shard unit or a shard_module plan inside it would never see its
// calls (fully_shard refuses that); this one calls each module as its
// holder would, hooks first. Plain torch::nn modules are wrapped as they
// are added (hookable_sequence.h): their names stay "0.weight", ... as in
// torch::nn::Sequential, so porting a model changes the namespace only.
//
// forward(x) chains single tensors: each module is called with the previous
// module's output (the input for the first) and must return one tensor.
// torch::nn::Sequential's other chains (several arguments, tuples, AnyValue)
// are not supported: a module whose forward takes or returns anything else
// raises ArgumentError naming it when reached; call such modules
// through get<Impl>(i) from a forward of your own. An empty Sequential
// raises ArgumentError.
#pragma once

#include <utility>

#include "hp/nn/hookable_sequence.h"

namespace hp::nn {

class SequentialImpl : public HookableSequence {
 public:
  template <typename... Modules>
  explicit SequentialImpl(Modules&&... modules) : HookableSequence("hp::nn::Sequential") {
    (push_back(std::forward<Modules>(modules)), ...);
  }

  at::Tensor forward(const at::Tensor& input);
};
HP_MODULE(Sequential);

}  // namespace hp::nn
