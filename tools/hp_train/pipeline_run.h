// hp-train under --pp (docs/pipeline.md): each of the P ranks builds only
// its stages of the model (on meta, then its own tensors initialised with
// the whole model's values), and every step runs the --pp-schedule over
// --microbatches micro-batches, passing activations and their gradients
// between neighbouring ranks. Gradients are clipped by the whole model's
// norm (the stages' squared norms summed over the ranks); AdamW steps each
// rank's own parameters. Rank 0 prints the header, the progress lines (the
// loss comes from the last stage's rank), the memory table, a sample (the
// stages' weights gathered on rank 0) and the summary, as the other modes
// do. The checkpoint flags work as in the other modes, each rank saving and
// loading its stages under the whole model's keys (docs/pipeline.md,
// "Checkpoints").
#pragma once

#include "tools/hp_train/corpus.h"
#include "tools/hp_train/train_device.h"
#include "tools/hp_train/train_options.h"

namespace hp::train {

// Runs the job; every flag is checked already (validate_options). Returns
// the process's exit status. Joins the process group (collective).
int run_pipeline(const TrainOptions& options, const Parallelism& parallelism, const World& world,
                 const Corpus& corpus, const TrainDevice& device);

}  // namespace hp::train
