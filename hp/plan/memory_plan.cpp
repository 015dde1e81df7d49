#include "hp/plan/memory_plan.h"

#include <fmt/format.h>

#include "hp/plan/step_setup.h"
#include "hp/plan/step_simulator.h"

namespace hp::plan {

const char* term_name(Term term) {
  switch (term) {
    case Term::kParameters: return "parameters";
    case Term::kGradients: return "gradients";
    case Term::kOptimizer: return "optimizer";
    case Term::kActivations: return "activations";
    case Term::kCommunication: return "communication";
    case Term::kSlack: return "slack";
  }
  return "?";
}

int64_t Breakdown::total() const {
  int64_t sum = 0;
  for (int64_t b : bytes) sum += b;
  return sum;
}

int64_t MemoryPlan::peak_bytes() const { return peak().terms.total(); }

const StepPeak& MemoryPlan::peak() const {
  return first_step.terms.total() > steady.terms.total() ? first_step : steady;
}

namespace {

std::string mib(int64_t bytes) {
  return fmt::format("{:.2f}", static_cast<double>(bytes) / (1 << 20));
}

}  // namespace

MemoryPlan plan_memory(const PlanOptions& options) {
  using detail::StepSimulator;
  const detail::StepSetup setup = detail::make_step_setup(options);
  MemoryPlan plan;
  plan.rank = options.rank;
  plan.steady = StepSimulator(setup, /*first_step=*/false).run();
  plan.first_step = StepSimulator(setup, /*first_step=*/true).run();
  plan.between_steps_bytes = StepSimulator(setup, false).between_steps_bytes();
  return plan;
}

std::string format_plan(const MemoryPlan& plan) {
  std::string out = fmt::format("memory plan of rank {} (MiB)\n", plan.rank);
  out += fmt::format("  {:<14} {:>12} {:>12}\n", "term", "steady step", "first step");
  for (int i = 0; i < kTermCount; ++i) {
    out += fmt::format("  {:<14} {:>12} {:>12}\n", term_name(static_cast<Term>(i)),
                       mib(plan.steady.terms.bytes[i]), mib(plan.first_step.terms.bytes[i]));
  }
  out += fmt::format("  {:<14} {:>12} {:>12}\n", "peak", mib(plan.steady.terms.total()),
                     mib(plan.first_step.terms.total()));
  out += fmt::format("  {:<14} {:>12} {:>12}\n", "  in flight", mib(plan.steady.in_flight_bytes),
                     mib(plan.first_step.in_flight_bytes));
  out += fmt::format("  steady step peaks at: {}\n  first step peaks at: {}\n", plan.steady.where,
                     plan.first_step.where);
  out += fmt::format("  between steps: {} MiB; predicted peak: {} MiB",
                     mib(plan.between_steps_bytes), mib(plan.peak_bytes()));
  return out;
}

}  // namespace hp::plan
