// FlatLayout: where every parameter's elements live in the flat buffers, decided once.
//
// One layout covers the parameters of one OSS. Each (device, dtype) group has one flat buffer:
// first its trainable run, cut into world_size equal shards, one per owner rank, then its
// frozen region. The trainable parameters of each shard are cut into gradient buckets. The same
// map serves every buffer indexed by it: the parameter buffer OSS syncs after the step (the
// parameters are views of it; only the shards change, so only they are synced), the gradient
// buckets ShardedDDP reduces to their owners, and any per-shard buffer an owner keeps
// (optimizer state, master weights).
//
// Two ways to cut the trainable run into shards:
//   whole parameters (default)  each parameter lies in the shard of its owner (LayoutParam::
//                               owner, from the Partition); shards are padded to the longest.
//                               A bucket is a range of one owner's shard: one reduce to that
//                               owner and one broadcast from it per bucket.
//   split (LayoutOptions::split) row buckets (Note [Row buckets]): the run is cut at parameter
//                               boundaries into buckets, and each bucket into world_size rows of
//                               equal size that ignore parameter boundaries (Megatron-Core's
//                               bucket ranges, DeepSpeed's flat partitions): a parameter may be
//                               cut into pieces with different owners, and each rank owns
//                               1/world_size of every bucket. One reduce-scatter and one
//                               all-gather per bucket, whatever the world size. Only for
//                               element-wise optimizers; parameters marked `whole` (a
//                               whole-tensor optimizer's) form groups of their own, whose row
//                               buckets hold each parameter whole in its owner's row (Note
//                               [Rows of whole parameters]).
//
// Note [Row buckets]
// A row bucket b of a split group has rows of R_b elements (R_b = the bucket's elements / world
// size, rounded up to `align`), one per rank. In the flat buffer its rows lie together, row 0 to
// row world_size - 1, so the bucket is one contiguous range: the buffer of a reduce-scatter and
// an all-gather (Note [Rows] in csrc/comm/rows.cpp). In a rank's shard its rows follow each other
// in bucket order, so everything a rank owns (its state, its masters) is one contiguous range:
//   in_shard  = R_0 + ... + R_(b-1) + in_bucket      (FlatBucket::in_shard is that range)
//   in_buffer = world_size * (R_0 + ... + R_(b-1)) + owner * R_b + in_bucket
// A parameter's pieces are adjacent in the buffer (row r ends where row r + 1 begins), so it stays
// one view. Every rank's share of each bucket is within `align` elements of 1/world_size, so the
// balance holds for any trainable set without moving owners. A bucket closes before its elements
// would pass `bucket_bytes` (0: one bucket for the whole run); a parameter larger than that is a
// bucket of its own.
//
// Note [Rows of whole parameters]
// A whole-tensor optimizer (Muon) steps each matrix on one rank, so its parameters cannot be cut
// into equal rows; one bucket per owner would cost two collectives per owner and step, a count
// that grows with the world size. In a split layout they form row buckets too, each parameter
// whole in the row of its owner (the partition's, balanced by update cost), a bucket at a time:
// each owner's row takes that owner's next parameters, in reverse parameter order, while they fit
// in the bucket's row length, the larger of its share of one rank (bucket_bytes / world_size) and
// the longest parameter any owner has next. Rows are as long as the bucket's longest, so shorter
// rows carry padding: memory in the parameter buffer, and bytes on the wire, that a bucket per
// owner does not have (docs/benchmarks-log.md measures it). In return every bucket is one
// reduce-scatter and one all-gather, the same executor and sync as the element-wise rows, and
// the count is bounded by the parameters' bytes over bucket_bytes, never by the world size.
//
// Frames. Every offset says what it is relative to, in its name:
//   in_param   elements of the parameter (its flattened view)
//   in_shard   the owner's shard of the group
//   in_bucket  the bucket: its range of the owner's shard, or the owner's row of a row bucket
//   in_frozen  the group's frozen region (frozen parameters, owner -1)
//   in_buffer  the group's whole flat buffer: owner * shard_numel + in_shard (whole
//              parameters), the row's place (above, row buckets), or
//              world_size * shard_numel + in_frozen
//
// Order (Note [Bucket order]). The trainable run holds the trainable parameters in reverse
// parameter order (roughly the order backward produces their gradients); whole-parameter shards
// keep that order within each owner. Buckets are made walking the pieces of the trainable run in
// that order, one open bucket per (group, owner), or per group for row buckets; a bucket closes
// before it would pass `bucket_bytes` (rows of whole parameters: Note [Rows of whole
// parameters], each owner's row in that order). Their order in buckets() is the order every rank
// launches them in. Each parameter starts at a multiple of `align` elements; the gaps belong to the bucket
// they fall in.
//
// Pieces. A parameter is placed as pieces, each a contiguous range of its elements with one
// owner; a parameter's pieces are adjacent in the buffer, so the parameter stays one view.
//
// Kept state (Note [Kept state]). A frozen parameter's optimizer state is kept for when it is
// unfrozen. In split mode the frozen parameters that have state (LayoutParam::keeps_state) form
// each group's kept run, in reverse parameter order, cut into world_size equal ranges like the
// trainable run: rank r keeps range r. keepers_of() says who keeps which elements. Whole
// parameters keep their state with their owner (the Partition spreads frozen ones).
//
// plan() is a pure function of its inputs: every rank computes the same layout. A change of the
// trainable set or of the owners produces a new layout; nothing patches an old one.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <torch/arg.h>

