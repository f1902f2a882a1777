// Charts drawn by the tool's Python scripts (matplotlib), installed beside the executable.
#pragma once

#include <string>

namespace shardopt::app {

// Checks that `out_dir` is a folder it can write to (made when missing) and, where a `chart` is to
// be drawn, that `python` (empty: the build's interpreter) can run; returns the interpreter.
// Errors name the option.
std::string chart_python(const std::string& python, const std::string& out_dir, bool chart = true);

// Runs `script` (plot_memory.py, plot_plan.py, ...) on `json` to draw `png`. Errors name the
// interpreter and say what it needs.
void draw_chart(const std::string& python, const std::string& script, const std::string& json, const std::string& png);

}  // namespace shardopt::app
