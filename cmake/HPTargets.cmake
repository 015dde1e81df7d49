# Helpers shared by every layer.
#
# Compile time is dominated by libtorch's headers (a TU that includes
# <torch/torch.h> costs ~20 s here). Two precompiled headers keep that down:
#   hp_pch_aten  - ATen + c10d, for the layers below nn/ and their tests
#   hp_pch_torch - <torch/torch.h>, for nn/ and above, tools and tests of them
# A target picks one with hp_use_pch(<target> aten|torch). What a file costs
# after that is mostly libtorch's inline code at -O3, which the unity build
# (CMakeLists.txt) compiles once per batch of files instead of once per file.

set(HP_WARNINGS -Wall -Wextra -Wno-unused-parameter -Wno-missing-field-initializers)

# libstdc++ first in the dynamic loader's search order. The PyTorch wheels'
# libtorch.so and libtorch_cpu.so export their own copies of some libstdc++
# functions (std::filesystem among them, linked in statically when the wheel
# was built). The loader binds each undefined symbol to the first definition
# in its search order (the executable, then its DT_NEEDED entries in order),
# and an unversioned definition there satisfies even a versioned reference;
# g++ adds -lstdc++ at the end of the link line, after libtorch, so our
# std::filesystem calls would run libtorch's copies against the inline parts
# compiled here, with their layouts, and crash (a remove_all in a test's
# TearDown did). Naming libstdc++ before the objects and libraries, with
# --no-as-needed so that it is recorded even before anything refers to it,
# makes it the first DT_NEEDED entry. It is named by its file
# (-l:libstdc++.so.6), not as -lstdc++: with PyTorch 2.11's wheel, g++ 13
# and GNU ld 2.42, a -lstdc++ in this place left no libstdc++ entry at all
# (the driver adds its own -lstdc++ at the end, under --as-needed, and
# libtorch already defines those symbols) and the tests crashed in
# std::filesystem::remove_all; named by its file it stays, first. hp_link_order is an interface target
# every hp library links, so every program using them (and the installed
# HyperParallel::hp) gets the same order.
add_library(hp_link_order INTERFACE)
if(UNIX AND NOT APPLE)
  target_link_options(hp_link_order INTERFACE
    "LINKER:--push-state,--no-as-needed,-l:libstdc++.so.6,--pop-state")
endif()
# A CUDA wheel's own CUDA libraries ahead of the machine's (cmake/HPTorch.cmake).
hp_link_torch_runtime(hp_link_order BUILD_ONLY)

add_library(hp_gloo_headers INTERFACE)
target_include_directories(hp_gloo_headers SYSTEM INTERFACE
                           $<BUILD_INTERFACE:${HP_GLOO_INCLUDE_DIR}>)

add_library(hp_pch_aten STATIC ${HP_ROOT}/cmake/pch_anchor.cpp)
target_link_libraries(hp_pch_aten PUBLIC torch hp_gloo_headers Threads::Threads)
target_include_directories(hp_pch_aten PUBLIC ${HP_ROOT})
target_precompile_headers(hp_pch_aten PRIVATE ${HP_ROOT}/cmake/pch_aten.h)

add_library(hp_pch_torch STATIC ${HP_ROOT}/cmake/pch_anchor.cpp)
target_link_libraries(hp_pch_torch PUBLIC torch hp_gloo_headers Threads::Threads)
target_include_directories(hp_pch_torch PUBLIC ${HP_ROOT})
target_precompile_headers(hp_pch_torch PRIVATE ${HP_ROOT}/cmake/pch_torch.h)

function(hp_use_pch target kind)
  target_precompile_headers(${target} REUSE_FROM hp_pch_${kind})
endfunction()

# hp_library(<name> PCH aten|torch SOURCES ... DEPS ...)
function(hp_library name)
  cmake_parse_arguments(A "" "PCH" "SOURCES;DEPS" ${ARGN})
  add_library(${name} STATIC ${A_SOURCES})
  # Installed, the headers are under <prefix>/include (cmake/HPInstall.cmake).
  target_include_directories(${name} PUBLIC $<BUILD_INTERFACE:${HP_ROOT}>)
  target_link_libraries(${name} PUBLIC hp_link_order torch hp_gloo_headers Threads::Threads
                                        ${A_DEPS})
  target_compile_options(${name} PRIVATE ${HP_WARNINGS})
  hp_use_pch(${name} ${A_PCH})
endfunction()