#include <cstdint>
#include <string>
#include <vector>

namespace at {
class Tensor;
}

namespace shardopt {

// Elements [begin, end) of some frame (see above: the field name says which).
struct Range {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end - begin; }
  bool operator==(const Range& other) const { return begin == other.begin && end == other.end; }
  bool operator!=(const Range& other) const { return !(*this == other); }
};

// What the layout needs to know of one parameter.
struct LayoutParam {
  c10::Device device = c10::Device(c10::kCPU);
  c10::ScalarType dtype = c10::kFloat;
  int64_t numel = 0;
  int owner = 0;           // rank that owns it (from the partition; unused when split)
  bool trainable = true;   // only trainable parameters are in the shards and buckets
  bool keeps_state = false;  // frozen with optimizer state to keep (split mode's kept run)
  bool whole = false;        // stays whole in split mode: in a whole-kind group of its own
  static LayoutParam of(const at::Tensor& param, int owner, bool trainable);
};

struct LayoutOptions {
  // A bucket closes before it would pass this many bytes; 0 = one bucket per parameter (whole
  // parameters) or per group (split: one row bucket for the whole run).
  TORCH_ARG(int64_t, bucket_bytes) = 0;
  // Every parameter starts at a multiple of this many elements of its shard.
  TORCH_ARG(int64_t, align) = 1;
  // Cut the trainable run into equal ranges, ignoring parameter boundaries (see above).
  TORCH_ARG(bool, split) = false;
};

// A contiguous range of one parameter's elements, with one owner (-1: a frozen parameter).
struct Piece {
  size_t param = 0;
  Range in_param;
  size_t group = 0;
  int owner = -1;
  Range in_shard;        // with owner >= 0
  Range in_frozen;       // with owner == -1
  int64_t bucket = -1;   // -1: frozen, in no bucket
  Range in_bucket;       // with `bucket`
  bool whole() const { return in_param.begin == 0 && in_param.size() == param_numel; }
  int64_t param_numel = 0;
};

// A range of a frozen parameter's elements whose kept optimizer state one rank holds.
struct Keeping {
  int rank = 0;
  Range in_param;
};

// One (device, dtype) group: its flat buffer is world_size shards of shard_numel elements.
struct FlatGroup {
  c10::Device device = c10::Device(c10::kCPU);
  c10::ScalarType dtype = c10::kFloat;
  bool split = false;             // cut into equal ranges; else whole parameters
  bool rows = false;              // cut into row buckets (every group of a split layout: equal
                                  // rows, or whole parameters in their owners' rows); else one
                                  // shard per owner, padded to the longest
  int world_size = 1;
  int64_t shard_numel = 1;        // every owner's shard: >= 1, a multiple of `align` (split: the
                                  // sum of its row buckets' rows)
  std::vector<int64_t> used;      // per owner: elements its pieces occupy (gaps included)
  int64_t frozen_numel = 0;       // the frozen region, after the shards
  // Groups without rows only: a row group's shard is one row of each row bucket.
  Range shard_in_buffer(int owner) const { return {owner * shard_numel, (owner + 1) * shard_numel}; }
  Range shards_in_buffer() const { return {0, world_size * shard_numel}; }
  int64_t buffer_numel() const { return world_size * shard_numel + frozen_numel; }
};

