#include "tests/nn/raw_tensors.h"

#include <torch/torch.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>

namespace hp::test {

namespace {

// x86-64 and aarch64 are little-endian, so tensor bytes are written as they lie.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "raw tensor files are little-endian");

std::string dtype_name(at::ScalarType t) {
  if (t == at::kFloat) return "float32";
  if (t == at::kDouble) return "float64";
  if (t == at::kLong) return "int64";
  throw std::invalid_argument("write_raw_tensors: dtype " + std::string(c10::toString(t)) +
                              " is not float32, float64 or int64");
}

at::ScalarType dtype_of(const std::string& name) {
  if (name == "float32") return at::kFloat;
  if (name == "float64") return at::kDouble;
  if (name == "int64") return at::kLong;
  throw std::invalid_argument("read_raw_tensors: dtype " + name +
                              " is not float32, float64 or int64");
}

}  // namespace

void write_raw_tensors(const std::string& dir, const std::string& stem,
                       const std::map<std::string, at::Tensor>& tensors) {
  nlohmann::json index = {{"tensors", nlohmann::json::array()}};
  int i = 0;
  for (const auto& [name, tensor] : tensors) {
    at::Tensor t = tensor.detach().contiguous();
    const std::string file = stem + "-" + std::to_string(i++) + ".bin";
    std::ofstream out(dir + "/" + file, std::ios::binary);
    out.write(static_cast<const char*>(t.data_ptr()), std::streamsize(t.nbytes()));
    if (!out) throw std::runtime_error("write_raw_tensors: cannot write " + dir + "/" + file);
    index["tensors"].push_back({{"name", name},
                                {"dtype", dtype_name(t.scalar_type())},
                                {"shape", t.sizes().vec()},
                                {"file", file}});
  }
  std::ofstream(dir + "/" + stem + ".json") << index.dump(1);
}

std::map<std::string, at::Tensor> read_raw_tensors(const std::string& dir,
                                                   const std::string& stem) {
  std::ifstream in(dir + "/" + stem + ".json");
  if (!in) throw std::runtime_error("read_raw_tensors: cannot open " + dir + "/" + stem + ".json");
  const nlohmann::json index = nlohmann::json::parse(in);
  std::map<std::string, at::Tensor> tensors;
  for (const auto& entry : index.at("tensors")) {
    const std::string file = dir + "/" + entry.at("file").get<std::string>();
    at::Tensor t = torch::empty(entry.at("shape").get<std::vector<int64_t>>(),
                                torch::dtype(dtype_of(entry.at("dtype").get<std::string>())));
    std::ifstream bin(file, std::ios::binary);
    bin.read(static_cast<char*>(t.data_ptr()), std::streamsize(t.nbytes()));
    if (!bin || bin.peek() != std::char_traits<char>::eof()) {
      throw std::runtime_error("read_raw_tensors: " + file + " does not hold exactly " +
                               std::to_string(t.nbytes()) + " bytes");
    }
    tensors.emplace(entry.at("name").get<std::string>(), std::move(t));
  }
  return tensors;
}

}  // namespace hp::test
