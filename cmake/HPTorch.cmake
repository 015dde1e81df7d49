# Finding libtorch, and making a program that links it run against the same
# distribution it was compiled against.
#
# Three distributions are in use: Debian's libtorch-dev (1.13, CPU), the zip
# from pytorch.org, and the libtorch inside a pip-installed PyTorch
# (torch.utils.cmake_prefix_path, the project's default: scripts/build.sh).
#
# 1. TorchConfig.cmake looks for its libraries with find_library(... PATHS
#    <its prefix>/lib), and PATHS come after the system's directories: on a
#    machine that also has Debian's libtorch, the headers of one distribution
#    would silently be linked with the libraries of another. Each prefix
#    given as <root>/share/cmake (what cmake_prefix_path names) therefore
#    brings <root> too, so that <root>/lib is searched first; and after the
#    search every library must lie under the distribution's prefix.
# 2. A CUDA wheel's libtorch_cuda.so needs NCCL, cuDNN, cuBLAS... from the
#    wheel's sibling packages (site-packages/nvidia/*/lib), which it finds at
#    run time through its own RPATH. The linker does not read that RPATH when
#    it checks libtorch_cuda's needs, so it would take the machine's CUDA
#    toolkit (an older NCCL: undefined symbols), and programs would load the
#    toolkit's libcudart ahead of the wheel's. hp_torch_runtime_dirs() lists
#    the wheel's library directories; every hp program links with them first
#    (hp_link_order, cmake/HPTargets.cmake).

# Call before find_package(Torch).
macro(hp_prefer_torch_roots)
  foreach(_hp_prefix IN LISTS CMAKE_PREFIX_PATH)
    if(_hp_prefix MATCHES "/share/cmake/?$")
      get_filename_component(_hp_root "${_hp_prefix}/../.." ABSOLUTE)
      if(EXISTS "${_hp_root}/lib" AND NOT _hp_root IN_LIST CMAKE_PREFIX_PATH)
        list(PREPEND CMAKE_PREFIX_PATH "${_hp_root}")
      endif()
    endif()
  endforeach()
endmacro()

# Call after find_package(Torch): fails when libtorch's libraries were found
# outside the distribution whose headers and config were found.
function(hp_check_torch_libraries)
  get_filename_component(prefix "${TORCH_INSTALL_PREFIX}" REALPATH)
  foreach(var TORCH_LIBRARY c10_LIBRARY C10_CUDA_LIBRARY)
    if(${var})
      get_filename_component(lib "${${var}}" REALPATH)
      string(FIND "${lib}" "${prefix}/" at)
      if(NOT at EQUAL 0)
        message(FATAL_ERROR
          "libtorch's config was found in ${prefix}, but ${var} is ${${var}}, another "
          "distribution's library. Put the distribution's root first in CMAKE_PREFIX_PATH "
          "(-DCMAKE_PREFIX_PATH=${prefix}) and configure a fresh build directory.")
      endif()
    endif()
  endforeach()
endfunction()

# The library directories of a pip wheel's CUDA dependencies (empty for a
# libtorch that has none beside it), in <out>.
function(hp_torch_runtime_dirs out)
  set(dirs "")
  get_filename_component(site "${TORCH_INSTALL_PREFIX}/.." ABSOLUTE)
  if(EXISTS "${TORCH_INSTALL_PREFIX}/lib/libtorch_cuda.so" AND IS_DIRECTORY "${site}/nvidia")
    file(GLOB libdirs LIST_DIRECTORIES true "${site}/nvidia/*/lib")
    list(SORT libdirs)
    foreach(dir IN LISTS libdirs)
      if(IS_DIRECTORY "${dir}")
        list(APPEND dirs "${dir}")
      endif()
    endforeach()
  endif()
  set(${out} "${dirs}" PARENT_SCOPE)
endfunction()

# Adds the wheel's library directories to <target>'s interface link options:
# searched first for libtorch_cuda's needs (-rpath-link) and by the loader
# for the program's own (-rpath). BUILD_ONLY keeps them out of the installed
# package, whose config file finds them again for the libtorch it is used
# with (cmake/HyperParallelConfig.cmake.in).
function(hp_link_torch_runtime target)
  cmake_parse_arguments(A "BUILD_ONLY" "" "" ${ARGN})
  hp_torch_runtime_dirs(dirs)
  if(dirs)
    string(REPLACE ";" ":" path "${dirs}")
    set(options "LINKER:-rpath-link,${path}" "LINKER:-rpath,${path}")
    if(A_BUILD_ONLY)
      set(options "$<BUILD_INTERFACE:${options}>")
    endif()
    target_link_options(${target} INTERFACE "${options}")
  endif()
endfunction()
