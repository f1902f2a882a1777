// Checkpoints: the collective save and load (the files themselves: checkpoint_file.cpp).
#include <shardopt/checkpoint/checkpoint.h>
#include <shardopt/check.h>

#include "checkpoint/rng_state.h"
#include "checkpoint/snapshot.h"
#include "ddp/error_feedback_state.h"

#include <ATen/ATen.h>
#include <torch/csrc/api/include/torch/serialize.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <zlib.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <dirent.h>
#include <cstring>
#include <fcntl.h>
#include <random>
#include <sys/stat.h>
#include <unistd.h>

namespace shardopt {

namespace {
using detail::agree_on_failure;
using detail::ErrorFeedbackState;
using detail::strip_prefix;

using Dict = c10::impl::GenericDict;
using List = c10::impl::GenericList;

Dict string_dict() { return Dict(c10::StringType::get(), c10::AnyType::get()); }

std::string fmt_hex(int64_t v) {
  char text[17];
  std::snprintf(text, sizeof(text), "%016llx", static_cast<unsigned long long>(v));
  return text;
}

// Note [Parts carry their save's id]
// A sharded save writes each rank's part under a name that carries the save's id
// ("<path>.optim-<rank>-of-<world>.<id>"), then the main file last, as the commit: it names the
// id. Only once the main file is in place are the parts of earlier saves removed. So a kill at
// any moment leaves a loadable checkpoint: before the commit, the previous main file and the
// previous parts are untouched (the new parts have other names); after it, the new ones are
// complete. Ids are the save's time in milliseconds and 20 random bits: two saves to one path
// never share one.
std::string id_text(int64_t id) { return fmt_hex(id); }

std::string shard_path(const std::string& path, int64_t rank, int64_t world, int64_t id) {
  return path + ".optim-" + std::to_string(rank) + "-of-" + std::to_string(world) + "." + id_text(id);
}

// Where a sharded save keeps a rank's error-feedback residuals (Note [Error feedback in
// checkpoints] in csrc/ddp/error_feedback_state.cpp).
std::string feedback_path(const std::string& path, int64_t rank, int64_t world, int64_t id) {
  return path + ".feedback-" + std::to_string(rank) + "-of-" + std::to_string(world) + "." + id_text(id);
}

// The name parts had before they carried the id (checkpoints of shardopt 0.4 and earlier).
std::string legacy_shard_path(const std::string& path, int64_t rank, int64_t world) {
  return path + ".optim-" + std::to_string(rank) + "-of-" + std::to_string(world);
}

}  // namespace

// Note [Each rank removes its own parts]
// Once a save committed, the parts of earlier saves are of no use, but only the rank that writes
// a name may remove what is under it: rank r removes "<path>.optim-r-of-<shard world>.<id>" and
// "<path>.feedback-r-of-<world>.<id>" of other ids. Nothing orders one rank's cleanup after save
// A with another rank's write of save B: with three ranks, rank 0's broadcast of B's id lets rank
// 1 write its part of B while rank 2 still cleans up after A, and a cleanup that removed every
// part but A's removed rank 1's part of B, after A's had gone too (both checkpoints lost). A
// rank's own names are written and removed in its own order. Rank 0 also removes the names no
// rank of this save writes (parts of another world size, and parts without an id): nobody writes
// them while it does. The temporary files of writers killed before their rename go the same way
// (the main file's on rank 0). Errors are ignored: a part the main file does not name is never read.
namespace detail {
void remove_stale_parts(const CheckpointSnapshot& snap, int64_t keep_id) {
  const std::string& path = snap.path;
  const size_t slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : path.substr(0, slash == 0 ? 1 : slash);
  const std::string base = slash == std::string::npos ? path : path.substr(slash + 1);
  const auto digits = [](const std::string& t) {
    return !t.empty() && t.find_first_not_of("0123456789") == std::string::npos;
  };
  const std::string keep = keep_id < 0 ? "" : id_text(keep_id);
  DIR* d = ::opendir(dir.c_str());
  if (!d) return;
  while (const dirent* entry = ::readdir(d)) {
    std::string name = entry->d_name;
    // A temporary file ("<file>.tmp.<pid>.<n>", write_checkpoint_file) whose writer was killed:
    // stale once its save or a later one committed, removed by whoever writes <file>.
    bool temporary = false;
    if (const size_t tmp = name.find(".tmp."); tmp != std::string::npos) {
      const std::string writer = name.substr(tmp + 5);
      const size_t dot = writer.find('.');
      if (dot == std::string::npos || !digits(writer.substr(0, dot)) || !digits(writer.substr(dot + 1))) continue;
      name.resize(tmp);
      temporary = true;
      if (name == base) {  // the main file's: rank 0 writes it
        if (snap.rank == 0) ::unlink((dir + "/" + entry->d_name).c_str());
        continue;
      }
    }
    std::string prefix = base + ".optim-";
    int64_t written_at = snap.shard_world;  // the world whose ranks write names of this kind
    if (name.rfind(prefix, 0) != 0) prefix = base + ".feedback-", written_at = snap.world;
    if (name.rfind(prefix, 0) != 0) continue;
    const size_t of = name.find("-of-", prefix.size());
    if (of == std::string::npos) continue;
    const size_t dot = name.find('.', of);
    const std::string rank = name.substr(prefix.size(), of - prefix.size());
    const std::string world = name.substr(of + 4, dot == std::string::npos ? std::string::npos : dot - of - 4);
    const std::string id = dot == std::string::npos ? "" : name.substr(dot + 1);
    if (!digits(rank) || !digits(world) || (!id.empty() && id.find_first_not_of("0123456789abcdef") != std::string::npos)) {
      continue;
    }
    if (!temporary && !keep.empty() && id == keep) continue;
    const int64_t r = std::stoll(rank), w = std::stoll(world);
    const bool written_now = !id.empty() && w == written_at && r < w;
    const bool mine = written_now && r == snap.rank;
    if (mine || (!written_now && snap.rank == 0)) ::unlink((dir + "/" + entry->d_name).c_str());
  }
  ::closedir(d);
}
}  // namespace detail

namespace {

// The id of a new save (Note [Parts carry their save's id]).
int64_t new_checkpoint_id() {
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                      std::chrono::system_clock::now().time_since_epoch())
                      .count();
  return (static_cast<int64_t>(ms) << 20) | static_cast<int64_t>(std::random_device()() & 0xfffff);
}

}  // namespace

