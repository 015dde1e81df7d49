#include "tools/hp_train/model_flops.h"

#include <algorithm>
#include <cctype>
#include <vector>

#include "hp/util/error.h"

namespace hp::train {

double training_flops_per_token(const FlopsShape& s) {
  HP_CHECK_ARG(s.parameters >= s.embedding_parameters && s.embedding_parameters >= 0 &&
                   s.layers >= 0 && s.width >= 0 && s.seq >= 0,
               "training_flops_per_token: expected 0 <= embedding parameters (",
               s.embedding_parameters, ") <= parameters (", s.parameters,
               ") and non-negative layers, width and seq");
  return 6.0 * static_cast<double>(s.parameters - s.embedding_parameters) +
         12.0 * static_cast<double>(s.layers) * static_cast<double>(s.width) *
             static_cast<double>(s.seq);
}

namespace {

std::string lower(std::string text) {
  std::transform(text.begin(), text.end(), text.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return text;
}

bool has(const std::string& text, const char* part) { return text.find(part) != std::string::npos; }

}  // namespace

std::optional<double> bf16_peak_flops(const std::string& card_name) {
  const std::string name = lower(card_name);
  // NVIDIA's data sheets, dense (without 2:4 sparsity). The order matters:
  // the more specific names first.
  struct Card {
    std::vector<const char*> parts;  // all must appear in the name
    double flops;
  };
  static const std::vector<Card> kCards = {
      {{"h100", "pcie"}, 756e12},
      {{"h100", "nvl"}, 835e12},
      {{"h100"}, 989.4e12},  // SXM5 ("H100 80GB HBM3")
      {{"h200"}, 989.4e12},
      {{"h800"}, 989.4e12},
      {{"gh200"}, 989.4e12},
      {{"b200"}, 2250e12},
      {{"a100"}, 312e12},
      {{"a800"}, 312e12},
      {{"l40s"}, 362.05e12},
      {{"l4"}, 121e12},
      {{"a10g"}, 70e12},
  };
  for (const Card& card : kCards) {
    if (std::all_of(card.parts.begin(), card.parts.end(),
                    [&](const char* part) { return has(name, part); })) {
      return card.flops;
    }
  }
  return std::nullopt;
}

}  // namespace hp::train
