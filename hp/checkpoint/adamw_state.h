// AdamW's per-parameter state as the checkpoint helpers see it
// (training_state.h's add_adamw and hp/pp/pipeline_checkpoint.h's add_pipeline_adamw
// share it; nothing else does).
#pragma once

#include <ATen/core/Tensor.h>

namespace torch::optim {
class AdamW;
struct AdamWParamState;
}  // namespace torch::optim

namespace hp::checkpoint {

// Whether any of the optimizer's parameter groups keeps max_exp_avg_sq.
bool adamw_uses_amsgrad(const torch::optim::AdamW& optimizer);

// `param`'s state in `optimizer`, created as AdamW::step creates it for a
// parameter it meets the first time (step 0, zero moments) when it has none
// yet, so a fresh optimizer can be loaded into.
torch::optim::AdamWParamState& adamw_param_state(torch::optim::AdamW& optimizer,
                                                 const at::Tensor& param, bool amsgrad);

}  // namespace hp::checkpoint