namespace detail {
void agree_on_failure(ProcessGroup& group, const std::string& error, const std::string& what, const std::string& path) {
  at::Tensor failed = at::full({1}, error.empty() ? int64_t{0} : int64_t{group.rank() + 1}, at::kLong);
  group.allreduce(failed, Reduction::kMax);
  const int64_t who = failed.item<int64_t>();
  if (who == 0) return;
  SHARDOPT_CHECK(error.empty(), error);
  SHARDOPT_CHECK(false, what, " checkpoint '", path, "' failed on rank ", who - 1, " (see that rank's error)");
}
}  // namespace detail

namespace detail {
std::string strip_prefix(const std::string& message) {
  std::string m = message.substr(0, message.find('\n'));
  const std::string prefix = "shardopt: ";
  return m.rfind(prefix, 0) == 0 ? m.substr(prefix.size()) : m;
}
}  // namespace detail

namespace {

Dict sampler_value(const SamplerState& s) {
  Dict d = string_dict();
  d.insert("version", s.version);
  d.insert("fingerprint", static_cast<int64_t>(s.fingerprint));
  d.insert("dataset_size", s.dataset_size);
  d.insert("global_batch_size", s.global_batch_size);
  d.insert("epoch", s.epoch);
  d.insert("next_step", s.next_step);
  return d;
}

SamplerState sampler_of(const Dict& d) {
  SamplerState s;
  s.version = d.at("version").toInt();
  s.fingerprint = static_cast<uint64_t>(d.at("fingerprint").toInt());
  s.dataset_size = d.at("dataset_size").toInt();
  s.global_batch_size = d.at("global_batch_size").toInt();
  s.epoch = d.at("epoch").toInt();
  s.next_step = d.at("next_step").toInt();
  return s;
}

// Parameters and buffers by name, each a compact CPU copy (a parameter that is a view of a flat
// buffer would otherwise write the whole buffer).
Dict module_value(const torch::nn::Module& module) {
  Dict d = string_dict();
  for (const auto& p : module.named_parameters()) d.insert(p.key(), p.value().detach().cpu().clone());
  for (const auto& b : module.named_buffers()) d.insert(b.key(), b.value().detach().cpu().clone());
  return d;
}

Dict trainable_value(const torch::nn::Module& module) {
  Dict d = string_dict();
  for (const auto& p : module.named_parameters()) d.insert(p.key(), p.value().requires_grad());
  return d;
}

void load_module(const std::string& path, const Dict& saved, const Dict& trainable, torch::nn::Module& module) {
  size_t expected = 0;
  auto load_one = [&](const std::string& name, at::Tensor t, bool is_param) {
    ++expected;
    SHARDOPT_CHECK(saved.contains(name), "checkpoint '", path, "' has no ", is_param ? "parameter" : "buffer", " '",
                   name, "' of the module");
    const at::Tensor v = saved.at(name).toTensor();
    SHARDOPT_CHECK(v.sizes() == t.sizes(), "checkpoint '", path, "': '", name, "' has shape ", v.sizes(),
                   " but the module's has shape ", t.sizes());
    at::NoGradGuard no_grad;
    t.copy_(v);
    if (is_param && trainable.contains(name)) t.requires_grad_(trainable.at(name).toBool());
  };
  for (const auto& p : module.named_parameters()) load_one(p.key(), p.value(), true);
  for (const auto& b : module.named_buffers()) load_one(b.key(), b.value(), false);
  SHARDOPT_CHECK(saved.size() == expected, "checkpoint '", path, "' holds ", saved.size(),
                 " parameters and buffers, the module has ", expected, " (another model?)");
}

void check_keys(const std::string& path, const Dict& d, std::initializer_list<const char*> keys) {
  for (const char* k : keys) {
    SHARDOPT_CHECK(d.contains(k), "checkpoint '", path, "' has no \"", k, "\" entry (not written by save_checkpoint?)");
  }
}

// What the main file holds: the model, the training state, the optimizer (consolidated) or the
// count of its shard files, every rank's RNG state, and the id the shard files carry too.
Dict main_file_value(torch::nn::Module& module, int world, int shard_world, int64_t id, bool sharded,
                     bool feedback, const torch::IValue& optimizer_value, const std::vector<torch::IValue>& rng_states,
                     const TrainingState& state) {
  Dict d = string_dict();
  d.insert("format", std::string("shardopt-checkpoint"));
  d.insert("world_size", static_cast<int64_t>(world));
  d.insert("optimizer_shards", static_cast<int64_t>(shard_world));
  if (feedback) d.insert("feedback_parts", static_cast<int64_t>(world));  // one file of residuals per rank
  d.insert("checkpoint_id", id);
  d.insert("model", module_value(module));
  d.insert("trainable", trainable_value(module));
  d.insert("optimizer_layout", std::string(sharded ? "sharded" : "consolidated"));
  if (!sharded) d.insert("optimizer", optimizer_value);
  List rng(c10::AnyType::get());
  for (const auto& s : rng_states) rng.push_back(s);
  d.insert("rng", rng);
  d.insert("step", state.step);
  d.insert("epoch", state.epoch);
  d.insert("sampler", state.sampler ? torch::IValue(sampler_value(*state.sampler)) : torch::IValue());
  c10::Dict<std::string, double> scalars;
  for (const auto& [k, v] : state.scalars) scalars.insert(k, v);
  d.insert("scalars", scalars);
  return d;
}

}  // namespace

