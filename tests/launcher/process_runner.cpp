#include "tests/launcher/process_runner.h"

#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace hp::launcher::testing {

std::string describe(const ProcessResult& r) {
  std::ostringstream text;
  text << tools::describe_exit(r) << " after " << r.seconds << " s\n--- stdout ---\n"
       << r.out << "--- stderr ---\n"
       << r.err;
  return text.str();
}

std::string read_proc_file(pid_t pid, const std::string& name) {
  const std::string path = "/proc/" + std::to_string(pid) + "/" + name;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return "";
  std::string content;
  char buffer[4096];
  ssize_t got = 0;
  while ((got = ::read(fd, buffer, sizeof buffer)) > 0) content.append(buffer, got);
  ::close(fd);
  return got < 0 ? "" : content;
}

bool process_alive(pid_t pid) {
  if (::kill(pid, 0) != 0) return errno == EPERM;
  const std::string content = read_proc_file(pid, "stat");
  std::size_t close_paren = content.rfind(')');
  if (close_paren == std::string::npos || close_paren + 2 >= content.size()) return false;
  char state = content[close_paren + 2];
  return state != 'Z' && state != 'X';
}

long wait_for_integer_file(const std::string& path, double limit_s) {
  double deadline = now_seconds() + limit_s;
  do {
    std::ifstream in(path);
    long value = -1;
    // A file being written may still be empty or hold a partial number;
    // writers end the line, so wait for the newline.
    std::string line;
    if (in && std::getline(in, line) && !in.eof()) {
      char* end = nullptr;
      value = std::strtol(line.c_str(), &end, 10);
      if (!line.empty() && *end == '\0') return value;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  } while (now_seconds() < deadline);
  return -1;
}

TempDir::TempDir() {
  std::string base = std::filesystem::temp_directory_path().string() + "/hprun_test.XXXXXX";
  std::vector<char> name(base.begin(), base.end());
  name.push_back('\0');
  if (::mkdtemp(name.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
  path_ = name.data();
}

TempDir::~TempDir() {
  std::error_code ignored;
  std::filesystem::remove_all(path_, ignored);
}

}  // namespace hp::launcher::testing
