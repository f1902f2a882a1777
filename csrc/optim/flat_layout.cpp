#include <shardopt/optim/flat_layout.h>
#include <shardopt/check.h>

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <deque>
#include <limits>
#include <sstream>

namespace shardopt {

namespace {

int64_t align_up(int64_t n, int64_t align) {
  return (n + align - 1) / align * align;
}

}  // namespace

LayoutParam LayoutParam::of(const at::Tensor& param, int owner, bool trainable) {
  LayoutParam p;
  p.device = param.device();
  p.dtype = param.scalar_type();
  p.numel = param.numel();
  p.owner = owner;
  p.trainable = trainable;
  return p;
}

FlatLayout FlatLayout::plan(const std::vector<LayoutParam>& params, int world_size, LayoutOptions options) {
  SHARDOPT_CHECK(world_size >= 1, "a flat layout needs world_size >= 1, got ", world_size);
  SHARDOPT_CHECK(options.align() >= 1, "layout align must be >= 1 element, got ", options.align());
  SHARDOPT_CHECK(options.bucket_bytes() >= 0, "layout bucket_bytes must be >= 0, got ", options.bucket_bytes());
  FlatLayout layout;
  layout.world_size_ = world_size;
  layout.options_ = options;
  const auto group_of = layout.make_groups(params);
  layout.place_pieces(params, group_of);
  layout.place_frozen(params, group_of);
  layout.cut_buckets(params);
  layout.cut_kept(params, group_of);
  layout.check_invariants();
  return layout;
}

std::vector<size_t> FlatLayout::make_groups(const std::vector<LayoutParam>& params) {
  std::vector<size_t> group_of(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& p = params[i];
    SHARDOPT_CHECK(p.owner >= 0 && p.owner < world_size_, "parameter ", i, " has owner ", p.owner,
                   ", outside [0, ", world_size_, ")");
    SHARDOPT_CHECK(p.numel >= 0, "parameter ", i, " has ", p.numel, " elements");
    const bool split = options_.split() && !p.whole;
    size_t g = 0;  // groups in order of first appearance
    while (g < groups_.size() &&
           (groups_[g].device != p.device || groups_[g].dtype != p.dtype || groups_[g].split != split)) {
      ++g;
    }
    if (g == groups_.size()) {
      FlatGroup group;
      group.device = p.device;
      group.dtype = p.dtype;
      group.split = split;
      group.rows = options_.split();
      group.world_size = world_size_;
      group.used.assign(world_size_, 0);
      groups_.push_back(std::move(group));
    }
    group_of[i] = g;
  }
  return group_of;
}

// The row buckets while plan() fills them: each parameter's place in its bucket, and how much of
// each bucket is filled, before the buckets' rows are sized and placed in the shards.
struct FlatLayout::RowDraft {
  struct Placed {
    size_t param;
    size_t row_bucket;
    int64_t start;  // in the row bucket's run (split), or in its owner's row (whole)
  };
  std::vector<Placed> placed;
  std::vector<int64_t> chunk;              // per row bucket of a split group: elements of its run
  std::vector<std::vector<int64_t>> fill;  // per row bucket of a whole-kind group: each row's elements

