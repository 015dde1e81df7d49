#include "hp/util/error.h"

namespace hp {

void throw_argument_error(const std::string& message) { throw ArgumentError(message); }

}  // namespace hp
