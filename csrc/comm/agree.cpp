#include <shardopt/comm/agree.h>
#include <shardopt/check.h>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <algorithm>
#include <chrono>
#include <thread>

#include <cstring>
#include <map>
#include <sstream>

namespace shardopt {

namespace {

std::string default_format(const std::vector<int64_t>& values) {
  if (values.size() == 1) return std::to_string(values[0]);
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < values.size(); ++i) {
    if (i == 8) {
      out << ", ... (" << values.size() << " values)";
      break;
    }
    out << (i ? ", " : "") << values[i];
  }
  out << "]";
  return out.str();
}

std::string rank_list(const std::vector<int>& ranks) {
  std::ostringstream out;
  out << (ranks.size() == 1 ? "rank " : "ranks ");
  const size_t shown = std::min<size_t>(ranks.size(), 8);
  for (size_t i = 0; i < shown; ++i) out << (i ? ", " : "") << ranks[i];
  if (shown < ranks.size()) out << " and " << ranks.size() - shown << " more";
  return out.str();
}

// Splits an encode() vector into its fields; empty optional-like result on a malformed vector.
bool decode(const std::vector<int64_t>& encoded, std::vector<std::vector<int64_t>>& fields) {
  fields.clear();
  if (encoded.empty() || encoded[0] < 0) return false;
  size_t pos = 1;
  for (int64_t f = 0; f < encoded[0]; ++f) {
    if (pos >= encoded.size() || encoded[pos] < 0) return false;
    const auto len = static_cast<size_t>(encoded[pos++]);
    if (pos + len > encoded.size()) return false;
    fields.emplace_back(encoded.begin() + static_cast<std::ptrdiff_t>(pos),
                        encoded.begin() + static_cast<std::ptrdiff_t>(pos + len));
    pos += len;
  }
  return pos == encoded.size();
}

std::vector<int64_t> to_ints(const std::string& bytes) {
  std::vector<int64_t> v(bytes.size() / sizeof(int64_t));
  std::memcpy(v.data(), bytes.data(), v.size() * sizeof(int64_t));
  return v;
}

}  // namespace

Agreement::Agreement(std::string context) : context_(std::move(context)) {}

Agreement& Agreement::field(std::string name, int64_t value, Format format) {
  return field(std::move(name), std::vector<int64_t>{value}, std::move(format));
}

Agreement& Agreement::field(std::string name, std::vector<int64_t> values, Format format) {
  items_.push_back(Item{std::move(name), nullptr, std::move(values), std::move(format)});
  return *this;
}

Agreement& Agreement::each(std::vector<int64_t> values, std::function<std::string(size_t)> name_of, Format format) {
  SHARDOPT_CHECK(name_of, "Agreement::each needs a function that names element i");
  items_.push_back(Item{"", std::move(name_of), std::move(values), std::move(format)});
  return *this;
}

Agreement& Agreement::hint(std::string text) {
  hint_ = std::move(text);
  return *this;
}

size_t Agreement::num_fields() const {
  size_t n = 0;
  for (const auto& item : items_) n += item.name_of ? item.values.size() : 1;
  return n;
}

std::vector<int64_t> Agreement::encode() const {
  std::vector<int64_t> out{static_cast<int64_t>(num_fields())};
  for (const auto& item : items_) {
    if (item.name_of) {
      for (int64_t v : item.values) out.insert(out.end(), {1, v});
    } else {
      out.push_back(static_cast<int64_t>(item.values.size()));
      out.insert(out.end(), item.values.begin(), item.values.end());
    }
  }
  return out;
}

uint64_t Agreement::hash() const {
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the 64-bit words
  for (int64_t v : encode()) h = (h ^ static_cast<uint64_t>(v)) * 1099511628211ull;
  return h;
}

std::string Agreement::field_name(size_t field) const {
  for (const auto& item : items_) {
    const size_t n = item.name_of ? item.values.size() : 1;
    if (field < n) return item.name_of ? item.name_of(field) : item.name;
    field -= n;
  }
  return "field " + std::to_string(field);
}

std::string Agreement::format(size_t field, const std::vector<int64_t>& values) const {
  for (const auto& item : items_) {
    const size_t n = item.name_of ? item.values.size() : 1;
    if (field < n) return item.format ? item.format(values) : default_format(values);
    field -= n;
  }
  return default_format(values);
}

std::string Agreement::disagreement(const std::vector<std::vector<int64_t>>& all) const {
  std::vector<int> ranks(all.size());
  for (size_t r = 0; r < all.size(); ++r) ranks[r] = static_cast<int>(r);
  return disagreement(all, ranks);
}

