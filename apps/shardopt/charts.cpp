#include "charts.h"

#include <shardopt/check.h>

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <vector>

namespace shardopt::app {

namespace {

std::string exe_dir() {
  char buf[4096];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return ".";
  std::string path(buf, static_cast<size_t>(n));
  return path.substr(0, path.find_last_of('/'));
}

bool exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

// A chart script: installed beside the executable's share folder, or in the source tree.
std::string script_path(const std::string& script) {
  const std::string installed = exe_dir() + "/../share/shardopt/" + script;
  return exists(installed) ? installed : std::string(SHARDOPT_APP_SOURCE_DIR) + "/" + script;
}

// Runs `args` with stdout and stderr to the terminal; returns the exit code.
int run_command(const std::vector<std::string>& args) {
  std::string line;
  for (const auto& a : args) line += (line.empty() ? "" : " ") + ("'" + a + "'");
  const int rc = std::system(line.c_str());
  return rc == -1 ? 127 : (WIFEXITED(rc) ? WEXITSTATUS(rc) : 128);
}

}  // namespace

std::string chart_python(const std::string& python, const std::string& out_dir, bool chart) {
  ::mkdir(out_dir.c_str(), 0755);
  struct stat st {};
  SHARDOPT_CHECK(::stat(out_dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode) && ::access(out_dir.c_str(), W_OK) == 0,
                 "-o '", out_dir, "' is not a folder it can write to");
  const std::string chosen = python.empty() ? std::string(SHARDOPT_APP_PYTHON) : python;
  if (!chart) return chosen;
  SHARDOPT_CHECK(::access(chosen.c_str(), X_OK) == 0, "--python '", chosen, "' is not an executable file");
  return chosen;
}

void draw_chart(const std::string& python, const std::string& script, const std::string& json, const std::string& png) {
  const int rc = run_command({python, script_path(script), json, png});
  SHARDOPT_CHECK(rc == 0, "drawing the chart with '", python, "' failed (exit code ", rc,
                 "; it needs matplotlib: tools/setup.sh installs it)");
}

}  // namespace shardopt::app