namespace detail {

namespace {

// `value` with every tensor in it a copy of its own: in pinned host memory for a CUDA tensor,
// cloned otherwise.
c10::IValue own_copy(const c10::IValue& value) {
  if (value.isTensor()) {
    const at::Tensor t = value.toTensor().detach();
    if (!t.is_cuda()) return t.clone();
    at::Tensor host = at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(true));
    host.copy_(t);
    return host;
  }
  if (value.isGenericDict()) {
    const auto dict = value.toGenericDict();
    c10::impl::GenericDict out(dict.keyType(), dict.valueType());
    for (const auto& entry : dict) out.insert(entry.key(), own_copy(entry.value()));
    return out;
  }
  if (value.isTensorList()) {
    c10::List<at::Tensor> out;
    for (const at::Tensor& t : value.toTensorList()) out.push_back(own_copy(t).toTensor());
    return out;
  }
  if (value.isList()) {
    const auto list = value.toList();
    c10::impl::GenericList out(list.elementType());
    for (const auto& item : list) out.push_back(own_copy(item));
    return out;
  }
  if (value.isTuple()) {
    std::vector<c10::IValue> items;
    for (const auto& item : value.toTupleRef().elements()) items.push_back(own_copy(item));
    return c10::ivalue::Tuple::create(std::move(items));
  }
  return value;  // numbers, strings, None
}

}  // namespace

