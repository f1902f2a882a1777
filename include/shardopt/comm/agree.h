// Agreement: one check that every rank of a group holds the same values.
//
// Named fields go in; check() gathers every rank's fields and, when they differ, throws the same
// error on every rank, naming the first differing field, each value and the ranks that hold it:
//
//   Agreement("BalancedSampler")
//       .field("dataset_size", n)
//       .field("seed", seed)
//       .hint("every rank must pass the same dataset size and options")
//       .check(group);
//   // shardopt: BalancedSampler: ranks disagree on seed: 6 on ranks 0, 1 but 7 on rank 2; every ...
//
// A field holds one integer or a vector of them; `format` turns a field's values into text for
// the message (default: the integer, or "[a, b, ...]"). each() adds one field per element, named
// lazily (the names are built only for the message), for long per-parameter lists such as the
// trainable mask. Every rank must add the same fields in the same order: only the values differ.
//
// check(group, kHashFirst) first compares one 64-bit hash of all fields (a 16-byte all-reduce)
// and gathers the fields only when the hashes differ: for checks on the training path.
// check(store, ...) agrees through a c10d store, before a process group exists.
#pragma once

#include <shardopt/comm/process_group.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace c10d {
class Store;
}

namespace shardopt {

class Agreement {
 public:
  using Format = std::function<std::string(const std::vector<int64_t>&)>;
  enum class Mode { kExact, kHashFirst };

  // `context` starts the message ("OSS", "BalancedSampler"); may be empty.
  explicit Agreement(std::string context = "");

  Agreement& field(std::string name, int64_t value, Format format = nullptr);
  Agreement& field(std::string name, std::vector<int64_t> values, Format format = nullptr);
  // One field per element of `values`, element i named name_of(i); format sees one value.
  Agreement& each(std::vector<int64_t> values, std::function<std::string(size_t)> name_of, Format format = nullptr);
  // Appended to the message after "; ": what the user should do.
  Agreement& hint(std::string text);

  // Collective over `group`; throws on every rank when the ranks differ.
  void check(ProcessGroup& group, Mode mode = Mode::kExact) const;
  // Whether every rank of `group` has the same hash() (the 16-byte all-reduce alone; every rank
  // gets the same answer). Collective.
  bool agrees(ProcessGroup& group) const;
  // The same through a store shared by `world_size` ranks; `key` names this check (a counter
  // per rank keeps repeated checks under one key apart). Waits at most the store's timeout.
  void check(c10d::Store& store, const std::string& key, int rank, int world_size) const;

  // ---- the parts check() is made of ----
  // This rank's fields as one integer vector (what is gathered).
  std::vector<int64_t> encode() const;
  // A hash of encode(), the same on every rank for the same fields.
  uint64_t hash() const;
  // The error message for every rank's encode(), in rank order; "" when all agree.
  std::string disagreement(const std::vector<std::vector<int64_t>>& all) const;
  // The same over some ranks: all[i] is what rank ranks[i] sent.
  std::string disagreement(const std::vector<std::vector<int64_t>>& all, const std::vector<int>& ranks) const;

 private:
  struct Item {
    std::string name;
    std::function<std::string(size_t)> name_of;  // set for each()
    std::vector<int64_t> values;
    Format format;
  };
  size_t num_fields() const;
  std::string field_name(size_t field) const;
  std::string format(size_t field, const std::vector<int64_t>& values) const;

  std::string context_;
  std::string hint_;
  std::vector<Item> items_;
};

}  // namespace shardopt