// The gradients one collective moves to their owners: a range of one owner's shard (whole
// parameters), or a row bucket (owner -1: every rank owns one row, Note [Row buckets]).
struct FlatBucket {
  size_t group = 0;
  int owner = 0;
  Range in_shard;                 // the bucket's elements in its owner's shard (a row bucket: in
                                  // every rank's shard, its row)
  std::vector<size_t> pieces;     // indices into FlatLayout::pieces(), in bucket order (a row
                                  // bucket: row 0's, then row 1's, ...)
  int64_t row_pieces = 0;         // a row bucket: the most pieces any one row holds
  // A row bucket of whole parameters: per rank, the elements its row's pieces occupy from the
  // row's start (gaps included; 0: an empty row). The rest of each row is padding, which the
  // collectives do not move (Note [Rows with padding] in csrc/comm/rows.cpp). Empty for every
  // other bucket: a split group's rows are full.
  std::vector<int64_t> row_used;
  bool rows() const { return owner < 0; }
  // Pieces an owner of the bucket holds at most: the bucket's, or one row's.
  int64_t owned_pieces() const { return rows() ? row_pieces : static_cast<int64_t>(pieces.size()); }
  int64_t numel() const { return in_shard.size(); }  // a row bucket: one row
  // A row bucket's rows in its group's flat buffer, row 0 first.
  Range rows_in_buffer(int world_size) const { return {world_size * in_shard.begin, world_size * in_shard.end}; }
};

class FlatLayout {
 public:
  FlatLayout() = default;
  static FlatLayout plan(const std::vector<LayoutParam>& params, int world_size, LayoutOptions options = {});

  int world_size() const { return world_size_; }
  const LayoutOptions& options() const { return options_; }
  size_t num_params() const { return pieces_of_.size(); }
  const std::vector<FlatGroup>& groups() const { return groups_; }
  const std::vector<FlatBucket>& buckets() const { return buckets_; }
  const std::vector<Piece>& pieces() const { return pieces_; }
  // Indices into pieces() of `param`'s pieces, in parameter order.
  const std::vector<size_t>& pieces_of(size_t param) const { return pieces_of_.at(param); }
  // A piece's elements in its group's flat buffer.
  Range in_buffer(const Piece& piece) const;
  // Who keeps the state of a frozen parameter with state to keep, in parameter order (split mode;
  // empty for any other parameter).
  const std::vector<Keeping>& keepers_of(size_t param) const { return kept_.at(param); }
  // All of a parameter's elements in its group's flat buffer (its pieces are adjacent).
  Range param_in_buffer(size_t param) const;
  // Whether `rank` holds a piece of bucket `bucket`: its owner, or a rank whose row of a row bucket
  // is not empty.
  bool holds_piece_of(size_t bucket, int rank) const;
  // The owners of `param`'s pieces, in parameter order (empty for a frozen parameter).
  std::vector<int> owners_of(size_t param) const;
  // The largest elements any rank owns in any group, against the ideal 1/world_size of the
  // trainable elements: max / ideal - 1 (0 = perfect; alignment padding counts against it).
  double imbalance() const;
  // True when every piece has the same group, owner and shard range in both layouts: the data
  // in the flat buffers stays where it is (only the bucket cuts may differ).
  bool same_placement(const FlatLayout& other) const;
  // One line per group and bucket, for logs and error messages.
  std::string describe() const;

 private:
  // The steps of plan(), in order.
  std::vector<size_t> make_groups(const std::vector<LayoutParam>& params);  // group of each parameter
  void place_pieces(const std::vector<LayoutParam>& params, const std::vector<size_t>& group_of);
  // place_pieces' steps: whole parameters per owner; the row buckets drafted (split groups' runs,
  // whole-kind groups' rows), then sized and their pieces placed.
  struct RowDraft;
  void place_per_owner(const std::vector<LayoutParam>& params, const std::vector<size_t>& group_of);
  void draft_split_rows(const std::vector<LayoutParam>& params, const std::vector<size_t>& group_of, RowDraft& draft);
  void draft_whole_rows(const std::vector<LayoutParam>& params, const std::vector<size_t>& group_of, RowDraft& draft);
  void place_rows(const std::vector<LayoutParam>& params, const std::vector<size_t>& group_of, const RowDraft& draft);
  void add_piece(const std::vector<LayoutParam>& params, const std::vector<size_t>& group_of, size_t i, Range in_param,
                 int owner, Range in_shard);
  void place_frozen(const std::vector<LayoutParam>& params, const std::vector<size_t>& group_of);
  void cut_buckets(const std::vector<LayoutParam>& params);
  void cut_kept(const std::vector<LayoutParam>& params, const std::vector<size_t>& group_of);
  void check_invariants() const;

  int world_size_ = 1;
  LayoutOptions options_;
  std::vector<FlatGroup> groups_;
  std::vector<FlatBucket> buckets_;
  std::vector<FlatBucket> row_buckets_;  // during plan(): the row buckets, until cut_buckets()
  std::vector<Piece> pieces_;
  std::vector<std::vector<size_t>> pieces_of_;
  std::vector<std::vector<Keeping>> kept_;  // per parameter
};

}  // namespace shardopt
