# `cmake --install build --prefix P` puts the headers under P/include/hp, the
# libraries under P/lib, hprun and hp-train under P/bin, and the package
# files under P/lib/cmake/HyperParallel, so that a program can use
#
#   find_package(HyperParallel REQUIRED)
#   target_link_libraries(app PRIVATE HyperParallel::hp)
#
# HyperParallel::hp brings every layer (fully_shard, tensor parallelism,
# checkpoints and the memory plan down to the process
# world), libtorch (Torch's own find_package, run again by the config file),
# Gloo's headers, fmt, nlohmann_json and the link order every hp program
# needs (hp_link_order in cmake/HPTargets.cmake).
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(HP_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/HyperParallel)

add_library(hp INTERFACE)
target_link_libraries(hp INTERFACE hp_fsdp hp_checkpoint hp_tp hp_plan hp_optim)
add_library(HyperParallel::hp ALIAS hp)

install(TARGETS hp hp_fsdp hp_tp hp_plan hp_optim hp_nn hp_tensor hp_mesh hp_distributed hp_checkpoint hp_util
                hp_link_order hp_fmt hp_gloo_headers
        EXPORT HyperParallelTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(TARGETS hprun hp-train RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(DIRECTORY ${HP_ROOT}/hp/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/hp
        FILES_MATCHING PATTERN "*.h")
install(EXPORT HyperParallelTargets NAMESPACE HyperParallel::
        DESTINATION ${HP_INSTALL_CMAKEDIR})

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