void check_ddp_saves(const std::string& path, const ShardedDDP& ddp, const OSS& optimizer) {
  SHARDOPT_CHECK(ErrorFeedbackState::reduces_for(ddp, optimizer), "checkpoint '", path,
                 "': the ShardedDDP given does not reduce gradients for the OSS given");
}

// Note [A folder every rank sees]
// A sharded checkpoint is its main file (rank 0's) and every rank's parts, so the folder must be
// one that every rank sees: a node-local folder on several nodes would leave each node's parts
// on that node, and the save would "succeed" and fail only at the load. After every rank wrote
// its parts, each rank looks for all of them; the main file is written only when every rank sees
// every part, and otherwise the save fails on each rank that misses one, naming what it misses
// (and on the others, naming those ranks). The background save does the same through the store:
// each writer says which parts it cannot see, rank 0 commits only when no writer misses one, and
// every writer reports rank 0's reason.
std::string unseen_parts(const CheckpointSnapshot& snap) {
  if (!snap.sharded) return {};
  std::vector<std::string> missing;
  for (int r = 0; r < snap.shard_world; ++r) {
    const std::string file = shard_path(snap.path, r, snap.shard_world, snap.id);
    if (::access(file.c_str(), F_OK) != 0) missing.push_back(file);
  }
  for (int r = 0; snap.feedback && r < snap.world; ++r) {
    const std::string file = feedback_path(snap.path, r, snap.world, snap.id);
    if (::access(file.c_str(), F_OK) != 0) missing.push_back(file);
  }
  if (missing.empty()) return {};
  std::string list;
  for (size_t k = 0; k < missing.size() && k < 4; ++k) list += (k ? ", '" : "'") + missing[k] + "'";
  if (missing.size() > 4) list += " and " + std::to_string(missing.size() - 4) + " more";
  return "checkpoint '" + snap.path + "': rank " + std::to_string(snap.rank) + " cannot see " +
         std::to_string(missing.size()) + " of the parts the other ranks wrote (" + list +
         "): a sharded checkpoint's folder must be one every rank sees (a shared file system), not a folder of "
         "each node's own";
}

void write_parts(const CheckpointSnapshot& snap) {
  for (const auto& part : snap.parts) write_checkpoint_file(part.path, part.value);
}

void unlink_parts(const CheckpointSnapshot& snap) {
  for (const auto& part : snap.parts) ::unlink(part.path.c_str());
}

CheckpointSnapshot take_snapshot(const std::string& path, torch::nn::Module& module, OSS& optimizer,
                                 const ShardedDDP* ddp, const TrainingState& state, const CheckpointOptions& options,
                                 bool own_copies) {
  ProcessGroup& group = optimizer.global_group();
  optimizer.finish_param_sync();  // the module's parameters are read below
  const int rank = group.rank(), world = group.size();
  // The optimizer's shards are those of its shard group (with hierarchical sharding, block 0's
  // ranks, which are global ranks 0 .. block size - 1, hold one full copy between them).
  const int shard_world = optimizer.process_group().size();
  CheckpointSnapshot snap;
  snap.path = path;
  snap.rank = rank;
  snap.shard_world = shard_world;
  snap.world = world;
  snap.sharded = options.optimizer_state() == OptimizerStateLayout::kSharded;
  // One id ties the shard files to their main file (Note [Parts carry their save's id]).
  at::Tensor id = at::full({1}, rank == 0 ? new_checkpoint_id() : int64_t{0}, at::kLong);
  group.broadcast(id, 0);
  snap.id = id.item<int64_t>();

  // Collectives (every rank takes part alike).
  torch::IValue optimizer_value;
  if (snap.sharded) {
    optimizer_value = optimizer.state_shard();
  } else {
    optimizer.consolidate_state_dict(0);
    if (rank == 0) optimizer_value = optimizer.state_dict();
  }
  const std::vector<torch::IValue> rng_states = detail::gather_rng_states(group);

  if (snap.sharded && rank < shard_world) {
    Dict d = string_dict();
    d.insert("checkpoint_id", snap.id);
    d.insert("optimizer_shard", optimizer_value);
    snap.parts.push_back({shard_path(path, rank, shard_world, snap.id), d});
  }
  // Residuals are every rank's own: in a sharded save only (Note [Error feedback in checkpoints]).
  const bool feedback = snap.sharded && ddp && ErrorFeedbackState::kept(*ddp);
  snap.feedback = feedback;
  if (feedback) {
    Dict d = string_dict();
    d.insert("checkpoint_id", snap.id);
    d.insert("residuals", ErrorFeedbackState::save(*ddp));
    snap.parts.push_back({feedback_path(path, rank, world, snap.id), d});
  }
  if (rank == 0) {
    snap.writes_main = true;
    snap.main = main_file_value(module, world, shard_world, snap.id, snap.sharded, feedback, optimizer_value,
                                rng_states, state);
  }
  if (own_copies) {
    // (The model's tensors in the main file are copies already: module_value clones them.)
    for (auto& part : snap.parts) part.value = own_copy(part.value);
    if (snap.writes_main && !snap.sharded) {
      Dict main = snap.main.toGenericDict();
      main.insert_or_assign("optimizer", own_copy(main.at("optimizer")));
    }
  }
  return snap;
}

}  // namespace detail

