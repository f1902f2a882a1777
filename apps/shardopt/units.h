// Sizes and counts as people read them: 1.69 MB, 18,816.
#pragma once

#include <fmt/format.h>

#include <cstdint>
#include <string>

namespace shardopt::app {

// Decimal units (kB = 1000 B), three significant digits.
inline std::string bytes_text(double bytes) {
  const char* units[] = {"B", "kB", "MB", "GB", "TB"};
  int u = 0;
  while (bytes >= 999.5 && u < 4) bytes /= 1000, ++u;
  return u == 0 ? fmt::format("{:.0f} B", bytes) : fmt::format("{:.{}f} {}", bytes, bytes < 9.995 ? 2 : (bytes < 99.95 ? 1 : 0), units[u]);
}

inline std::string count_text(int64_t n) {
  std::string digits = std::to_string(n < 0 ? -n : n), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return n < 0 ? "-" + out : out;
}

}  // namespace shardopt::app
