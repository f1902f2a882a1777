// `shardopt train`'s metrics file: one JSON object per line, written by rank 0 as the run goes
// (flushed after each line, so a killed run keeps what it did), and its chart.
//
//   {"event": "start", "world": 2, "optimizer": "adam", "params": 421642, "steps_per_epoch": 500, ...}
//   {"step": 0, "epoch": 1, "loss": 2.31, "lr": 0.001, "samples_per_s": 3012.5}
//   {"step": 0, "state_bytes": [..per rank..], "grad_bytes": [..], "master_bytes": [..]}
//   {"step": 1000, "event": "freeze", "what": "froze conv (...)", "rebalanced": false, ...}
//   {"step": 499, "epoch": 1, "test_accuracy": 0.8974}
//   {"event": "done", "steps": 2500, "seconds": 79.4, "samples_per_s": 3777, "test_accuracy": 0.913}
//
// A resumed run appends to the file of the run it continues.
#pragma once

#include <nlohmann/json.hpp>

#include <fstream>
#include <string>

namespace shardopt::app {

class MetricsLog {
 public:
  // Opens `path` (appending when `append`); errors name the path.
  MetricsLog(const std::string& path, bool append);
  void write(const nlohmann::json& record);
  const std::string& path() const { return path_; }
  // The chart beside the file (metrics.jsonl -> metrics.png): loss and accuracy over the steps,
  // each rank's memory as a band, the freeze, unfreeze and rebalance events marked. Returns the
  // PNG's path; errors say what is missing.
  std::string draw(const std::string& python) const;

 private:
  std::string path_;
  std::ofstream out_;
};

}  // namespace shardopt::app
