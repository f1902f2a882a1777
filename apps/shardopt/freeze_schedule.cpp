#include "freeze_schedule.h"

#include <shardopt/check.h>

#include <algorithm>
#include <set>

namespace shardopt::app {

namespace {

bool matches(const std::string& name, const std::string& prefix) { return name.rfind(prefix, 0) == 0; }

int64_t parse_count(const std::string& digits, const std::string& text) {
  SHARDOPT_CHECK(!digits.empty() && std::all_of(digits.begin(), digits.end(), ::isdigit) && digits.size() < 12,
                 text, ": expected PREFIX@EPOCH or PREFIX@sSTEP (e.g. conv@2, fc1@s300)");
  return std::stoll(digits);
}

FreezeEvent parse_one(const std::string& value, bool freeze) {
  FreezeEvent e;
  e.freeze = freeze;
  e.text = std::string(freeze ? "--freeze " : "--unfreeze ") + value;
  const auto at = value.rfind('@');
  SHARDOPT_CHECK(at != std::string::npos && at > 0, e.text, ": expected PREFIX@EPOCH or PREFIX@sSTEP (e.g. conv@2, fc1@s300)");
  e.prefix = value.substr(0, at);
  const std::string when = value.substr(at + 1);
  if (!when.empty() && when[0] == 's') {
    e.step = parse_count(when.substr(1), e.text);
  } else {
    e.epoch = parse_count(when, e.text);
    SHARDOPT_CHECK(e.epoch >= 1, e.text, ": epochs count from 1");
  }
  return e;
}

}  // namespace

FreezeSchedule FreezeSchedule::parse(const std::vector<std::string>& freeze, const std::vector<std::string>& unfreeze) {
  FreezeSchedule s;
  for (const auto& v : freeze) s.events_.push_back(parse_one(v, true));
  for (const auto& v : unfreeze) s.events_.push_back(parse_one(v, false));
  // Apply in time order; at the same step, in the order given (freezes before unfreezes).
  std::stable_sort(s.events_.begin(), s.events_.end(), [](const FreezeEvent& a, const FreezeEvent& b) {
    auto key = [](const FreezeEvent& e) { return e.step >= 0 ? std::pair<int64_t, int64_t>{1, e.step} : std::pair<int64_t, int64_t>{0, e.epoch}; };
    return key(a) < key(b);
  });
  return s;
}

void FreezeSchedule::validate(const std::vector<std::string>& names, int64_t steps_per_epoch, int64_t total_steps) const {
  for (const auto& e : events_) {
    const bool any = std::any_of(names.begin(), names.end(), [&](const std::string& n) { return matches(n, e.prefix); });
    std::string known;
    std::set<std::string> modules;
    for (const auto& n : names) modules.insert(n.substr(0, n.find('.')));
    for (const auto& m : modules) known += (known.empty() ? "" : ", ") + m;
    SHARDOPT_CHECK(any, e.text, ": no parameter name starts with '", e.prefix, "' (the model's modules: ", known, ")");
    const int64_t first = e.first_step(steps_per_epoch);
    SHARDOPT_CHECK(first < total_steps, e.text, ": ", e.step >= 0 ? "step " : "epoch ",
                   e.step >= 0 ? e.step : e.epoch, " is past the end of the run (", total_steps, " steps, ",
                   total_steps / std::max<int64_t>(steps_per_epoch, 1), " epochs)");
  }
  // Every parameter frozen at some point: check at each event's first step.
  for (const auto& e : events_) {
    const auto flags = trainable_at(names, e.first_step(steps_per_epoch), steps_per_epoch);
    SHARDOPT_CHECK(std::any_of(flags.begin(), flags.end(), [](bool b) { return b; }), e.text,
                   ": this schedule freezes every parameter of the model; nothing would train");
  }
}

std::vector<bool> FreezeSchedule::trainable_at(const std::vector<std::string>& names, int64_t step,
                                                int64_t steps_per_epoch) const {
  std::vector<std::pair<int64_t, const FreezeEvent*>> timed;
  for (const auto& e : events_) timed.emplace_back(e.first_step(steps_per_epoch), &e);
  std::stable_sort(timed.begin(), timed.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<bool> flags(names.size(), true);
  for (const auto& [first, e] : timed) {
    if (first > step) break;
    for (size_t i = 0; i < names.size(); ++i) {
      if (matches(names[i], e->prefix)) flags[i] = !e->freeze;
    }
  }
  return flags;
}

std::vector<const FreezeEvent*> FreezeSchedule::events_at(int64_t step, int64_t steps_per_epoch) const {
  std::vector<const FreezeEvent*> out;
  for (const auto& e : events_) {
    if (e.first_step(steps_per_epoch) == step) out.push_back(&e);
  }
  return out;
}

}  // namespace shardopt::app
