// Rank 0's progress: a live line (step, loss, samples/s, ETA) redrawn in place on a terminal,
// plain lines at intervals otherwise; other lines print above it.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace shardopt::app {

class Progress {
 public:
  // `enabled`: this rank prints. `total_steps`: of the whole run (the rate and ETA count the steps
  // taken since construction, so a resumed run's are its own). `plain_every`: steps between plain
  // lines when stdout is not a terminal.
  Progress(bool enabled, int64_t total_steps, int64_t samples_per_step, int64_t plain_every);

  // After global step `step` (0-based) of epoch `epoch` (0-based) with this step's mean loss.
  void update(int64_t step, int64_t epoch, int64_t epochs, double loss);
  // Prints `text` as a line of its own (the live line is redrawn after it).
  void print(const std::string& text);
  // Ends the live line.
  void finish();
  // This rank prints from now on (it became rank 0 after a recovery).
  void enable();

  double seconds() const;
  int64_t steps_done() const { return steps_; }

 private:
  bool enabled_, live_;
  int64_t total_steps_, samples_per_step_, plain_every_;
  int64_t steps_ = 0;
  double loss_avg_ = 0.0;
  std::string last_;
  std::chrono::steady_clock::time_point start_, last_draw_;
};

}  // namespace shardopt::app
