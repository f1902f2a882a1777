#include <shardopt/data/sampler.h>
#include <shardopt/check.h>

#include <shardopt/comm/agree.h>
#include <shardopt/comm/process_group.h>

#include <c10/util/Exception.h>

#include <algorithm>
#include <numeric>
#include <string>

namespace shardopt {

namespace {

// Sizes and positions stay below 2^62, so position + G never overflows int64.
constexpr int64_t kMaxSize = int64_t{1} << 62;

// ---- counter-based randomness -------------------------------------------------------------
// Note [Reproducible randomness]
// Everything random here is a pure function of 64-bit integers built from SplitMix64's
// finalizer: no std:: engine or distribution (their output differs between standard
// libraries), no state carried between calls. The same (seed, epoch) gives the same sequence
// on every rank, compiler and platform.

constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ULL;

uint64_t mix64(uint64_t z) {
  z += kGolden;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// A key for a sub-stream `tag` of `key`.
uint64_t derive(uint64_t key, uint64_t tag) {
  return mix64(key ^ mix64(tag));
}

// Stream tags, so that no two uses of a key share randomness.
constexpr uint64_t kTagEpoch = 1;
constexpr uint64_t kTagChunkOrder = 2;
constexpr uint64_t kTagWindow = 3;

// Rows of window w (plain data: the single window 0) are permuted under this key.
uint64_t window_key(uint64_t epoch_key, int64_t window) {
  return derive(derive(epoch_key, kTagWindow), static_cast<uint64_t>(window));
}

struct SplitMix64 {
  uint64_t state;
  uint64_t next() { return mix64(state += kGolden); }
  // Uniform in [0, n), n >= 1, without modulo bias: the values below 2^64 mod n are rejected,
  // which leaves a range whose length is a multiple of n.
  uint64_t below(uint64_t n) {
    const uint64_t reject_below = (0 - n) % n;  // 2^64 mod n
    uint64_t x = next();
    while (x < reject_below) x = next();
    return x % n;
  }
};

// ---- keyed permutation of [0, n) --------------------------------------------------------------
// Note [Feistel permutation]
// A bijection of [0, 2^k) (2^k the smallest power of two >= n, k >= 2) built from 12 to 24
// unbalanced Feistel rounds; each round splits x into a low part of `lo` bits and a high part of
// `hi` bits, adds a keyed hash of the low part to the high part modulo 2^hi, and rotates the
// parts (x' = lo_part * 2^hi + new_high), so the roles alternate. Each round is invertible,
// hence so is the network. Addition (not XOR) makes single rounds odd or even permutations
// depending on the key, so the network is not confined to the even permutations.
// Cycle-walking restricts it to [0, n): apply it again while the result is >= n. Because the
// domain is less than 2n, a walk takes fewer than two network evaluations on average; it
// always ends, since the cycle through x returns to x < n. If the network were a uniformly
// random permutation of [0, 2^k), the walked one would be uniform on [0, n).
class Permutation {
 public:
  static constexpr int kMaxRounds = 24;

  Permutation(uint64_t n, uint64_t key) : n_(n) {
    int bits = 2;
    while (bits < 62 && (uint64_t{1} << bits) < n) ++bits;
    lo_bits_ = bits - bits / 2;
    hi_bits_ = bits / 2;
    // Tiny domains need more rounds to come close to uniform (measured over seeds: with 8 or 12
    // rounds the 120 orders of 5 elements are visibly skewed, with 24 they are not). From 2^9
    // on, 12 rounds (three times the 4 of Luby-Rackoff) show no skew in the position-by-sample
    // table for N up to 600.
    rounds_ = bits <= 8 ? kMaxRounds : 12;
    SplitMix64 rng{key};
    for (int r = 0; r < rounds_; ++r) round_key_[r] = rng.next();
  }

  uint64_t operator()(uint64_t x) const {
    if (n_ <= 1) return x;
    do {
      x = network(x);
    } while (x >= n_);
    return x;
  }

 private:
  uint64_t network(uint64_t x) const {
    int lo_bits = lo_bits_;
    int hi_bits = hi_bits_;
    for (int r = 0; r < rounds_; ++r) {
      const uint64_t lo = x & ((uint64_t{1} << lo_bits) - 1);
      const uint64_t hi = x >> lo_bits;
      const uint64_t new_hi = (hi + mix64(round_key_[r] ^ lo)) & ((uint64_t{1} << hi_bits) - 1);
      x = (lo << hi_bits) | new_hi;
      std::swap(lo_bits, hi_bits);
    }
    return x;
  }

  uint64_t n_;
  int lo_bits_ = 1;
  int hi_bits_ = 1;
  int rounds_ = kMaxRounds;
  uint64_t round_key_[kMaxRounds];
};

uint64_t fingerprint_of(int64_t dataset_size, const SamplerOptions& o) {
  uint64_t h = mix64(0x5348415244535031ULL);  // "SHARDSP1"
  auto add = [&h](uint64_t v) { h = mix64(h ^ v); };
  add(static_cast<uint64_t>(dataset_size));
  add(o.shuffle() ? 1 : 0);
  add(o.seed());
  add(o.tail() == Tail::kPad ? 0 : 1);
  add(o.chunk_sizes().size());
  if (!o.chunk_sizes().empty()) {
    add(static_cast<uint64_t>(o.window_chunks()));
    for (int64_t s : o.chunk_sizes()) add(static_cast<uint64_t>(s));
  }
  return h;
}

const char* tail_name(Tail t) {
  return t == Tail::kPad ? "kPad" : "kDrop";
}

// The group constructor compares these on every rank before anything else can throw, so that a
// rank with bad options cannot leave the others waiting in a collective.
SamplerOptions agreed_options(int64_t dataset_size, const ProcessGroup& const_group, SamplerOptions options) {
  // The collectives update the group's traffic counters; the group itself is not changed.
  auto& group = const_cast<ProcessGroup&>(const_group);
  uint64_t chunk_hash = 0;
  for (int64_t s : options.chunk_sizes()) chunk_hash = mix64(chunk_hash ^ static_cast<uint64_t>(s));
  Agreement("BalancedSampler")
      .field("dataset_size", dataset_size)
      .field("batch_size", options.batch_size())
      .field("shuffle", options.shuffle() ? 1 : 0)
      .field("seed", static_cast<int64_t>(options.seed()))
      .field("tail", options.tail() == Tail::kPad ? 0 : 1,
             [](const std::vector<int64_t>& v) { return std::string(tail_name(v[0] ? Tail::kDrop : Tail::kPad)); })
      .field("window_chunks", options.window_chunks())
      .field("the number of chunk_sizes", static_cast<int64_t>(options.chunk_sizes().size()))
      .field("chunk_sizes (hash)", static_cast<int64_t>(chunk_hash))
      .hint("every rank must pass the same dataset size and options")
      .check(group);
  return options;
}

}  // namespace

// ---- resolving positions ----------------------------------------------------------------------

// Maps sequence positions (in [0, N)) to sample indices. Keeps the window of the last position,
// so a run of positions inside one window costs one binary search over that window's chunks each.
struct BalancedSampler::Cursor {
  explicit Cursor(const BalancedSampler& s)
      : s(s), perm(static_cast<uint64_t>(s.dataset_size_), window_key(s.epoch_key_, 0)) {}

