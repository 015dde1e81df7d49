// DeviceMesh (M1-M3) on 2, 3 and 4 ranks: layouts, coordinates, the
// groups of each dim, sub-meshes, flattening and every construction error.
#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "hp/distributed/collectives.h"
#include "hp/distributed/world.h"
#include "hp/mesh/device_mesh.h"
#include "hp/util/error.h"

namespace hp {
namespace {

using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

// The 2-d shape this world supports: [2, W/2] when W is even, else [W, 1].
std::vector<int64_t> two_d_shape() {
  const int w = dist::get_world_size();
  return w % 2 == 0 ? std::vector<int64_t>{2, w / 2} : std::vector<int64_t>{w, 1};
}

// Sum of the global ranks in `group` computed with an all-reduce over it.
float reduced_rank_sum(dist::Group& group) {
  at::Tensor t = at::full({1}, float(dist::get_rank()));
  dist::all_reduce(group, t).wait();
  return t.item<float>();
}

float expected_sum(const std::vector<int>& ranks) {
  float s = 0;
  for (int r : ranks) s += r;
  return s;
}

TEST(DeviceMesh, OneDimensionalMeshIsTheWorld) {
  auto mesh = init_device_mesh("cpu", {dist::get_world_size()}, {"dp"});
  EXPECT_EQ(mesh->ndim(), 1);
  EXPECT_EQ(mesh->size(), dist::get_world_size());
  EXPECT_EQ(mesh->coordinate(), std::vector<int64_t>{dist::get_rank()});
  EXPECT_EQ(mesh->group_ptr(0), dist::world_group()) << "a whole-world dim reuses the world group";
  EXPECT_EQ(mesh->dim_names(), std::vector<std::string>{"dp"});
  EXPECT_EQ(mesh->size("dp"), dist::get_world_size());
}

TEST(DeviceMesh, TwoDimensionalLayoutIsRowMajor) {
  auto shape = two_d_shape();
  auto mesh = init_device_mesh("cpu", shape, {"dp", "tp"});
  const int me = dist::get_rank();
  EXPECT_EQ(mesh->coordinate(), (std::vector<int64_t>{me / shape[1], me % shape[1]}));
  EXPECT_EQ(mesh->rank_at(mesh->coordinate()), me);
  // The tp group holds the row, the dp group the column.
  std::vector<int> row, column;
  for (int64_t j = 0; j < shape[1]; ++j) row.push_back(int(me / shape[1] * shape[1] + j));
  for (int64_t i = 0; i < shape[0]; ++i) column.push_back(int(i * shape[1] + me % shape[1]));
  EXPECT_EQ(mesh->group("tp").ranks(), row);
  EXPECT_EQ(mesh->group("dp").ranks(), column);
  EXPECT_EQ(reduced_rank_sum(mesh->group("tp")), expected_sum(row));
  EXPECT_EQ(reduced_rank_sum(mesh->group("dp")), expected_sum(column));
  EXPECT_THAT(mesh->describe(), HasSubstr("['dp', 'tp']"));
}

TEST(DeviceMesh, SubMeshesReuseTheParentGroups) {
  auto shape = two_d_shape();
  auto mesh = init_device_mesh("cpu", shape, {"dp", "tp"});
  auto tp = (*mesh)["tp"];
  EXPECT_EQ(tp->ndim(), 1);
  EXPECT_EQ(tp->ranks(), mesh->group("tp").ranks());
  EXPECT_EQ(tp->coordinate(), std::vector<int64_t>{mesh->coordinate(1)});
  EXPECT_EQ(&tp->group(0), &mesh->group("tp"));
  auto dp = mesh->sub({"dp"});
  EXPECT_EQ(dp->ranks(), mesh->group("dp").ranks());
  auto both = mesh->sub({"dp", "tp"});
  EXPECT_EQ(*both, *mesh);
}

TEST(DeviceMesh, IndexingWithAListOfNamesIsSub) {
  // mesh[{"dp", "tp"}] (M2) must pick the list overload, not build one
  // std::string from the two literals.
  auto two = init_device_mesh("cpu", two_d_shape(), {"dp", "tp"});
  auto both = (*two)[{"dp", "tp"}];
  EXPECT_EQ(*both, *two);
  EXPECT_EQ(&both->group("tp"), &two->group("tp"));
  auto one = (*two)[{"tp"}];
  EXPECT_EQ(*one, *(*two)["tp"]);
  EXPECT_EQ(one->dim_names(), std::vector<std::string>{"tp"});

  const int w = dist::get_world_size();
  std::vector<int64_t> shape = w == 4 ? std::vector<int64_t>{2, 1, 2}
                                      : std::vector<int64_t>{1, w, 1};
  auto three = init_device_mesh("cpu", shape, {"pp", "dp", "tp"});
  auto outer = (*three)[{"pp", "tp"}];
  EXPECT_EQ(*outer, *three->sub({"pp", "tp"}));
  EXPECT_EQ(outer->shape(), (std::vector<int64_t>{shape[0], shape[2]}));
  EXPECT_EQ(outer->dim_names(), (std::vector<std::string>{"pp", "tp"}));
  EXPECT_EQ(outer->coordinate(),
            (std::vector<int64_t>{three->coordinate(0), three->coordinate(2)}));
  EXPECT_EQ(&outer->group("pp"), &three->group("pp"));
  EXPECT_EQ(reduced_rank_sum(outer->group("tp")), expected_sum(three->group("tp").ranks()));
  // The lambda is parenthesised: the macro would split at the braced list's comma.
  EXPECT_THAT(([&] { (*three)[{"tp", "pp"}]; }),
              ThrowsMessage<ArgumentError>(HasSubstr(
                  "sub-mesh names ['tp', 'pp'] must be distinct and in the mesh's order ['pp', "
                  "'dp', 'tp']")));
}

TEST(DeviceMesh, FlattenMergesDimsIntoOneGroup) {
  auto shape = two_d_shape();
  auto mesh = init_device_mesh("cpu", shape, {"dp", "tp"});
  auto flat = mesh->flatten({"dp", "tp"});
  EXPECT_EQ(flat->dim_names(), std::vector<std::string>{"dp_tp"});
  EXPECT_EQ(flat->size(), dist::get_world_size());
  EXPECT_EQ(flat->coordinate(0), dist::get_rank());
  EXPECT_EQ(reduced_rank_sum(flat->group(0)), expected_sum(flat->ranks()));
}

TEST(DeviceMesh, ThreeDimensionalMeshAndItsFlattenings) {
  const int w = dist::get_world_size();
  std::vector<int64_t> shape = w == 4 ? std::vector<int64_t>{2, 1, 2}
                                      : std::vector<int64_t>{1, w, 1};
  auto mesh = init_device_mesh("cpu", shape, {"pp", "dp", "tp"});
  const int me = dist::get_rank();
  for (int64_t d = 0; d < 3; ++d) {
    const auto& ranks = mesh->group(d).ranks();
    EXPECT_EQ(static_cast<int64_t>(ranks.size()), shape[d]);
    EXPECT_NE(std::find(ranks.begin(), ranks.end(), me), ranks.end());
    EXPECT_EQ(reduced_rank_sum(mesh->group(d)), expected_sum(ranks)) << "dim " << d;
  }
  auto pp_tp = mesh->flatten({"pp", "tp"}, "outer");
  EXPECT_EQ(pp_tp->size(), shape[0] * shape[2]);
  EXPECT_EQ(reduced_rank_sum(pp_tp->group(0)), expected_sum(pp_tp->ranks()));
  auto sub = mesh->sub({"pp", "tp"});
  EXPECT_EQ(sub->shape(), (std::vector<int64_t>{shape[0], shape[2]}));
  EXPECT_EQ(sub->ranks(), pp_tp->ranks());
}

TEST(DeviceMesh, ExplicitRankLayout) {
  const int w = dist::get_world_size();
  std::vector<int> reversed;
  for (int r = w - 1; r >= 0; --r) reversed.push_back(r);
  auto mesh = DeviceMesh::create("cpu", {w}, reversed, {"x"});
  EXPECT_EQ(mesh->coordinate(0), w - 1 - dist::get_rank());
  EXPECT_EQ(mesh->group(0).ranks(), reversed);
}

TEST(DeviceMeshErrors, ConstructionErrorsNameTheProblem) {
  const int w = dist::get_world_size();
  EXPECT_THAT([&] { init_device_mesh("cpu", {w + 1}); },
              ThrowsMessage<ArgumentError>(HasSubstr(
                  "mesh shape [" + std::to_string(w + 1) + "] holds " + std::to_string(w + 1) +
                  " ranks but the world size is " + std::to_string(w))));
  EXPECT_THAT([&] { init_device_mesh("cpu", {}); },
              ThrowsMessage<ArgumentError>(HasSubstr("mesh shape must have at least one dim")));
  EXPECT_THAT([&] { init_device_mesh("cpu", {w, 0}); },
              ThrowsMessage<ArgumentError>(
                  HasSubstr("dim 1 has size 0, expected a positive size")));
  EXPECT_THAT([&] { init_device_mesh("cpu", {w, -1}); },
              ThrowsMessage<ArgumentError>(HasSubstr("dim 1 has size -1")));
  EXPECT_THAT([&] { init_device_mesh("cpu", {1, w}, {"dp", "dp"}); },
              ThrowsMessage<ArgumentError>(
                  HasSubstr("mesh dim names ['dp', 'dp'] contain 'dp' twice")));
  EXPECT_THAT(
      [&] {
        init_device_mesh("cpu", {1, w}, {"dp"});
      },
      ThrowsMessage<ArgumentError>(
          HasSubstr("has 1 entries but the mesh shape [1, " + std::to_string(w) + "] has 2 dims")));
  EXPECT_THAT([&] { init_device_mesh("cpu", {w}, {"None"}); },
              ThrowsMessage<ArgumentError>(HasSubstr("'None'")));
  EXPECT_THAT(
      [&] { init_device_mesh("tpu", {w}); },
      ThrowsMessage<ArgumentError>(HasSubstr("device_type must be 'cpu' or 'cuda', got 'tpu'")));
  if (!at::hasCUDA()) {  // a CUDA libtorch builds 'cuda' meshes (tests/cuda)
#ifdef USE_C10D_NCCL
    // The CUDA wheel on a machine without a GPU or driver.
    const std::string expected = "device_type 'cuda' needs a CUDA device; this libtorch";
#else
    const std::string expected = "device_type 'cuda' needs a libtorch built with CUDA";
#endif
    EXPECT_THAT([&] { init_device_mesh("cuda", {w}); },
                ThrowsMessage<ArgumentError>(HasSubstr(expected)));
  }
  EXPECT_THAT([&] { DeviceMesh::create("cpu", {2}, {0, 0}); },
              ThrowsMessage<ArgumentError>(HasSubstr("contain rank 0 twice")));
}

TEST(DeviceMeshErrors, LookupErrorsNameTheProblem) {
  auto mesh = init_device_mesh("cpu", two_d_shape(), {"dp", "tp"});
  EXPECT_THAT([&] { (*mesh)["pp"]; },
              ThrowsMessage<ArgumentError>(
                  HasSubstr("mesh dim name 'pp' is not one of the mesh's dims ['dp', 'tp']")));
  EXPECT_THAT([&] { mesh->sub({"tp", "dp"}); },
              ThrowsMessage<ArgumentError>(
                  HasSubstr("must be distinct and in the mesh's order ['dp', 'tp']")));
  EXPECT_THAT([&] { mesh->size(2); },
              ThrowsMessage<ArgumentError>(HasSubstr("mesh dim 2 is out of range")));
  EXPECT_THAT([&] { mesh->group("x"); },
              ThrowsMessage<ArgumentError>(HasSubstr("mesh dim name 'x'")));
  EXPECT_THAT(
      [&] {
        mesh->flatten({"tp", "dp"});
      },
      ThrowsMessage<ArgumentError>(
          HasSubstr("flatten: names ['tp', 'dp'] must be distinct and in the mesh's order")));
}

TEST(DeviceMeshErrors, RankOutsideASubsetMesh) {
  if (dist::get_world_size() < 2) GTEST_SKIP();
  auto mesh = DeviceMesh::create("cpu", {1}, {0}, {"solo"});
  if (dist::get_rank() == 0) {
    EXPECT_EQ(mesh->coordinate(0), 0);
  } else {
    EXPECT_FALSE(mesh->contains_self());
    EXPECT_THAT([&] { mesh->coordinate(); },
                ThrowsMessage<ArgumentError>(HasSubstr("is not part of DeviceMesh")));
  }
}

}  // namespace
}  // namespace hp
