# `cmake --install build --prefix P` puts the headers under P/include/hp, the
# libraries under P/lib, hprun and hp-train under P/bin, and the package
# files under P/lib/cmake/HyperParallel, so that a program can use
#
#   find_package(HyperParallel REQUIRED)
#   target_link_libraries(app PRIVATE HyperParallel::hp)
#
# HyperParallel::hp brings every layer (fully_shard, tensor parallelism,
# checkpoints, the memory plan and the pipeline schedules down to the process
# world), libtorch (Torch's own find_package, run again by the config file),
# Gloo's headers, fmt, nlohmann_json and the link order every hp program
# needs (hp_link_order in cmake/HPTargets.cmake).
#
# The libraries are static and compiled against one libtorch's headers: they
# work only with that libtorch. The config file records it (where its
# TorchConfig.cmake was, and its version), searches it before the system's
# directories (a machine may also have Debian's libtorch 1.13 in /usr), and
# refuses at configure time a libtorch of another version that the program
# names itself, instead of a link that fails on c10 symbols.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(HP_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/HyperParallel)

add_library(hp INTERFACE)
target_link_libraries(hp INTERFACE hp_fsdp hp_checkpoint hp_tp hp_plan hp_optim hp_pp hp_pp_schedule)
add_library(HyperParallel::hp ALIAS hp)

install(TARGETS hp hp_fsdp hp_tp hp_plan hp_optim hp_nn hp_tensor hp_mesh hp_distributed hp_checkpoint hp_util
                hp_pp hp_pp_schedule
                hp_link_order hp_fmt hp_gloo_headers
        EXPORT HyperParallelTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
# Installed programs run against the libtorch they were built with. In the
# build tree CMake's build RPATH names it; `cmake --install` replaces that with
# the install RPATH, and with none hp-train would load whichever libtorch the
# loader finds (Debian's 1.13 in /usr/lib, which lacks libtorch_cuda.so) or
# none. So the install RPATH names libtorch's library directory. A CUDA
# wheel's CUDA library directories come first in the run path already: they
# are link options (hp_link_order, cmake/HPTorch.cmake), which the install
# keeps. The package installs no shared libraries of its own, so no
# $ORIGIN/../lib; hprun links no libtorch and needs none.
get_filename_component(HP_TORCH_LIB_DIR "${TORCH_LIBRARY}" DIRECTORY)
if(NOT HP_TORCH_LIB_DIR IN_LIST CMAKE_CXX_IMPLICIT_LINK_DIRECTORIES)
  set_target_properties(hp-train PROPERTIES INSTALL_RPATH "${HP_TORCH_LIB_DIR}")
endif()
install(TARGETS hprun hp-train RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(DIRECTORY ${HP_ROOT}/hp/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/hp
        FILES_MATCHING PATTERN "*.h")
install(EXPORT HyperParallelTargets NAMESPACE HyperParallel::
        DESTINATION ${HP_INSTALL_CMAKEDIR})

# What the config file records of the libtorch built against.
get_filename_component(HP_TORCH_CONFIG_DIR "${Torch_DIR}" ABSOLUTE)
get_filename_component(HP_TORCH_ROOT "${TORCH_INSTALL_PREFIX}" ABSOLUTE)
configure_package_config_file(${HP_ROOT}/cmake/HyperParallelConfig.cmake.in
                              ${CMAKE_CURRENT_BINARY_DIR}/HyperParallelConfig.cmake
                              INSTALL_DESTINATION ${HP_INSTALL_CMAKEDIR})
# 0.x: minor versions may break the API.
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/HyperParallelConfigVersion.cmake
                                 COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/HyperParallelConfig.cmake
              ${CMAKE_CURRENT_BINARY_DIR}/HyperParallelConfigVersion.cmake
              ${HP_ROOT}/cmake/HPTorch.cmake
        DESTINATION ${HP_INSTALL_CMAKEDIR})
