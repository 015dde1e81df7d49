# hp_fmt: the fmt the project formats with.
#
# A PyTorch 2.x distribution (the pip wheel, the libtorch zip) ships its own
# fmt headers in its include directory, which comes first on the include path
# of everything that uses torch. A system libfmt of another version would then
# be linked against headers it was not built from (undefined fmt::v12
# symbols against libfmt.so.9). So where libtorch carries fmt, the project
# uses that fmt header-only; elsewhere (Debian's libtorch 1.13, whose include
# directory is /usr/include) the system's libfmt.
add_library(hp_fmt INTERFACE)
set(HP_TORCH_FMT_DIR "")
if(Torch_VERSION VERSION_GREATER_EQUAL 2.0)
  foreach(dir IN LISTS TORCH_INCLUDE_DIRS)
    if(NOT HP_TORCH_FMT_DIR AND EXISTS "${dir}/fmt/format.h")
      set(HP_TORCH_FMT_DIR "${dir}")
    endif()
  endforeach()
endif()
if(HP_TORCH_FMT_DIR)
  message(STATUS "fmt: libtorch's own, header-only (${HP_TORCH_FMT_DIR}/fmt)")
  # Installed consumers get the directory through Torch's include path.
  target_include_directories(hp_fmt SYSTEM INTERFACE $<BUILD_INTERFACE:${HP_TORCH_FMT_DIR}>)
  target_compile_definitions(hp_fmt INTERFACE FMT_HEADER_ONLY=1)
  set(HP_FMT_FROM_TORCH ON)
else()
  find_package(fmt REQUIRED)
  target_link_libraries(hp_fmt INTERFACE fmt::fmt)
  set(HP_FMT_FROM_TORCH OFF)
endif()
