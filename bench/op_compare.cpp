#include "bench/op_compare.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <exception>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <stdexcept>

#include "hp/util/error.h"

namespace hp::bench {

using json = nlohmann::json;

namespace {

struct Side {
  double self_ms = 0;
  double calls = 0;
};

// name -> per-step self time and calls of one profile.
std::map<std::string, Side> read_side(const std::string& row, const json& profile) {
  HP_CHECK_ARG(profile.is_object() && profile.contains("ops") && profile["ops"].is_array(),
               "op profile of ", row, ": expected an object with an \"ops\" array");
  std::map<std::string, Side> out;
  for (const json& op : profile["ops"]) {
    HP_CHECK_ARG(op.is_object() && op.contains("name") && op["name"].is_string() &&
                     op.contains("count") && op["count"].is_number() &&
                     op.contains("self_cpu_time") && op["self_cpu_time"].is_number(),
                 "op profile of ", row, ": op ", op.dump(),
                 " lacks a name, a count or a self_cpu_time");
    Side& s = out[op["name"].get<std::string>()];  // a repeated name adds up
    s.self_ms += op["self_cpu_time"].get<double>() / 1e3;
    s.calls += op["count"].get<double>();
  }
  return out;
}

json read_json_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot read " + path);
  try {
    return json::parse(in);
  } catch (const std::exception& e) {
    throw std::runtime_error("unreadable op profile " + path + ": " + e.what());
  }
}

}  // namespace

const std::vector<std::pair<std::string, std::string>>& op_compare_pairs() {
  static const std::vector<std::pair<std::string, std::string>> pairs = {
      {"single", "torch_single"}, {"ddp", "torch_ddp"}, {"fsdp_fused_prefetch", "torch_fsdp2"}};
  return pairs;
}

std::string ops_file(const std::string& dir, const std::string& row, int rank) {
  return (std::filesystem::path(dir) / fmt::format("{}.rank{}.ops.json", row, rank)).string();
}

json merge_per_step(const json& a, const json& b) {
  for (const json* p : {&a, &b}) {
    HP_CHECK_ARG(p->is_object() && p->contains("steps") && (*p)["steps"].is_number_integer() &&
                     (*p)["steps"].get<int64_t>() >= 1,
                 "merge_per_step: a profile's \"steps\" must be an integer >= 1, got ",
                 p->is_object() && p->contains("steps") ? (*p)["steps"].dump() : "none");
    read_side("merge_per_step", *p);  // checks the ops
  }
  const double na = a["steps"].get<double>(), nb = b["steps"].get<double>(), n = na + nb;
  // The steps-weighted mean of `key`; null when a side has it missing or null.
  const auto mean = [&](const json* x, const json* y, const char* key) {
    const auto value = [&](const json* o) -> std::optional<double> {
      if (o == nullptr) return 0.0;  // an op this side never ran
      if (!o->contains(key) || (*o)[key].is_null()) return std::nullopt;
      return (*o)[key].get<double>();
    };
    const std::optional<double> vx = value(x), vy = value(y);
    return vx && vy ? json((*vx * na + *vy * nb) / n) : json(nullptr);
  };
  std::map<std::string, std::pair<const json*, const json*>> ops;
  for (const json& op : a["ops"]) ops[op["name"].get<std::string>()].first = &op;
  for (const json& op : b["ops"]) ops[op["name"].get<std::string>()].second = &op;
  json out = b;
  out["steps"] = a["steps"].get<int64_t>() + b["steps"].get<int64_t>();
  out["wall_us"] = mean(&a, &b, "wall_us");
  out["allocations"] = mean(&a, &b, "allocations");
  json rows = json::array();
  for (const auto& [name, sides] : ops) {
    rows.push_back({{"name", name},
                    {"count", mean(sides.first, sides.second, "count")},
                    {"self_cpu_time", mean(sides.first, sides.second, "self_cpu_time")},
                    {"cpu_time_total", mean(sides.first, sides.second, "cpu_time_total")},
                    {"self_allocations",
                     mean(sides.first, sides.second, "self_allocations")}});
  }
  std::stable_sort(rows.begin(), rows.end(), [](const json& x, const json& y) {
    return x["self_cpu_time"].get<double>() > y["self_cpu_time"].get<double>();
  });
  out["ops"] = rows;
  return out;
}

void write_ops_file(const std::string& dir, const std::string& row, int rank, int64_t steps,
                    const OpProfileResult& total) {
  json out = json::parse(total.per_step(steps).to_json());
  out["row"] = row;
  out["rank"] = rank;
  out["steps"] = steps;
  out["source"] = "hp";
  out["per"] = "step";
  out["note"] = kProfiledStepsNote;
  std::filesystem::create_directories(dir);
  const std::string path = ops_file(dir, row, rank);
  if (std::filesystem::exists(path)) out = merge_per_step(read_json_file(path), out);
  std::ofstream file(path);
  file << out.dump(1) << "\n";
  if (!file) throw std::runtime_error("cannot write the op profile " + path);
}

