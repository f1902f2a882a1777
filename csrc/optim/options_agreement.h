// Every rank's optimizers alike (Note [Optimizers agree across ranks] in options_agreement.cpp):
// each parameter group's optimizer class and options as text, compared across the ranks.
// Internal to csrc/optim.
#pragma once

#include <shardopt/comm/process_group.h>

#include <ATen/core/ivalue.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace shardopt::detail {

// One parameter group: its optimizer's class name, then each option as (name, value text).
struct GroupOptions {
  std::string optimizer;
  std::vector<std::pair<std::string, std::string>> options;
};

// A value of an encoded option as text: the shortest text that reads back as the same double,
// integers, bools, strings, and tuples or lists of them as "(a, b)".
std::string option_text(const c10::IValue& value);

// A hash of `groups`, the same on every rank for the same classes and options.
uint64_t options_hash(const std::vector<GroupOptions>& groups);

// Gathers every rank's `groups` over `group` and throws on every rank when they differ, naming
// the first group and option that differ and each rank's value. Collective.
void check_options_alike(ProcessGroup& group, const std::vector<GroupOptions>& groups);

// The message for every rank's groups (in rank order); "" when all agree.
std::string options_disagreement(const std::vector<std::vector<GroupOptions>>& all);

}  // namespace shardopt::detail
