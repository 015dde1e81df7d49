#include "hp/distributed/native_average.h"

#include "hp/util/error.h"

namespace hp::dist {

NativeAverage native_average(c10::ScalarType dtype, int group_size) {
  HP_CHECK_ARG(group_size >= 1, "native_average: group_size ", group_size, " must be >= 1");
  if (dtype != c10::ScalarType::Half) return {};
  int pre = 1;
  while (group_size % (pre * 2) == 0 && (pre * 2) * (pre * 2) <= group_size) pre *= 2;
  return {false, pre, group_size / pre};
}

}  // namespace hp::dist
