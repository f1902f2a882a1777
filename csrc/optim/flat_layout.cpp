#include <shardopt/optim/flat_layout.h>
#include <shardopt/check.h>

#include <ATen/core/Tensor.h>

#include <algorithm>
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
  layout.place_pieces(params, layout.make_groups(params));
  layout.cut_buckets(params);
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
    size_t g = 0;  // groups in order of first appearance
    while (g < groups_.size() && (groups_[g].device != p.device || groups_[g].dtype != p.dtype)) ++g;
    if (g == groups_.size()) {
      FlatGroup group;
      group.device = p.device;
      group.dtype = p.dtype;
      group.used.assign(world_size_, 0);
      groups_.push_back(std::move(group));
    }
    group_of[i] = g;
  }
  return group_of;
}

// Trainable parameters first, then frozen ones; each in reverse parameter order.
void FlatLayout::place_pieces(const std::vector<LayoutParam>& params, const std::vector<size_t>& group_of) {
  pieces_of_.assign(params.size(), {});
  auto place = [&](size_t i) {
    Piece piece;
    piece.param = i;
    piece.in_param = {0, params[i].numel};
    piece.group = group_of[i];
    piece.owner = params[i].owner;
    int64_t& used = groups_[piece.group].used[piece.owner];
    piece.in_shard.begin = align_up(used, options_.align());
    piece.in_shard.end = piece.in_shard.begin + params[i].numel;
    used = piece.in_shard.end;
    pieces_of_[i].push_back(pieces_.size());
    pieces_.push_back(piece);
  };
  for (size_t i = params.size(); i-- > 0;) {
    if (params[i].trainable) place(i);
  }
  for (size_t i = params.size(); i-- > 0;) {
    if (!params[i].trainable) place(i);
  }
  for (auto& group : groups_) {
    const int64_t longest = *std::max_element(group.used.begin(), group.used.end());
    group.shard_numel = std::max<int64_t>(1, align_up(longest, options_.align()));
  }
}

// One open bucket per (group, owner), walking the trainable parameters in reverse order.
void FlatLayout::cut_buckets(const std::vector<LayoutParam>& params) {
  std::vector<std::vector<int64_t>> open(groups_.size(), std::vector<int64_t>(world_size_, -1));
  for (size_t i = params.size(); i-- > 0;) {
    if (!params[i].trainable) continue;
    const size_t index = pieces_of_[i].front();
    Piece& piece = pieces_[index];
    int64_t& b = open[piece.group][piece.owner];
    const int64_t element_size = static_cast<int64_t>(c10::elementSize(params[i].dtype));
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

void FlatLayout::check_invariants() const {
  for (const auto& piece : pieces_) {
    const auto& group = groups_[piece.group];
    TORCH_INTERNAL_ASSERT(piece.in_shard.begin >= 0 && piece.in_shard.end <= group.shard_numel,
                          "piece of parameter ", piece.param, " lies outside its shard");
    TORCH_INTERNAL_ASSERT(piece.in_shard.begin % options_.align() == 0, "piece of parameter ", piece.param,
                          " is not aligned");
    if (piece.bucket >= 0) {
      const auto& bucket = buckets_[piece.bucket];
      TORCH_INTERNAL_ASSERT(bucket.owner == piece.owner && bucket.group == piece.group &&
                                piece.in_bucket.begin + bucket.in_shard.begin == piece.in_shard.begin &&
                                piece.in_bucket.end <= bucket.numel(),
                            "piece of parameter ", piece.param, " does not lie in its bucket ", piece.bucket);
    }
  }
}

Range FlatLayout::in_buffer(const Piece& piece) const {
  const int64_t base = groups_.at(piece.group).shard_in_buffer(piece.owner).begin;
  return {base + piece.in_shard.begin, base + piece.in_shard.end};
}

bool FlatLayout::same_placement(const FlatLayout& other) const {
  if (world_size_ != other.world_size_ || pieces_.size() != other.pieces_.size() ||
      groups_.size() != other.groups_.size() || pieces_of_ != other.pieces_of_) {
    return false;
  }
  for (size_t g = 0; g < groups_.size(); ++g) {
    const auto &a = groups_[g], &b = other.groups_[g];
    if (a.device != b.device || a.dtype != b.dtype || a.shard_numel != b.shard_numel) return false;
  }
  for (size_t k = 0; k < pieces_.size(); ++k) {
    const auto &a = pieces_[k], &b = other.pieces_[k];
    if (a.param != b.param || a.in_param != b.in_param || a.group != b.group || a.owner != b.owner ||
        a.in_shard != b.in_shard) {
      return false;
    }
  }
  return true;
}

std::string FlatLayout::describe() const {
  std::ostringstream out;
  for (size_t g = 0; g < groups_.size(); ++g) {
    const auto& group = groups_[g];
    out << "group " << g << " (" << group.device << ", " << group.dtype << "): " << world_size_ << " shards of "
        << group.shard_numel << " elements, used";
    for (int64_t u : group.used) out << " " << u;
    out << "\n";
  }
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const auto& bucket = buckets_[b];
    out << "bucket " << b << ": group " << bucket.group << ", owner " << bucket.owner << ", shard ["
        << bucket.in_shard.begin << ", " << bucket.in_shard.end << "), " << bucket.pieces.size() << " pieces\n";
  }
  return out.str();
}

}  // namespace shardopt
