// A freeze schedule: `--freeze conv@2 --unfreeze conv@4` freezes every parameter whose name
// starts with "conv" from the start of epoch 2 (epochs count from 1) and unfreezes them from
// the start of epoch 4; `fc1@s300` acts before step 300 (steps count from 0 over the whole run).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace shardopt::app {

struct FreezeEvent {
  bool freeze = true;
  std::string prefix;  // parameter-name prefix ("conv", "conv1.", "fc2.bias")
  int64_t epoch = 0;   // > 0: from the start of this epoch (1-based)
  int64_t step = -1;   // >= 0: from this global step (0-based)
  std::string text;    // as given, for messages ("--freeze conv@2")

  // The global step from which the event holds.
  int64_t first_step(int64_t steps_per_epoch) const { return step >= 0 ? step : (epoch - 1) * steps_per_epoch; }
};

class FreezeSchedule {
 public:
  // Parses every --freeze and --unfreeze value; a malformed one is an error naming it.
  static FreezeSchedule parse(const std::vector<std::string>& freeze, const std::vector<std::string>& unfreeze);

  // Checks the schedule against the model's parameter names and the run's length: every prefix
  // names some parameter, every time lies in the run, and no step has every parameter frozen.
  void validate(const std::vector<std::string>& names, int64_t steps_per_epoch, int64_t total_steps) const;

  // Whether each named parameter trains at global step `step`.
  std::vector<bool> trainable_at(const std::vector<std::string>& names, int64_t step, int64_t steps_per_epoch) const;

  // The events that first hold at `step`.
  std::vector<const FreezeEvent*> events_at(int64_t step, int64_t steps_per_epoch) const;

  bool empty() const { return events_.empty(); }

 private:
  std::vector<FreezeEvent> events_;  // in the order given; later ones win at the same step
};

}  // namespace shardopt::app