  // Opens a row bucket of group `g` in `layout`; returns its index.
  int64_t open(FlatLayout& layout, size_t g) {
    FlatBucket bucket;
    bucket.group = g;
    bucket.owner = -1;
    layout.row_buckets_.push_back(std::move(bucket));
    chunk.push_back(0);
    fill.emplace_back(layout.groups_[g].split ? 0 : layout.world_size_, 0);
    return static_cast<int64_t>(layout.row_buckets_.size() - 1);
  }
};

// The trainable run, in reverse parameter order: per owner (whole parameters), or as row buckets
// (a split layout): cut into equal rows (split groups), or with each owner's whole parameters in
// its row (whole-kind groups).
void FlatLayout::place_pieces(const std::vector<LayoutParam>& params, const std::vector<size_t>& group_of) {
  pieces_of_.assign(params.size(), {});
  place_per_owner(params, group_of);
  // Row buckets (Note [Row buckets]): the trainable run cut at parameter boundaries into buckets;
  // a split group's cut into one equal row per rank, a whole-kind group's parameters each in the
  // row of its owner (Note [Rows of whole parameters]).
  row_buckets_.clear();
  RowDraft draft;
  draft_split_rows(params, group_of, draft);
  draft_whole_rows(params, group_of, draft);
  place_rows(params, group_of, draft);
}

void FlatLayout::add_piece(const std::vector<LayoutParam>& params, const std::vector<size_t>& group_of, size_t i,
                           Range in_param, int owner, Range in_shard) {
  Piece piece;
  piece.param = i;
  piece.param_numel = params[i].numel;
  piece.in_param = in_param;
  piece.group = group_of[i];
  piece.owner = owner;
  piece.in_shard = in_shard;
  pieces_of_[i].push_back(pieces_.size());
  pieces_.push_back(piece);
}

// Whole parameters per owner (groups not in rows), padded to the longest shard.
void FlatLayout::place_per_owner(const std::vector<LayoutParam>& params, const std::vector<size_t>& group_of) {
  const int64_t align = options_.align();
  for (size_t i = params.size(); i-- > 0;) {
    if (!params[i].trainable || groups_[group_of[i]].rows) continue;
    int64_t& used = groups_[group_of[i]].used[params[i].owner];
    const int64_t begin = align_up(used, align);
    add_piece(params, group_of, i, {0, params[i].numel}, params[i].owner, {begin, begin + params[i].numel});
    used = begin + params[i].numel;
  }
  for (auto& group : groups_) {
    if (group.rows) continue;
    const int64_t longest = *std::max_element(group.used.begin(), group.used.end());
    group.shard_numel = align_up(std::max<int64_t>(1, longest), align);
  }
}

// Split groups: each parameter at the end of its group's open bucket, a new bucket when it would
// pass bucket_bytes.
void FlatLayout::draft_split_rows(const std::vector<LayoutParam>& params, const std::vector<size_t>& group_of,
                                  RowDraft& draft) {
  const int64_t align = options_.align();
  std::vector<int64_t> open(groups_.size(), -1);
  for (size_t i = params.size(); i-- > 0;) {
    if (!params[i].trainable || !groups_[group_of[i]].split) continue;
    const size_t g = group_of[i];
    const int64_t element_size = static_cast<int64_t>(c10::elementSize(params[i].dtype));
    int64_t& b = open[g];
    if (b >= 0 && options_.bucket_bytes() > 0) {
      const int64_t end = align_up(draft.chunk[b], align) + params[i].numel;
      if (end * element_size > options_.bucket_bytes()) b = -1;
    }
    if (b < 0) b = draft.open(*this, g);
    const int64_t start = align_up(draft.chunk[b], align);
    draft.chunk[b] = start + params[i].numel;
    draft.placed.push_back({i, static_cast<size_t>(b), start});
  }
}

// Whole-kind groups: a bucket at a time, each owner's row takes that owner's next parameters (in
// reverse order) while they fit in the bucket's share of one rank, or in its longest first
// parameter, whichever is larger (Note [Rows of whole parameters]).
void FlatLayout::draft_whole_rows(const std::vector<LayoutParam>& params, const std::vector<size_t>& group_of,
                                  RowDraft& draft) {
  const int64_t align = options_.align();
  for (size_t g = 0; g < groups_.size(); ++g) {
    if (!groups_[g].rows || groups_[g].split) continue;
    std::vector<std::deque<size_t>> queue(world_size_);
    for (size_t i = params.size(); i-- > 0;) {
      if (params[i].trainable && group_of[i] == g) queue[params[i].owner].push_back(i);
    }
    const int64_t element_size = static_cast<int64_t>(c10::elementSize(groups_[g].dtype));
    const int64_t share = options_.bucket_bytes() > 0 ? options_.bucket_bytes() / (element_size * world_size_)
                                                      : std::numeric_limits<int64_t>::max();
    for (;;) {
      int64_t first = -1;
      for (const auto& q : queue) {
        if (!q.empty()) first = std::max(first, params[q.front()].numel);
      }
      if (first < 0) break;
      const int64_t row = std::max(share, first);
      const int64_t b = draft.open(*this, g);
      for (int owner = 0; owner < world_size_; ++owner) {
        auto& q = queue[owner];
        int64_t& at = draft.fill[b][owner];
        for (bool empty = true; !q.empty() && (empty || align_up(at, align) + params[q.front()].numel <= row);
             empty = false) {
          const int64_t start = align_up(at, align);
          at = start + params[q.front()].numel;
          draft.placed.push_back({q.front(), static_cast<size_t>(b), start});
          q.pop_front();
        }
      }
    }
  }
}

// Sizes each row bucket's row, places the buckets one after another in their group's shard, and
// the drafted parameters' pieces in them.
void FlatLayout::place_rows(const std::vector<LayoutParam>& params, const std::vector<size_t>& group_of,
                            const RowDraft& draft) {
  const int64_t align = options_.align();
  std::vector<int64_t> run(groups_.size(), 0);  // elements of the row buckets so far, per group
  for (size_t b = 0; b < row_buckets_.size(); ++b) {
    FlatBucket& bucket = row_buckets_[b];
    const int64_t per_rank = groups_[bucket.group].split ? (draft.chunk[b] + world_size_ - 1) / world_size_
                                                         : *std::max_element(draft.fill[b].begin(), draft.fill[b].end());
    const int64_t row = align_up(std::max<int64_t>(1, per_rank), align);
    bucket.in_shard = {run[bucket.group], run[bucket.group] + row};
    run[bucket.group] += row;
  }
  for (size_t g = 0; g < groups_.size(); ++g) {
    if (groups_[g].rows) groups_[g].shard_numel = std::max<int64_t>(run[g], align);
  }
  for (const RowDraft::Placed& at_param : draft.placed) {
    const size_t i = at_param.param;
    FlatBucket& bucket = row_buckets_[at_param.row_bucket];
    const int64_t row = bucket.numel(), base = bucket.in_shard.begin;
    if (!groups_[bucket.group].split) {  // whole, in its owner's row
      const int owner = params[i].owner;
      const Range in_bucket{at_param.start, at_param.start + params[i].numel};
      add_piece(params, group_of, i, {0, params[i].numel}, owner, {base + in_bucket.begin, base + in_bucket.end});
      Piece& piece = pieces_.back();
      piece.bucket = static_cast<int64_t>(at_param.row_bucket);  // renumbered by cut_buckets()
      piece.in_bucket = in_bucket;
      int64_t& used = groups_[piece.group].used[owner];
      used = std::max(used, piece.in_shard.end);
      continue;
    }
    const int64_t first = at_param.start, end = first + params[i].numel;
    for (int64_t at = first; at < end || (at == end && at == first);) {
      const int owner = static_cast<int>(std::min<int64_t>(at / row, world_size_ - 1));
      const int64_t cut = std::min(end, (owner + 1) * row);
      add_piece(params, group_of, i, {at - first, cut - first}, owner,
                {base + at - owner * row, base + cut - owner * row});
      Piece& piece = pieces_.back();
      piece.bucket = static_cast<int64_t>(at_param.row_bucket);  // renumbered by cut_buckets()
      piece.in_bucket = {at - owner * row, cut - owner * row};
      groups_[piece.group].used[owner] = piece.in_shard.end;
      if (cut == at) break;  // an empty parameter: one empty piece
      at = cut;
    }
  }
  // Each row bucket's pieces in row order (row 0's, then row 1's, ...), each row's in its order:
  // for a split group the order they were placed.
  for (size_t k = 0; k < pieces_.size(); ++k) {
    if (pieces_[k].bucket >= 0) row_buckets_[pieces_[k].bucket].pieces.push_back(k);
  }
  for (auto& bucket : row_buckets_) {
    std::stable_sort(bucket.pieces.begin(), bucket.pieces.end(), [&](size_t a, size_t b) {
      const Piece &x = pieces_[a], &y = pieces_[b];
      return x.owner != y.owner ? x.owner < y.owner : x.in_bucket.begin < y.in_bucket.begin;
    });
    std::vector<int64_t> per_row(world_size_, 0);
    for (size_t k : bucket.pieces) bucket.row_pieces = std::max(bucket.row_pieces, ++per_row[pieces_[k].owner]);
    if (!groups_[bucket.group].split) {
      bucket.row_used.assign(world_size_, 0);
      for (size_t k : bucket.pieces) {
        int64_t& used = bucket.row_used[pieces_[k].owner];
        used = std::max(used, pieces_[k].in_bucket.end);
      }
    }
  }
}

// Frozen parameters, in reverse parameter order, after the shards: they never change, so they
// are neither bucketed nor synced.
void FlatLayout::place_frozen(const std::vector<LayoutParam>& params, const std::vector<size_t>& group_of) {
  for (size_t i = params.size(); i-- > 0;) {
    if (params[i].trainable) continue;
    Piece piece;
    piece.param = i;
    piece.param_numel = params[i].numel;
    piece.in_param = {0, params[i].numel};
    piece.group = group_of[i];
    int64_t& used = groups_[piece.group].frozen_numel;
    piece.in_frozen.begin = align_up(used, options_.align());
    piece.in_frozen.end = piece.in_frozen.begin + params[i].numel;
    used = piece.in_frozen.end;
    pieces_of_[i].push_back(pieces_.size());
    pieces_.push_back(piece);
  }
}

// One open bucket per (group, owner), walking the trainable parameters in reverse order; a split
// group's row buckets take their place in that order where their first parameter is.
void FlatLayout::cut_buckets(const std::vector<LayoutParam>& params) {
  std::vector<std::vector<int64_t>> open(groups_.size(), std::vector<int64_t>(world_size_, -1));
  std::vector<int64_t> row_bucket_at(row_buckets_.size(), -1);  // its index in buckets_
  for (size_t i = params.size(); i-- > 0;) {
    if (!params[i].trainable) continue;
    const int64_t element_size = static_cast<int64_t>(c10::elementSize(params[i].dtype));
    for (size_t index : pieces_of_[i]) {
      Piece& piece = pieces_[index];
      if (groups_[piece.group].rows) {
        int64_t& at = row_bucket_at[static_cast<size_t>(piece.bucket)];
        if (at < 0) {
          at = static_cast<int64_t>(buckets_.size());
          buckets_.push_back(std::move(row_buckets_[static_cast<size_t>(piece.bucket)]));
        }
        piece.bucket = at;
        continue;
      }
      int64_t& b = open[piece.group][piece.owner];
      if (b >= 0) {
        const int64_t bytes = (piece.in_shard.end - buckets_[b].in_shard.begin) * element_size;
        if (options_.bucket_bytes() == 0 || bytes > options_.bucket_bytes()) b = -1;
      }
      if (b < 0) {
        FlatBucket bucket;
        bucket.group = piece.group;
        bucket.owner = piece.owner;
        bucket.in_shard = {piece.in_shard.begin, piece.in_shard.begin};
        b = static_cast<int64_t>(buckets_.size());
        buckets_.push_back(std::move(bucket));
      }
      FlatBucket& bucket = buckets_[b];
      TORCH_INTERNAL_ASSERT(piece.in_shard.begin >= bucket.in_shard.end, "bucket ", b, " would overlap itself");
      bucket.in_shard.end = piece.in_shard.end;
      bucket.pieces.push_back(index);
      piece.bucket = b;
      piece.in_bucket = {piece.in_shard.begin - bucket.in_shard.begin, piece.in_shard.end - bucket.in_shard.begin};
    }
  }
}

// Note [Kept state]
// A frozen parameter's optimizer state waits for it to be unfrozen. Left with the ranks that
// owned it while it trained, it piles up where the frozen layers happened to be (freezing half of
// GPT-2 small at world 4 left two ranks with about three times the state of the other two:
// docs/benchmarks-log.md). In split mode the
// frozen parameters with state form a kept run per group (reverse parameter order, as the
// trainable run), cut into world_size equal ranges: every rank keeps 1/world_size of the kept
// state and steps 1/world_size of the trainable run, so memory and step time are both balanced;
// the price is moving the kept state once, when the trainable set changes.
void FlatLayout::cut_kept(const std::vector<LayoutParam>& params, const std::vector<size_t>& group_of) {
  kept_.assign(params.size(), {});
  // A whole-kind group's frozen parameters keep their state with their owner (the partition
  // spreads them, as for whole parameters).
  auto in_run = [&](size_t i) { return !params[i].trainable && params[i].keeps_state && groups_[group_of[i]].split; };
  // Aligned as the trainable run is: each parameter starts, and each range is cut, at a multiple of
  // `align` elements, so every cut in a parameter is at a multiple of `align` of it.
  const int64_t align = options_.align();
  std::vector<int64_t> run(groups_.size(), 0), start(params.size(), 0);
  for (size_t i = params.size(); i-- > 0;) {
    if (!in_run(i)) continue;
    start[i] = align_up(run[group_of[i]], align);
    run[group_of[i]] = start[i] + params[i].numel;
  }
  for (size_t i = params.size(); i-- > 0;) {
    if (!in_run(i)) continue;
    const int64_t per_rank = align_up(std::max<int64_t>(1, (run[group_of[i]] + world_size_ - 1) / world_size_), align);
    const int64_t end = start[i] + params[i].numel;
    int64_t at = start[i];
    do {
      const int rank = static_cast<int>(std::min<int64_t>(at / per_rank, world_size_ - 1));
      const int64_t cut = std::min(end, (rank + 1) * per_rank);
      kept_[i].push_back({rank, {at - start[i], cut - start[i]}});
      at = cut;
    } while (at < end);
  }
}

void FlatLayout::check_invariants() const {
  for (const auto& piece : pieces_) {
    const auto& group = groups_[piece.group];
    if (piece.owner < 0) {
      TORCH_INTERNAL_ASSERT(piece.bucket < 0 && piece.in_frozen.end <= group.frozen_numel, "frozen piece of parameter ",
                            piece.param, " lies outside the frozen region");
      continue;
    }
    TORCH_INTERNAL_ASSERT(piece.in_shard.begin >= 0 && piece.in_shard.end <= group.shard_numel,
                          "piece of parameter ", piece.param, " lies outside its shard");
    TORCH_INTERNAL_ASSERT(piece.bucket >= 0, "trainable piece of parameter ", piece.param, " is in no bucket");
    const auto& bucket = buckets_[piece.bucket];
    TORCH_INTERNAL_ASSERT((bucket.owner == piece.owner || (bucket.rows() && group.rows)) && bucket.group == piece.group &&
                              piece.in_bucket.begin + bucket.in_shard.begin == piece.in_shard.begin &&
                              piece.in_bucket.end <= bucket.numel(),
                          "piece of parameter ", piece.param, " does not lie in its bucket ", piece.bucket);
  }
  for (size_t i = 0; i < pieces_of_.size(); ++i) {
    const auto& list = pieces_of_[i];
    TORCH_INTERNAL_ASSERT(!list.empty(), "parameter ", i, " has no piece");
    TORCH_INTERNAL_ASSERT(pieces_[list.front()].in_param.begin == 0 &&
                              pieces_[list.back()].in_param.end == pieces_[list.front()].param_numel,
                          "the pieces of parameter ", i, " do not cover it");
    const Range first = in_buffer(pieces_[list.front()]);
    TORCH_INTERNAL_ASSERT(first.begin % options_.align() == 0, "parameter ", i, " is not aligned");
    for (size_t k = 1; k < list.size(); ++k) {
      TORCH_INTERNAL_ASSERT(pieces_[list[k]].in_param.begin == pieces_[list[k - 1]].in_param.end &&
                                in_buffer(pieces_[list[k]]).begin == in_buffer(pieces_[list[k - 1]]).end,
                            "the pieces of parameter ", i, " are not adjacent");
    }
  }
}

Range FlatLayout::in_buffer(const Piece& piece) const {
  const auto& group = groups_.at(piece.group);
  if (piece.owner < 0) {
    const int64_t base = group.shards_in_buffer().end;
    return {base + piece.in_frozen.begin, base + piece.in_frozen.end};
  }
  if (group.rows) {  // row `owner` of its row bucket (Note [Row buckets])
    const FlatBucket& bucket = buckets_.at(static_cast<size_t>(piece.bucket));
    const int64_t base = bucket.rows_in_buffer(world_size_).begin + piece.owner * bucket.numel();
    return {base + piece.in_bucket.begin, base + piece.in_bucket.end};
  }
  const int64_t base = group.shard_in_buffer(piece.owner).begin;
  return {base + piece.in_shard.begin, base + piece.in_shard.end};
}

Range FlatLayout::param_in_buffer(size_t param) const {
  const auto& list = pieces_of_.at(param);
  return {in_buffer(pieces_[list.front()]).begin, in_buffer(pieces_[list.back()]).end};
}

bool FlatLayout::holds_piece_of(size_t bucket, int rank) const {
  const FlatBucket& b = buckets_.at(bucket);
  if (!b.rows()) return b.owner == rank;
  return std::any_of(b.pieces.begin(), b.pieces.end(), [&](size_t k) { return pieces_[k].owner == rank; });
}

std::vector<int> FlatLayout::owners_of(size_t param) const {
  std::vector<int> owners;
  for (size_t k : pieces_of_.at(param)) {
    if (pieces_[k].owner >= 0) owners.push_back(pieces_[k].owner);
  }
  return owners;
}

double FlatLayout::imbalance() const {
  std::vector<int64_t> bytes(world_size_, 0);
  int64_t total = 0;
  for (const auto& piece : pieces_) {
    if (piece.owner < 0) continue;
    const int64_t b = piece.in_param.size() * static_cast<int64_t>(c10::elementSize(groups_[piece.group].dtype));
    bytes[piece.owner] += b;
    total += b;
  }
  if (total == 0) return 0.0;
  return static_cast<double>(*std::max_element(bytes.begin(), bytes.end())) * world_size_ / total - 1.0;
}

bool FlatLayout::same_placement(const FlatLayout& other) const {
  if (world_size_ != other.world_size_ || pieces_.size() != other.pieces_.size() ||
      groups_.size() != other.groups_.size() || pieces_of_ != other.pieces_of_) {
    return false;
  }
  for (size_t g = 0; g < groups_.size(); ++g) {
    const auto &a = groups_[g], &b = other.groups_[g];
    if (a.device != b.device || a.dtype != b.dtype || a.split != b.split || a.rows != b.rows || a.shard_numel != b.shard_numel ||
        a.frozen_numel != b.frozen_numel) {
      return false;
    }
  }
  for (size_t k = 0; k < pieces_.size(); ++k) {
    const auto &a = pieces_[k], &b = other.pieces_[k];
    if (a.param != b.param || a.in_param != b.in_param || a.group != b.group || a.owner != b.owner ||
        a.in_shard != b.in_shard || a.in_frozen != b.in_frozen || in_buffer(a) != other.in_buffer(b)) {
      return false;
    }
  }
  return true;
}

std::string FlatLayout::describe() const {
  std::ostringstream out;
  for (size_t g = 0; g < groups_.size(); ++g) {
    const auto& group = groups_[g];
    out << "group " << g << " (" << group.device << ", " << group.dtype << "): " << world_size_
        << (group.split ? " equal ranges" : group.rows ? " rows of whole parameters" : " whole-parameter shards") << " of " << group.shard_numel
        << " elements, used";
    for (int64_t u : group.used) out << " " << u;
    out << "; frozen " << group.frozen_numel << "\n";
  }
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const auto& bucket = buckets_[b];
    out << "bucket " << b << ": group " << bucket.group << ", "
        << (bucket.rows() ? std::string("rows") : "owner " + std::to_string(bucket.owner)) << ", shard ["
        << bucket.in_shard.begin << ", " << bucket.in_shard.end << "), " << bucket.pieces.size() << " pieces\n";
  }
  return out.str();
}

}  // namespace shardopt
