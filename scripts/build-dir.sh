# Sourced by the scripts: hp_build_dir prints the build directory that
# scripts/build.sh uses for HP_LIBTORCH (HP_BUILD_DIR overrides it).
hp_build_dir() {
  case "${HP_LIBTORCH:-venv}" in
    venv) echo "${HP_BUILD_DIR:-build}" ;;
    debian) echo "${HP_BUILD_DIR:-build-debian}" ;;
    *) echo "${HP_BUILD_DIR:-build-other}" ;;
  esac
}