namespace {

void save(const std::string& path, torch::nn::Module& module, OSS& optimizer, const ShardedDDP* ddp,
          const TrainingState& state, const CheckpointOptions& options) {
  detail::settle_pending_save(optimizer);
  ProcessGroup& group = optimizer.global_group();
  CommPhase phase("saving a checkpoint");
  const detail::CheckpointSnapshot snap = detail::take_snapshot(path, module, optimizer, ddp, state, options, false);
  std::string error;
  try {
    detail::write_parts(snap);
  } catch (const std::exception& e) {
    error = strip_prefix(e.what());
  }
  // The main file last, as the commit: it names the parts, which exist by then on every rank that
  // wrote one.
  CommPhase committing("saving a checkpoint (committing its main file)");
  at::Tensor parts_ok = at::full({1}, error.empty() ? int64_t{0} : int64_t{1}, at::kLong);
  group.allreduce(parts_ok, Reduction::kMax);
  if (snap.sharded && parts_ok.item<int64_t>() == 0) {  // Note [A folder every rank sees]
    error = detail::unseen_parts(snap);
    parts_ok.fill_(error.empty() ? 0 : 1);
    group.allreduce(parts_ok, Reduction::kMax);
  }
  if (snap.writes_main && error.empty() && parts_ok.item<int64_t>() == 0) {
    try {
      write_checkpoint_file(path, snap.main);
    } catch (const std::exception& e) {
      error = strip_prefix(e.what());
    }
  }
  try {
    agree_on_failure(group, error, "saving", path);
  } catch (...) {
    // A part failed, so rank 0 wrote no main file: nothing names this rank's part. (Otherwise it
    // stays: rank 0 may have committed before the agreement failed; the next save removes it.)
    if (parts_ok.item<int64_t>() != 0) detail::unlink_parts(snap);
    throw;
  }
  // Committed: the main file names this save's parts; every earlier part is of no use.
  detail::remove_stale_parts(snap, snap.sharded ? snap.id : -1);
}

// This rank's error-feedback residuals in the checkpoint whose main file is `d`, or None where it
// holds none for this world size (Note [Error feedback in checkpoints]), saying why on rank 0.
torch::IValue saved_residuals(const std::string& path, const Dict& d, ProcessGroup& group) {
  const int64_t parts = d.contains("feedback_parts") ? d.at("feedback_parts").toInt() : 0;
  if (parts != group.size()) {
    if (group.rank() == 0) {
      TORCH_WARN("shardopt: checkpoint '", path, "' holds no error-feedback residuals for ", group.size(), " ranks (",
                 parts > 0 ? "it was saved at " + std::to_string(parts) + " ranks"
                 : d.at("optimizer_layout").toStringRef() == "sharded"
                     ? std::string("it was saved without them")
                     : std::string("a consolidated checkpoint carries none"),
                 "): they start at zero");
    }
    return torch::IValue();
  }
  const std::string file = feedback_path(path, group.rank(), parts, d.at("checkpoint_id").toInt());
  SHARDOPT_CHECK(::access(file.c_str(), F_OK) == 0, "checkpoint '", path, "': its residuals of rank ",
                 group.rank(), ", '", file, "', are missing");
  const Dict f = read_checkpoint_file(file).toGenericDict();
  SHARDOPT_CHECK(f.at("checkpoint_id").toInt() == d.at("checkpoint_id").toInt(), "checkpoint '", file,
                 "' belongs to another save than '", path, "'");
  return f.at("residuals");
}

TrainingState load(const std::string& path, torch::nn::Module& module, OSS& optimizer, ShardedDDP* ddp) {
  detail::settle_pending_save(optimizer);  // a save in flight finishes first: its files are whole
  ProcessGroup& group = optimizer.global_group();
  optimizer.finish_param_sync();  // nothing in flight may land on the loaded parameters
  CommPhase phase("loading a checkpoint");
  TrainingState state;
  const bool restore_rng = detail::restores_rng(group);
  at::Tensor rng_saved;
  std::string error;
  try {
    const torch::IValue value = read_checkpoint_file(path);
    SHARDOPT_CHECK(value.isGenericDict(), "checkpoint '", path, "' holds no dict");
    const Dict d = value.toGenericDict();
    check_keys(path, d, {"format", "world_size", "checkpoint_id", "model", "trainable", "optimizer_layout", "rng",
                         "step", "epoch", "sampler", "scalars"});
    load_module(path, d.at("model").toGenericDict(), d.at("trainable").toGenericDict(), module);

    const int64_t saved_world = d.at("world_size").toInt();
    if (d.at("optimizer_layout").toStringRef() == "sharded") {
      check_keys(path, d, {"optimizer_shards"});
      const int64_t shards_saved = d.at("optimizer_shards").toInt();
      std::vector<torch::IValue> shards;
      const int64_t saved_id = d.at("checkpoint_id").toInt();
      for (int64_t r = 0; r < shards_saved; ++r) {
        std::string file = shard_path(path, r, shards_saved, saved_id);
        if (::access(file.c_str(), F_OK) != 0 && ::access(legacy_shard_path(path, r, shards_saved).c_str(), F_OK) == 0) {
          file = legacy_shard_path(path, r, shards_saved);
        }
        SHARDOPT_CHECK(::access(file.c_str(), F_OK) == 0, "checkpoint '", path, "': its optimizer part ", r, " of ",
                       shards_saved, ", '", file, "', is missing (a sharded checkpoint is its main file and its "
                       "parts beside it, named after it: a main file copied or renamed alone leaves them behind)");
        const Dict s = read_checkpoint_file(file).toGenericDict();
        SHARDOPT_CHECK(s.at("checkpoint_id").toInt() == d.at("checkpoint_id").toInt(), "checkpoint '", file,
                       "' belongs to another save than '", path, "'");
        shards.push_back(s.at("optimizer_shard"));
      }
      optimizer.load_state_dict(optimizer.state_dict_from_shards(shards));
    } else {
      check_keys(path, d, {"optimizer"});
      optimizer.load_state_dict(d.at("optimizer"));
    }

    const auto rng = d.at("rng").toListRef();
    const size_t mine = saved_world == group.size() ? static_cast<size_t>(group.rank()) : 0;
    SHARDOPT_CHECK(mine < rng.size(), "checkpoint '", path, "' holds ", rng.size(), " random-number states for ",
                   saved_world, " ranks");
    rng_saved = rng[mine].toTensor();

    state.step = d.at("step").toInt();
    state.epoch = d.at("epoch").toInt();
    if (!d.at("sampler").isNone()) state.sampler = sampler_of(d.at("sampler").toGenericDict());
    for (const auto& kv : d.at("scalars").toGenericDict()) state.scalars[kv.key().toStringRef()] = kv.value().toDouble();
    if (ddp && ErrorFeedbackState::kept(*ddp)) ErrorFeedbackState::restore(*ddp, saved_residuals(path, d, group));
  } catch (const std::exception& e) {
    error = strip_prefix(e.what());
  }
  // (Before the agreement: no rank that shares this process's generator draws from it before
  // it is set.)
  if (restore_rng && error.empty()) detail::set_rng_state(rng_saved);
  agree_on_failure(group, error, "loading", path);
  return state;
}

}  // namespace

void save_checkpoint(const std::string& path, torch::nn::Module& module, OSS& optimizer, const TrainingState& state,
                     CheckpointOptions options) {
  save(path, module, optimizer, nullptr, state, options);
}

void save_checkpoint(const std::string& path, ShardedDDP& ddp, OSS& optimizer, const TrainingState& state,
                     CheckpointOptions options) {
  detail::check_ddp_saves(path, ddp, optimizer);
  save(path, *ddp.module(), optimizer, &ddp, state, options);
}

TrainingState load_checkpoint(const std::string& path, torch::nn::Module& module, OSS& optimizer) {
  return load(path, module, optimizer, nullptr);
}

TrainingState load_checkpoint(const std::string& path, ShardedDDP& ddp, OSS& optimizer) {
  detail::check_ddp_saves(path, ddp, optimizer);
  return load(path, *ddp.module(), optimizer, &ddp);
}

}  // namespace shardopt
