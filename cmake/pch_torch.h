// Precompiled header for nn/ and everything above it.
#pragma once
#include "cmake/pch_aten.h"
#include <torch/torch.h>
