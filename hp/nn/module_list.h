// hp::nn::ModuleList: torch::nn::ModuleList whose entries are hookable
// (N1 in docs/features.md).
//
//   hp::nn::ModuleList layers;
//   for (int i = 0; i < n; ++i) layers->push_back(torch::nn::TransformerEncoderLayer(options));
//   for (auto& layer : *layers) hp::fully_shard(layer);
//   for (size_t i = 0; i < layers->size(); ++i)
//     x = layers->get<torch::nn::TransformerEncoderLayerImpl>(i)(x, mask);   // hooks run
//
// Like torch::nn::ModuleList it calls nothing itself: the model's forward
// calls the entries, through get<Impl>(i) (hookable_sequence.h), whose
// holder runs the hooks. Plain torch::nn modules are wrapped as they are
// added and keep torch::nn::ModuleList's names ("0.weight", ...).
#pragma once

#include <utility>

#include "hp/nn/hookable_sequence.h"

namespace hp::nn {

class ModuleListImpl : public HookableSequence {
 public:
  template <typename... Modules>
  explicit ModuleListImpl(Modules&&... modules) : HookableSequence("hp::nn::ModuleList") {
    (push_back(std::forward<Modules>(modules)), ...);
  }
};
HP_MODULE(ModuleList);

}  // namespace hp::nn