  int64_t index(int64_t position) {
    if (s.visit_chunk_.empty()) {  // plain data: one window over [0, N)
      return s.options_.shuffle() ? static_cast<int64_t>(perm(static_cast<uint64_t>(position))) : position;
    }
    if (position < window_first || position >= window_end) enter_window_of(position);
    int64_t q = position;
    if (s.options_.shuffle())
      q = window_first + static_cast<int64_t>(perm(static_cast<uint64_t>(position - window_first)));
    // The visit slot holding q: the last slot of this window whose first position is <= q.
    const auto first = s.visit_begin_.begin() + slot_first;
    const auto last = s.visit_begin_.begin() + slot_end;
    const int64_t slot = (std::upper_bound(first, last, q) - s.visit_begin_.begin()) - 1;
    return s.chunk_begin_[s.visit_chunk_[slot]] + (q - s.visit_begin_[slot]);
  }

  void enter_window_of(int64_t position) {
    const auto& vb = s.visit_begin_;
    const int64_t chunks = static_cast<int64_t>(s.visit_chunk_.size());
    const int64_t slot = (std::upper_bound(vb.begin(), vb.end(), position) - vb.begin()) - 1;
    const int64_t window = slot / s.options_.window_chunks();
    slot_first = window * s.options_.window_chunks();
    slot_end = std::min(slot_first + s.options_.window_chunks(), chunks);
    window_first = vb[slot_first];
    window_end = vb[slot_end];
    perm = Permutation(static_cast<uint64_t>(window_end - window_first), window_key(s.epoch_key_, window));
  }

