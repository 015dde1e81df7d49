#include "hp/util/error.h"

#include <c10/util/Exception.h>

namespace hp {

void throw_argument_error(const std::string& message) { throw ArgumentError(message); }

std::string exception_message(const std::exception& e) {
  if (auto* c10_error = dynamic_cast<const c10::Error*>(&e)) {
    return c10_error->what_without_backtrace();
  }
  return e.what();
}

}  // namespace hp
