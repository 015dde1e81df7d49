// Models on the meta device (N6 in docs/features.md): shapes and dtypes
// without memory, for deferred initialisation (hp/fsdp/materialize.h).
//
// libtorch C++ has no default-device context (PyTorch's `with
// torch.device("meta")`), and its modules allocate and initialise their
// parameters in their constructors. So a model is put on meta one submodule
// at a time: construct a submodule (on the CPU, as usual), move it to meta,
// construct the next. The peak is one submodule, and the constructors'
// draws from the default generator happen exactly as in an eager
// construction, so a deferred init that continues from there draws what the
// eager model's init would (hp::nn::GPT does this when built with
// at::kMeta).
//
// `param.set_data(meta)` is refused by libtorch ("incompatible tensor type"),
// so the tensors are replaced, not retargeted (replace_parameter.h): an
// optimizer must be built after materialisation.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

namespace torch::nn {
class Module;
}

namespace hp::nn {

// Replaces every parameter and buffer of `module`'s tree that is not on the
// meta device by a meta tensor of the same shape, dtype and requires_grad
// (tied tensors stay tied). Parameters are replaced as replace_parameter
// does, so its ArgumentError for a module type with unknown fields applies.
void move_to_meta(torch::nn::Module& module);

// Replaces the buffer called `name` ("h.0.attn.mask") of `root` by `value`
// (same sizes), in every module of the tree that registers the same tensor.
// ArgumentError, with nothing changed, for an unknown name or other sizes.
void replace_buffer(torch::nn::Module& root, const std::string& name, const at::Tensor& value);

}  // namespace hp::nn