OpComparison compare_ops(const std::string& ours_row, const json& ours,
                         const std::string& torch_row, const json& theirs) {
  const std::map<std::string, Side> a = read_side(ours_row, ours);
  const std::map<std::string, Side> b = read_side(torch_row, theirs);
  OpComparison c;
  c.ours_row = ours_row;
  c.torch_row = torch_row;
  c.totals.name = "total";
  const auto wall_ms = [](const json& p) {
    return p.contains("wall_us") && p["wall_us"].is_number() ? p["wall_us"].get<double>() / 1e3
                                                             : -1.0;
  };
  c.ours_wall_ms = wall_ms(ours);
  c.torch_wall_ms = wall_ms(theirs);
  if (ours.contains("allocations") && ours["allocations"].is_number()) {
    c.ours_allocations = ours["allocations"].get<double>();
  }
  std::map<std::string, OpDelta> by_name;
  for (const auto& [name, s] : a) {
    OpDelta& d = by_name[name];
    d.ours_self_ms = s.self_ms;
    d.ours_calls = s.calls;
  }
  for (const auto& [name, s] : b) {
    OpDelta& d = by_name[name];
    d.torch_self_ms = s.self_ms;
    d.torch_calls = s.calls;
  }
  for (auto& [name, d] : by_name) {
    d.name = name;
    c.totals.ours_self_ms += d.ours_self_ms;
    c.totals.torch_self_ms += d.torch_self_ms;
    c.totals.ours_calls += d.ours_calls;
    c.totals.torch_calls += d.torch_calls;
    c.ops.push_back(d);
  }
  // Name order from the map stays among equal differences.
  std::stable_sort(c.ops.begin(), c.ops.end(), [](const OpDelta& x, const OpDelta& y) {
    return std::abs(x.diff_ms()) > std::abs(y.diff_ms());
  });
  return c;
}

std::string format_comparison(const OpComparison& c, size_t top) {
  std::string out = fmt::format("{} vs {}: per step, ops by |self ms difference|\n", c.ours_row,
                                c.torch_row);
  const size_t n = std::min(top, c.ops.size());
  const std::string total_label = "total (self time of every op; calls)";
  size_t width = total_label.size();  // the op column fits every name shown
  for (size_t i = 0; i < n; ++i) width = std::max(width, c.ops[i].name.size());
  const auto line = [&](const std::string& name, double a, double b, double d, double ca,
                        double cb) {
    return fmt::format("  {:<{}} {:>10.3f} {:>10.3f} {:>+10.3f} {:>9.1f} {:>9.1f}\n", name, width,
                       a, b, d, ca, cb);
  };
  out += fmt::format("  {:<{}} {:>10} {:>10} {:>10} {:>9} {:>9}\n", "op", width, "ours ms",
                     "torch ms", "diff ms", "ours #", "torch #");
  for (size_t i = 0; i < n; ++i) {
    const OpDelta& d = c.ops[i];
    out += line(d.name, d.ours_self_ms, d.torch_self_ms, d.diff_ms(), d.ours_calls,
                d.torch_calls);
  }
  if (n < c.ops.size()) out += fmt::format("  ({} more ops)\n", c.ops.size() - n);
  const OpDelta& t = c.totals;
  out += line(total_label, t.ours_self_ms, t.torch_self_ms, t.diff_ms(), t.ours_calls,
              t.torch_calls);
  if (c.ours_wall_ms >= 0 && c.torch_wall_ms >= 0) {
    out += fmt::format("  profiled step wall time: ours {:.3f} ms, torch {:.3f} ms\n",
                       c.ours_wall_ms, c.torch_wall_ms);
  }
  if (c.ours_allocations >= 0) {
    out += fmt::format("  our CPU allocations per step: {:.1f} (per op in {}'s file; PyTorch's "
                       "profile counts none)\n",
                       c.ours_allocations, c.ours_row);
  }
  return out;
}

std::string compare_profile_dir(const std::string& dir, int rank, size_t top) {
  std::string out;
  const std::string head = fmt::format("Per-op CPU profile of rank {} ({}).\n", rank,
                                       kProfiledStepsNote);
  for (const auto& [ours, theirs] : op_compare_pairs()) {
    const std::string a = ops_file(dir, ours, rank), b = ops_file(dir, theirs, rank);
    if (!std::filesystem::exists(a) || !std::filesystem::exists(b)) continue;
    out += out.empty() ? head : "\n";
    out += format_comparison(compare_ops(ours, read_json_file(a), theirs, read_json_file(b)),
                             top);
  }
  return out;
}

}  // namespace hp::bench