  const BalancedSampler& s;
  Permutation perm;
  int64_t slot_first = 0, slot_end = 0;       // visit slots of the current window
  int64_t window_first = 0, window_end = -1;  // its positions; empty until the first lookup
};

// ---- BalancedSampler --------------------------------------------------------------------------

BalancedSampler::BalancedSampler(int64_t dataset_size, int rank, int world_size, SamplerOptions options)
    : dataset_size_(dataset_size), rank_(rank), world_size_(world_size), options_(std::move(options)) {
  SHARDOPT_CHECK(dataset_size >= 0, "BalancedSampler: dataset_size must be >= 0, got ", dataset_size);
  SHARDOPT_CHECK(dataset_size <= kMaxSize, "BalancedSampler: dataset_size must be at most 2^62 = ", kMaxSize,
              ", got ", dataset_size);
  SHARDOPT_CHECK(world_size >= 1, "BalancedSampler: world_size must be >= 1, got ", world_size);
  SHARDOPT_CHECK(rank >= 0 && rank < world_size,
              "BalancedSampler: rank must be in [0, world_size = ", world_size, "), got ", rank);
  const int64_t b = options_.batch_size();
  SHARDOPT_CHECK(b >= 1, "BalancedSampler: batch_size must be >= 1, got ", b);
  SHARDOPT_CHECK(b <= kMaxSize / world_size, "BalancedSampler: world_size * batch_size = ", world_size, " * ", b,
              " exceeds 2^62");
  SHARDOPT_CHECK(options_.window_chunks() >= 1, "BalancedSampler: window_chunks must be >= 1, got ",
              options_.window_chunks());

  const auto& sizes = options_.chunk_sizes();
  if (!sizes.empty()) {
    chunk_begin_.resize(sizes.size() + 1);
    chunk_begin_[0] = 0;
    for (size_t c = 0; c < sizes.size(); ++c) {
      SHARDOPT_CHECK(sizes[c] >= 1, "BalancedSampler: chunk_sizes[", c, "] must be >= 1 (no empty or ",
                  "negative chunks), got ", sizes[c]);
      SHARDOPT_CHECK(sizes[c] <= kMaxSize - chunk_begin_[c],
                  "BalancedSampler: chunk_sizes sum to more than 2^62");
      chunk_begin_[c + 1] = chunk_begin_[c] + sizes[c];
    }
    SHARDOPT_CHECK(chunk_begin_.back() == dataset_size, "BalancedSampler: chunk_sizes (", sizes.size(),
                " chunks) sum to ", chunk_begin_.back(), " but dataset_size is ", dataset_size);
  }

  global_batch_ = static_cast<int64_t>(world_size) * b;
  steps_ =
      options_.tail() == Tail::kPad ? (dataset_size + global_batch_ - 1) / global_batch_ : dataset_size / global_batch_;
  fingerprint_ = fingerprint_of(dataset_size, options_);
  set_epoch(0);
}

BalancedSampler::BalancedSampler(int64_t dataset_size, const ProcessGroup& group, SamplerOptions options)
    : BalancedSampler(dataset_size, group.rank(), group.size(),
                      agreed_options(dataset_size, group, std::move(options))) {}

int64_t BalancedSampler::steps_per_epoch() const {
  return steps_;
}

void BalancedSampler::set_epoch(int64_t epoch) {
  SHARDOPT_CHECK(epoch >= 0, "BalancedSampler: epoch must be >= 0, got ", epoch);
  epoch_ = epoch;
  epoch_key_ = derive(derive(options_.seed(), kTagEpoch), static_cast<uint64_t>(epoch));
  if (chunk_begin_.empty()) return;

  // Visit order: an unbiased Fisher-Yates shuffle of the chunks (chunk-sized memory is allowed).
  const int64_t chunks = static_cast<int64_t>(chunk_begin_.size()) - 1;
  visit_chunk_.resize(chunks);
  std::iota(visit_chunk_.begin(), visit_chunk_.end(), int64_t{0});
  if (options_.shuffle()) {
    SplitMix64 rng{derive(epoch_key_, kTagChunkOrder)};
    for (int64_t i = chunks - 1; i > 0; --i) {
      std::swap(visit_chunk_[i], visit_chunk_[rng.below(static_cast<uint64_t>(i + 1))]);
    }
  }
  visit_begin_.resize(chunks + 1);
  visit_begin_[0] = 0;
  for (int64_t v = 0; v < chunks; ++v) {
    const int64_t c = visit_chunk_[v];
    visit_begin_[v + 1] = visit_begin_[v] + (chunk_begin_[c + 1] - chunk_begin_[c]);
  }
  last_window_begin_ = visit_begin_[((chunks - 1) / options_.window_chunks()) * options_.window_chunks()];
}

Batch BalancedSampler::batch(int64_t step) const {
  SHARDOPT_CHECK(step >= 0 && step < steps_, "BalancedSampler: step ", step,
              " is outside the epoch: steps_per_epoch() is ", steps_, " (dataset_size ", dataset_size_,
              ", world_size * batch_size = ", global_batch_, ", tail ", tail_name(options_.tail()), ")");
  const int64_t b = options_.batch_size();
  const int64_t step_first = step * global_batch_;
  const int64_t first = step_first + rank_ * b;
  Batch out;
  out.indices.resize(b);
  out.real.resize(b);
  out.global_real = std::min(global_batch_, dataset_size_ - step_first);
  Cursor cursor(*this);
  // Padding entries repeat real positions from the end of the sequence, walking backwards inside
  // the last window: a chunked reader already holds those chunks.
  const int64_t last_window_length = dataset_size_ - last_window_begin_;
  for (int64_t i = 0; i < b; ++i) {
    const int64_t p = first + i;
    const bool real = p < dataset_size_;
    const int64_t q = real ? p : dataset_size_ - 1 - (p - dataset_size_) % last_window_length;
    out.indices[i] = cursor.index(q);
    out.real[i] = real ? 1 : 0;
  }
  return out;
}

SamplerState BalancedSampler::state(int64_t next_step) const {
  SHARDOPT_CHECK(next_step >= 0 && next_step <= steps_, "BalancedSampler::state: next_step must be in [0, ",
              steps_, "] (steps_per_epoch()), got ", next_step);
  SamplerState s;
  s.fingerprint = fingerprint_;
  s.dataset_size = dataset_size_;
  s.global_batch_size = global_batch_;
  s.epoch = epoch_;
  s.next_step = next_step;
  return s;
}

std::array<int64_t, 6> SamplerState::to_fields() const {
  return {version, static_cast<int64_t>(fingerprint), dataset_size, global_batch_size, epoch, next_step};
}

SamplerState SamplerState::from_fields(const std::array<int64_t, 6>& f) {
  SamplerState s;
  s.version = f[0];
  s.fingerprint = static_cast<uint64_t>(f[1]);
  s.dataset_size = f[2];
  s.global_batch_size = f[3];
  s.epoch = f[4];
  s.next_step = f[5];
  return s;
}

void BalancedSampler::restore(const SamplerState& s) {
  SHARDOPT_CHECK(s.version == SamplerState::kVersion, "BalancedSampler::restore: state format version ",
              s.version, " is not supported (this build reads version ", SamplerState::kVersion, ")");
  SHARDOPT_CHECK(s.dataset_size == dataset_size_, "BalancedSampler::restore: the state is for a dataset of ",
              s.dataset_size, " samples, this sampler has ", dataset_size_);
  SHARDOPT_CHECK(s.fingerprint == fingerprint_, "BalancedSampler::restore: the state's fingerprint ",
              s.fingerprint, " does not match this sampler's ", fingerprint_,
              ": the dataset (chunk_sizes) or the options (shuffle, seed, tail, window_chunks) differ");
  SHARDOPT_CHECK(s.global_batch_size == global_batch_, "BalancedSampler::restore: the state was taken at ",
              "world_size * batch_size = ", s.global_batch_size, ", this sampler has ", world_size_, " * ",
              options_.batch_size(), " = ", global_batch_, "; resuming needs the same global batch size");
  SHARDOPT_CHECK(s.next_step >= 0 && s.next_step <= steps_, "BalancedSampler::restore: next_step ", s.next_step,
              " is outside [0, ", steps_, "]");
  set_epoch(s.epoch);
}

}  // namespace shardopt