std::string Agreement::disagreement(const std::vector<std::vector<int64_t>>& all, const std::vector<int>& ranks) const {
  const std::string prefix = (context_.empty() ? "" : context_ + ": ") + "ranks disagree on ";
  const std::string suffix = hint_.empty() ? "" : "; " + hint_;
  std::vector<std::vector<std::vector<int64_t>>> fields(all.size());
  size_t common = SIZE_MAX;
  for (size_t r = 0; r < all.size(); ++r) {
    TORCH_INTERNAL_ASSERT(decode(all[r], fields[r]), "Agreement: rank ", ranks[r], " sent a malformed field vector");
    common = std::min(common, fields[r].size());
  }
  for (size_t f = 0; f < common; ++f) {
    std::map<std::vector<int64_t>, std::vector<int>> holders;  // value -> ranks
    std::vector<const std::vector<int64_t>*> order;            // values in order of first holder
    for (size_t r = 0; r < all.size(); ++r) {
      auto& holding = holders[fields[r][f]];
      if (holding.empty()) order.push_back(&fields[r][f]);
      holding.push_back(ranks[r]);
    }
    if (order.size() == 1) continue;
    std::ostringstream out;
    out << prefix << field_name(f) << ": ";
    for (size_t k = 0; k < order.size(); ++k) {
      out << (k == 0 ? "" : k == 1 ? " but " : ", ") << format(f, *order[k]) << " on " << rank_list(holders[*order[k]]);
    }
    return out.str() + suffix;
  }
  std::map<size_t, std::vector<int>> counts;
  for (size_t r = 0; r < all.size(); ++r) counts[fields[r].size()].push_back(ranks[r]);
  if (counts.size() == 1) return "";
  std::ostringstream out;
  out << prefix << "the number of fields checked: ";
  size_t k = 0;
  for (const auto& [n, holding] : counts) out << (k++ == 0 ? "" : k == 2 ? " but " : ", ") << n << " on " << rank_list(holding);
  return out.str() + suffix;
}

bool Agreement::agrees(ProcessGroup& group) const {
  if (group.size() == 1) return true;
  // max(h) == -max(-h) exactly when every rank has the same h.
  const auto h = static_cast<int64_t>(hash() >> 1);
  at::Tensor t = at::tensor({h, -h}, at::kLong);
  group.allreduce(t, Reduction::kMax);
  const int64_t* v = t.data_ptr<int64_t>();
  return v[0] == -v[1];
}

void Agreement::check(ProcessGroup& group, Mode mode) const {
  if (group.size() == 1) return;
  if (mode == Mode::kHashFirst && agrees(group)) return;
  const std::string message = disagreement(group.allgather_ints(encode()));
  SHARDOPT_CHECK(message.empty(), message);
}

void Agreement::check(c10d::Store& store, const std::string& key, int rank, int world_size) const {
  if (world_size <= 1) return;
  const std::string base = "shardopt/agree/" + key + "/";
  // Each rank counts its own checks under `key`: the n-th check of every rank meets the n-th.
  const int64_t round = store.add(base + "round/" + std::to_string(rank), 1);
  const std::string at = base + std::to_string(round) + "/";
  const auto mine = encode();
  store.set(at + std::to_string(rank),
            std::vector<uint8_t>(reinterpret_cast<const uint8_t*>(mine.data()),
                                 reinterpret_cast<const uint8_t*>(mine.data() + mine.size())));
  std::vector<std::vector<int64_t>> all(static_cast<size_t>(world_size));
  std::string message;
  for (int r = 0; r < world_size && message.empty(); ++r) {
    std::vector<uint8_t> bytes;
    try {
      bytes = store.get(at + std::to_string(r));
    } catch (const std::exception& e) {
      SHARDOPT_CHECK(false, (context_.empty() ? "" : context_ + ": "), "rank ", rank, " of ", world_size,
                     " could not connect to its peers within ", store.getTimeout().count(), " ms: rank ", r,
                     " never reported its ", key, " (is it running, with the same world size and rendezvous?): ",
                     e.what());
    }
    all[r] = to_ints(std::string(bytes.begin(), bytes.end()));
    // Once a rank differs, the others are read as they come, each waited for briefly: with another
    // world size, a rank this one waits for may never come, and the disagreement is named at once
    // among the ranks that did.
    if (all[r] != mine) {
      std::vector<std::vector<int64_t>> seen(all.begin(), all.begin() + r + 1);
      std::vector<int> ranks(static_cast<size_t>(r) + 1);
      for (int k = 0; k <= r; ++k) ranks[k] = k;
      for (int k = r + 1; k < world_size; ++k) {
        if (k == rank) {
          seen.push_back(mine), ranks.push_back(k);
          continue;
        }
        try {
          store.wait({at + std::to_string(k)}, std::min<std::chrono::milliseconds>(store.getTimeout(),
                                                                                  std::chrono::seconds(2)));
          const auto more = store.get(at + std::to_string(k));
          seen.push_back(to_ints(std::string(more.begin(), more.end()))), ranks.push_back(k);
        } catch (const std::exception&) {
          // not there: named by the ranks that are
        }
      }
      message = disagreement(seen, ranks);
    }
  }
  if (message.empty()) message = disagreement(all);
  if (!message.empty()) {
    // Rank 0's process serves the store: it waits (at most the store's timeout) until every rank
    // has read what it needs, so that each raises this message rather than "store closed".
    store.add(at + "read", 1);
    if (rank == 0) {
      const auto deadline = std::chrono::steady_clock::now() + store.getTimeout();
      while (store.add(at + "read", 0) < world_size && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    }
  }
  SHARDOPT_CHECK(message.empty(), message);
}

}  // namespace shardopt
