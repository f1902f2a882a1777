// The flat parameter buffers of a FlatLayout, and the parameter sync after the step.
// Internal to shardopt: the ShardStore lays its buffers out and syncs them with these.
#pragma once

#include <shardopt/comm/process_group.h>
#include <shardopt/comm/wire.h>
#include <shardopt/optim/flat_layout.h>

#include <ATen/core/Tensor.h>

#include <vector>

namespace shardopt {
enum class ParamSync;
}

namespace shardopt::detail {

// One buffer per group of `layout`, each parameter a view of its range with its values.
// set_data() keeps every parameter's TensorImpl, so the module, optimizer state keys and hooks
// stay valid. A group whose parameters are all the parameters of one of `old` (the buffers of
// the layout before), with room in it, stays in that buffer's memory: the parameters move inside
// it (Note [Moving ranges in place] in buffer_moves.h), so a new layout does not hold the model
// twice. Any other group gets a new buffer, its values copied in. A tensor that aliased an old
// buffer apart from the parameters (a detached view kept by the user) does not keep its values.
// `room`, where given: on entry the bytes the memory of each of `old` holds, on return those of
// each new buffer's (a buffer laid out in less than its memory keeps the rest for a later layout).
std::vector<at::Tensor> lay_out_params(const FlatLayout& layout, std::vector<at::Tensor>& params,
                                       std::vector<at::Tensor> old = {}, std::vector<int64_t>* room = nullptr);

// Note [Parameter sync]
// After the owners stepped, every rank's copy of each buffer is made equal to the owners', all
// in flight at once. A row group's (every group of a split layout): one all-gather per row
// bucket (Note [Row buckets]). A group of whole parameters per owner: one broadcast per owner
// shard (kBroadcast), or one all-gather of the equal shards per buffer (kAllgather: the shards
// are the buffer's rows, Note [Rows]). With `wire`, an
// fp32 buffer's ranges travel rounded (Note [Parameter wire] in csrc/comm/wire.cpp). Where
// `own_rows` (one per layout bucket, or empty) holds a row bucket's tensor, this rank's row of it
// is set from there (Note [Syncing from the masters]). Collective.
void sync_params(ProcessGroup& group, const FlatLayout& layout, std::vector<at::Tensor>& buffers, ParamSync mode,
                 Wire wire = Wire::kExact, const std::vector<at::Tensor>& own_rows = {});

// The owners' shards of buffer `g` of whole parameters, one equal row per rank (shard padding
// included).
at::Tensor shards_as_rows(const FlatLayout& layout, std::vector<at::Tensor>& buffers, size_t g);
// Row bucket `bucket`'s rows in its group's buffer (Note [Row buckets]).
at::Tensor bucket_rows(const FlatLayout& layout, std::vector<at::Tensor>& buffers, size_t bucket);

}  // namespace shardopt::detail
