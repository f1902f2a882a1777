#include "optim/options_agreement.h"

#include <shardopt/check.h>

#include <algorithm>
#include <charconv>
#include <functional>
#include <sstream>

namespace shardopt::detail {

// Note [Optimizers agree across ranks]
// Each rank steps its own shard with its own optimizer, so a rank built with another learning
// rate, or with SGD where the others have Adam, would train on silently while every rank believes
// it holds the same parameters. OSS compares each parameter group's optimizer class and every
// option it encodes (the codec's, the names PyTorch saves; a registered optimizer's registered
// options) across the ranks:
//   - at construction, in full (one gather of the texts);
//   - at every step, in the 16-byte all-reduce of the trainability check it already makes (a hash
//     of the trainable set and of the options; under a ShardedDDP, in its forward's overlapped
//     check), so that a change of param_groups() on one rank is caught before the step uses it,
//     at no extra round trip. Only when the hashes differ are the texts gathered, to name the
//     group, the option and each rank's value in one error on every rank.
// A learning-rate scheduler that changes every rank alike changes every rank's hash alike.

namespace {

constexpr char kUnit = '\x1f';   // between a name and its value, and between options
constexpr char kGroup = '\x1e';  // between groups

std::string encode(const std::vector<GroupOptions>& groups) {
  std::string out;
  for (const auto& g : groups) {
    out += g.optimizer;
    for (const auto& [name, value] : g.options) out += kUnit + name + kUnit + value;
    out += kGroup;
  }
  return out;
}

std::vector<GroupOptions> decode(const std::string& text) {
  std::vector<GroupOptions> groups;
  size_t at = 0;
  while (at < text.size()) {
    const size_t end = text.find(kGroup, at);
    std::vector<std::string> parts;
    size_t p = at;
    while (true) {
      const size_t q = text.find(kUnit, p);
      if (q == std::string::npos || q > end) {
        parts.push_back(text.substr(p, end - p));
        break;
      }
      parts.push_back(text.substr(p, q - p));
      p = q + 1;
    }
    GroupOptions g;
    g.optimizer = parts[0];
    for (size_t i = 1; i + 1 < parts.size(); i += 2) g.options.emplace_back(parts[i], parts[i + 1]);
    groups.push_back(std::move(g));
    at = end + 1;
  }
  return groups;
}

// "A on ranks 0, 2 but B on rank 1".
std::string values_by_rank(const std::vector<std::string>& values) {
  std::vector<std::pair<std::string, std::vector<int>>> seen;
  for (size_t r = 0; r < values.size(); ++r) {
    auto it = std::find_if(seen.begin(), seen.end(), [&](const auto& s) { return s.first == values[r]; });
    if (it == seen.end()) {
      seen.push_back({values[r], {static_cast<int>(r)}});
    } else {
      it->second.push_back(static_cast<int>(r));
    }
  }
  std::ostringstream out;
  for (size_t i = 0; i < seen.size(); ++i) {
    out << (i == 0 ? "" : " but ") << seen[i].first << " on rank" << (seen[i].second.size() > 1 ? "s " : " ");
    for (size_t k = 0; k < seen[i].second.size(); ++k) out << (k ? ", " : "") << seen[i].second[k];
  }
  return out.str();
}

}  // namespace

std::string option_text(const c10::IValue& value) {
  if (value.isDouble()) {
    char buf[32];
    const auto [end, error] = std::to_chars(buf, buf + sizeof(buf), value.toDouble());
    return error == std::errc() ? std::string(buf, end) : c10::str(value.toDouble());
  }
  if (value.isInt()) return std::to_string(value.toInt());
  if (value.isBool()) return value.toBool() ? "true" : "false";
  if (value.isString()) return value.toStringRef();
  if (value.isNone()) return "None";
  if (value.isTuple() || value.isList()) {
    const auto items = value.isTuple() ? value.toTupleRef().elements().vec() : value.toListRef().vec();
    std::string out = "(";
    for (size_t i = 0; i < items.size(); ++i) out += (i ? ", " : "") + option_text(items[i]);
    return out + ")";
  }
  std::ostringstream out;
  out << value;
  return out.str();
}

uint64_t options_hash(const std::vector<GroupOptions>& groups) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the bytes of the encoded text
  for (const char c : encode(groups)) h = (h ^ static_cast<uint8_t>(c)) * 1099511628211ull;
  return h;
}

std::string options_disagreement(const std::vector<std::vector<GroupOptions>>& all) {
  const auto& first = all.front();
  for (size_t g = 0; g < first.size(); ++g) {
    std::vector<std::string> classes;
    for (const auto& rank : all) classes.push_back(g < rank.size() ? rank[g].optimizer : "(no group)");
    if (std::adjacent_find(classes.begin(), classes.end(), std::not_equal_to<>()) != classes.end()) {
      return "ranks disagree on param group " + std::to_string(g) + "'s optimizer: " + values_by_rank(classes);
    }
    // The options of one class: the same names in the same order on every rank.
    for (size_t k = 0; k < first[g].options.size(); ++k) {
      std::vector<std::string> values;
      for (const auto& rank : all) values.push_back(k < rank[g].options.size() ? rank[g].options[k].second : "(none)");
      if (std::adjacent_find(values.begin(), values.end(), std::not_equal_to<>()) != values.end()) {
        return "ranks disagree on param group " + std::to_string(g) + "'s " + first[g].options[k].first + " (" +
               first[g].optimizer + "): " + values_by_rank(values);
      }
    }
  }
  for (size_t r = 1; r < all.size(); ++r) {
    if (all[r].size() != first.size()) {
      return "ranks disagree on the number of param groups: " + std::to_string(first.size()) + " on rank 0 but " +
             std::to_string(all[r].size()) + " on rank " + std::to_string(r);
    }
  }
  return "";
}

void check_options_alike(ProcessGroup& group, const std::vector<GroupOptions>& groups) {
  if (group.size() == 1) return;
  const std::string mine = encode(groups);
  const auto gathered = group.allgather_ints(std::vector<int64_t>(mine.begin(), mine.end()));
  std::vector<std::vector<GroupOptions>> all;
  for (const auto& v : gathered) all.push_back(decode(std::string(v.begin(), v.end())));
  const std::string message = options_disagreement(all);
  SHARDOPT_CHECK(message.empty(), "OSS: ", message,
                 "; every rank must build its optimizers alike (the same classes and options; a learning-rate "
                 "scheduler must change every rank's param_groups() alike)");
}

}  // namespace shardopt::detail
