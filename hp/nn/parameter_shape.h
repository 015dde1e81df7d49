// A parameter's name (as named_parameters() gives it) and shape, known from
// a model's config before the model exists: the memory plan (P2) reads the
// configs' parameter_shapes() instead of keeping its own copy of the tables.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace hp::nn {

struct ParameterShape {
  std::string name;
  std::vector<int64_t> shape;
};

}  // namespace hp::nn
