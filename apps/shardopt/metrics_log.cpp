#include "metrics_log.h"

#include "charts.h"

#include <shardopt/check.h>

namespace shardopt::app {

MetricsLog::MetricsLog(const std::string& path, bool append)
    : path_(path), out_(path, append ? std::ios::app : std::ios::trunc) {
  SHARDOPT_CHECK(out_, "--metrics '", path, "' cannot be written");
}

void MetricsLog::write(const nlohmann::json& record) {
  out_ << record.dump() << "\n";
  out_.flush();
}

std::string MetricsLog::draw(const std::string& python) const {
  const size_t dot = path_.find_last_of('.');
  const size_t slash = path_.find_last_of('/');
  const std::string stem = dot != std::string::npos && (slash == std::string::npos || dot > slash) ? path_.substr(0, dot) : path_;
  const std::string png = stem + ".png";
  draw_chart(python, "plot_train.py", path_, png);
  return png;
}

}  // namespace shardopt::app
