#include <shardopt/resilience/resilient.h>
#include <shardopt/optim/grad_scaler.h>
#include <shardopt/check.h>
#include <shardopt/version.h>

#include "checkpoint/snapshot.h"
#include "comm/group_recovery.h"
#include "resilience/copies.h"
#include "resilience/survivors.h"

#include <c10/util/Exception.h>

#include <ATen/ATen.h>
#include <torch/csrc/api/include/torch/nn/module.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <sstream>

namespace shardopt {

// Note [Buddy copies]
// At a refresh (before the first step, then after every refresh_every-th step), each rank
// - copies every parameter and buffer (they are the same on every rank) into host memory,
// - copies its shard (OSS::state_shard(): its optimizer state, and fp32 masters under mixed
//   precision) into host memory,
// - serializes it, sends it to rank r+1 and receives rank r-1's (the buddy copy).
// The previous refresh's copies are kept as well until the next one: a rank may die in the middle
// of a refresh, when some survivors hold the new copies and others do not. Recovery then picks
// the newest refresh whose copies every survivor and every lost rank's buddy hold. So a rank
// holds at most two generations of (parameters, its shard, its buddy's shard) in host memory.
//
// Note [Replica blocks]
// With hierarchical sharding (OSSOptions::shard_group_size B, world k*B) every shard already lives
// in each of the k blocks: rank r holds shard r % B, like every rank r + j*B. There is no buddy
// copy to send: a refresh copies the parameters and this rank's own shard into host memory, and a
// recovery takes each shard from any survivor that holds it. Only when every holder of one shard
// is gone is recovery impossible. With refresh_every 1 (the default) a failure loses no completed
// step. The new group is made by the user's function: at a world size B does not divide, it may
// build a flat optimizer, and from then on the run keeps buddy copies.
//
// Recovery: the survivors agree on who is gone (Note [Who is gone]), make a new group over the
// store (under a prefix of this generation), put the parameters and buffers back as at the
// chosen refresh (into fresh storage: a transfer of the broken group still in flight can only
// write into the old), build a new optimizer over the new group, whose partition is the new
// world's, and give each survivor the ranges of the old shards it holds in it (the lost ones' from
// their buddies). Then a refresh over the new group, so that a second failure is survived too.
// A survivor receives only its share of the optimizer state, never the whole.

namespace {
using Clock = std::chrono::steady_clock;
}  // namespace
using detail::host_copies;
using detail::pass_along;
using detail::ranks_text;
using detail::FlatCopy;


std::string Recovery::to_string() const {
  std::ostringstream out;
  out << (lost.size() == 1 ? "rank " : "ranks ") << ranks_text(lost) << (lost.size() == 1 ? " died" : " died")
      << " (seen in " << phase << ") at step " << failed_step << "; rolled back " << steps_rolled_back
      << (steps_rolled_back == 1 ? " step" : " steps") << " to step " << resume_step << "; world size "
      << old_world_size << " -> " << world_size << "; recovered in ";
  char seconds_text[32];
  std::snprintf(seconds_text, sizeof(seconds_text), "%.1f s", seconds);
  out << seconds_text;
  return out.str();
}

Resilient::Resilient(std::shared_ptr<ProcessGroup> group, std::shared_ptr<torch::nn::Module> module,
                     MakeOptimizer make_optimizer, MakeDDP make_ddp, ResilienceOptions options)
    : group_(std::move(group)),
      module_(std::move(module)),
      make_optimizer_(std::move(make_optimizer)),
      make_ddp_(std::move(make_ddp)),
      options_(options) {
  SHARDOPT_CHECK(group_, "Resilient needs a process group, got null");
  SHARDOPT_CHECK(module_, "Resilient needs the module whose parameters the optimizer steps, got null");
  SHARDOPT_CHECK(make_optimizer_, "Resilient needs a function that makes the optimizer, got an empty one");
  base_store_ = group_->store();
  if (group_->joining()) {  // Note [A replacement joins]
    SHARDOPT_CHECK(options_.refresh_every() >= 1, "ResilienceOptions::refresh_every must be >= 1, got ",
                   options_.refresh_every());
    SHARDOPT_CHECK(options_.min_world_size() >= 1, "ResilienceOptions::min_world_size must be >= 1, got ",
                   options_.min_world_size());
    const auto world = base_store_->get("shardopt/resilient/world");
    original_world_ = std::stoi(std::string(world.begin(), world.end()));
    join();
    return;
  }
  original_world_ = group_->size();
  // A world of 1 is refused here and now (there is nobody to wait for). Other bad options are
  // local too: every rank checks its own, then all agree, so that no rank is left waiting in a
  // collective the others never reach.
  SHARDOPT_CHECK(group_->size() >= 2, "surviving a dead rank needs at least 2 ranks (the second copy of every shard ",
                 "lives on another rank); this group has 1");
  std::string problem;
  if (options_.refresh_every() < 1) {
    problem = "ResilienceOptions::refresh_every must be >= 1, got " + std::to_string(options_.refresh_every());
  } else if (options_.min_world_size() < 1) {
    problem = "ResilienceOptions::min_world_size must be >= 1, got " + std::to_string(options_.min_world_size());
  } else if (!group_->store()) {
    problem = "surviving a dead rank needs the group's rendezvous store (make the group with init_process_group)";
  }
  const int64_t scaler = options_.grad_scaler() ? 1 : 0;
  const auto all = group_->allgather_ints(
      {problem.empty() ? 0 : 1, options_.refresh_every(), options_.min_world_size(), scaler});
  for (int r = 0; r < group_->size(); ++r) {
    SHARDOPT_CHECK(all[r][0] == 0, "", r == group_->rank() ? problem : group_->describe_rank(r) + " refused its "
                   "ResilienceOptions: " + (all[r][1] < 1 ? "refresh_every " + std::to_string(all[r][1]) + " (must be >= 1)"
                   : all[r][2] < 1 ? "min_world_size " + std::to_string(all[r][2]) + " (must be >= 1)" : "no store"));
  }
  for (int r = 1; r < group_->size(); ++r) {
    SHARDOPT_CHECK(all[r][1] == all[0][1] && all[r][2] == all[0][2], "ResilienceOptions differ between ranks: rank 0 "
                   "has refresh_every ", all[0][1], " and min_world_size ", all[0][2], ", ", group_->describe_rank(r),
                   " has refresh_every ", all[r][1], " and min_world_size ", all[r][2]);
    // The loss scale travels in the copies (ResilienceOptions::grad_scaler): every rank passes
    // one, or none.
    SHARDOPT_CHECK(all[r][3] == all[0][3], "ResilienceOptions differ between ranks: rank 0 ",
                   all[0][3] ? "passes" : "does not pass", " a grad_scaler, ", group_->describe_rank(r),
                   all[r][3] ? " passes one" : " does not");
  }
  detail::GroupRecovery::watch_failures(*group_);
  build();
  // Every rank is past init_process_group now: a process that arrives later replaces one (Note
  // [Closed rendezvous], Note [A replacement joins]).
  if (group_->rank() == 0) {
    const std::string world = std::to_string(group_->size());
    base_store_->set("shardopt/resilient/world", std::vector<uint8_t>(world.begin(), world.end()));
    close_rendezvous(*base_store_);
  }
}

Resilient::~Resilient() {
  // Replacements still waiting are told the run has ended rather than left to their timeout.
  try {
    if (group_ && !detail::GroupRecovery::broken(*group_) && !group_->joining() && group_->rank() == 0 && base_store_) {
      const int64_t requests = base_store_->add("shardopt/join/requests", 0);
      const std::string answer = "refused: the run ended before it could admit it";
      for (int64_t id = handled_requests_ + 1; id <= requests; ++id) {
        base_store_->set("shardopt/join/" + std::to_string(id) + "/answer",
                         std::vector<uint8_t>(answer.begin(), answer.end()));
      }
    }
  } catch (const std::exception&) {
    // The store is gone: nobody is waiting on it either.
  }
}

int Resilient::rank() const { return group_->rank(); }
int Resilient::world_size() const { return group_->size(); }

void Resilient::build() {
  optimizer_ = make_optimizer_(group_);
  SHARDOPT_CHECK(optimizer_, "Resilient: the function that makes the optimizer returned null");
  SHARDOPT_CHECK(&optimizer_->process_group() == group_.get() || &optimizer_->global_group() == group_.get(),
                 "Resilient: the optimizer must be made over the group it is given");
  if (make_ddp_) {
    ddp_ = make_ddp_(*optimizer_);
    SHARDOPT_CHECK(ddp_, "Resilient: the function that makes ShardedDDP returned null");
  }
  replicated_ = &optimizer_->process_group() != &optimizer_->global_group();  // replica blocks
}

int64_t Resilient::refreshed_at() const { return current_ ? current_->step : -1; }

int64_t Resilient::copy_bytes() const {
  return (current_ ? current_->bytes() : 0) + (previous_ ? previous_->bytes() : 0);
}

std::string Resilient::describe() const {
  std::ostringstream out;
  if (replicated_) {
    out << "replica blocks (every shard lives in each of the " << group_->size() / optimizer_->process_group().size()
        << " blocks of " << optimizer_->process_group().size() << " ranks), this rank's own copy refreshed every ";
  } else {
    out << "buddy copies of every shard (rank r keeps rank r-1's, in host memory), refreshed every ";
  }
  out << options_.refresh_every() << (options_.refresh_every() == 1 ? " step" : " steps") << "; runs on while at least "
      << options_.min_world_size() << (options_.min_world_size() == 1 ? " rank is" : " ranks are") << " left";
  return out.str();
}

void Resilient::refresh(int64_t step) {
  CommPhase phase("refreshing the copies");
  if (ddp_) ddp_->finish_param_sync();
  optimizer_->finish_param_sync();
  // The copies of two refreshes ago are needed no longer: once any rank refreshes again, every
  // rank holds the last refresh complete (each rank's refresh ends with its buddy's part, and the
  // all-reduce that looks for replacements after it, and the step since, had every rank in
  // them). Their memory takes the new copies.
  const std::unique_ptr<Copy> spare = std::move(previous_);
  auto copy = std::make_unique<Copy>();
  copy->step = step;
  {
    at::NoGradGuard no_grad;
    copy->params = host_copies(module_->parameters(), spare ? std::move(spare->params) : std::vector<at::Tensor>{});
    copy->buffers = host_copies(module_->buffers(), spare ? std::move(spare->buffers) : std::vector<at::Tensor>{});
  }
  // The shard's state as views of the slabs: flatten() copies them once, into the copy's bytes.
  copy->own = detail::flatten(optimizer_->state_shard_view(), spare ? spare->own.bytes : at::Tensor());
  if (auto* scaler = options_.grad_scaler()) {
    copy->loss_scale = scaler->get_scale();
    copy->growth_tracker = scaler->growth_tracker();
  }
  // From here the new copy is this rank's own; the previous one stays until its buddy part came.
  const int w = group_->size(), r = group_->rank();
  auto fresh = std::move(copy);
  previous_ = std::move(current_);
  current_ = std::move(fresh);
  // Under replica blocks every shard is already held in every block (Note [Replica blocks]).
  if (!replicated_ && w > 1) {  // (a run left with one rank has no buddy: another failure ends it)
    current_->buddy = pass_along(*group_, current_->own, (r + 1) % w, (r + w - 1) % w, spare ? spare->buddy.bytes : at::Tensor());
  }
  current_->has_buddy = true;
  // Both generations are complete on this rank: the older one is needed only while another rank
  // may still lack the newer; it goes at the next refresh.
}

// Note [Installing the state on a new group]
// Recovery and admission end alike, over the new group: every member says which old ranks'
// shards it offers (survivors their own, and a lost buddy's; a joiner none), and the first member
// that offers an old rank's shard sends it. Where some member offers nothing (a joiner, with only
// its fresh initialisation), the parameters and buffers go from the first member that offers a
// shard; where every member offers one (a recovery), nothing is sent for them: each survivor put
// them back from its own copy of the same refresh, the same bits on every survivor (Note
// [Parameter wire]). Then the optimizer and ShardedDDP are built anew over the new group, and
// each member receives, of every old shard, only the ranges its new holdings overlap (Note [Each
// rank receives its own ranges] in csrc/optim/state_migration.cpp), and the copies are refreshed.
int64_t Resilient::install(int64_t step, const std::vector<std::pair<int64_t, const FlatCopy*>>& offers) {
  std::vector<int64_t> mine;
  for (const auto& o : offers) mine.push_back(o.first);
  const auto all = group_->allgather_ints(mine);
  int root = -1;
  int64_t old_world = 0;
  for (int i = 0; i < group_->size(); ++i) {
    if (root < 0 && !all[i].empty()) root = i;
    for (int64_t d : all[i]) old_world = std::max(old_world, d + 1);
  }
  SHARDOPT_CHECK(root >= 0, "no member of the new group holds any shard");
  const bool every_member_holds = std::none_of(all.begin(), all.end(), [](const auto& o) { return o.empty(); });
  if (!every_member_holds) {
    at::NoGradGuard no_grad;
    // The root's dtypes first: under mixed precision the members' parameters are in param_dtype
    // (their optimizer made them so), a joiner's are still as its model was built.
    auto params = module_->parameters();
    auto buffers = module_->buffers();
    std::vector<int64_t> codes;
    for (const auto& p : params) codes.push_back(static_cast<int64_t>(p.scalar_type()));
    for (const auto& b : buffers) codes.push_back(static_cast<int64_t>(b.scalar_type()));
    at::Tensor dtypes = at::tensor(codes, at::kLong);
    group_->broadcast(dtypes, root);
    for (size_t i = 0; i < params.size() + buffers.size(); ++i) {
      at::Tensor& t = i < params.size() ? params[i] : buffers[i - params.size()];
      const auto dtype = static_cast<at::ScalarType>(dtypes[static_cast<int64_t>(i)].item<int64_t>());
      if (t.scalar_type() != dtype) t.set_data(t.detach().to(dtype));
    }
    for (auto& p : params) {
      at::Tensor data = p.detach();
      group_->broadcast(data, root);
      p.mutable_grad() = at::Tensor();
    }
    for (auto& b : buffers) group_->broadcast(b, root);
  }
  if (auto* scaler = options_.grad_scaler(); scaler && !every_member_holds) {  // the loss scale, as the root holds it
    at::Tensor v = at::tensor({scaler->get_scale(), static_cast<double>(scaler->growth_tracker())}, at::kDouble);
    group_->broadcast(v, root);
    scaler->load(v[0].item<double>(), static_cast<int64_t>(v[1].item<double>()));
  }
  // Each old rank's shard is sent from the first member that offers it, and only in the ranges
  // each member holds under the new partition.
  std::vector<c10::IValue> held;
  for (int64_t d = 0; d < old_world; ++d) {
    int holder = -1;
    for (int i = 0; i < group_->size() && holder < 0; ++i) {
      if (std::find(all[i].begin(), all[i].end(), d) != all[i].end()) holder = i;
    }
    SHARDOPT_CHECK(holder >= 0, "no member of the new group holds the shard of old rank ", d);
    if (holder != group_->rank()) continue;
    for (const auto& o : offers) {
      if (o.first == d) held.push_back(detail::unflatten(*o.second));
    }
  }
  // The options (learning rates a schedule changed, say) as the root's shards hold them: every
  // member's are the same refresh's, and a joiner has none.
  FlatCopy param_groups;
  if (group_->rank() == root) param_groups = detail::flatten(held.front().toGenericDict().at("param_groups"));
  detail::broadcast_copy(*group_, param_groups, root);
  build();
  const int64_t received = optimizer_->load_state_shards(held, detail::unflatten(param_groups)).state_bytes_received;
  held.clear();
  current_.reset();
  previous_.reset();
  refresh(step);
  return received;
}

c10::intrusive_ptr<c10d::Store> Resilient::generation_store() const {
  return c10::make_intrusive<c10d::PrefixStore>("shardopt/generation/" + std::to_string(generation_) + "/", base_store_);
}

StepResult Resilient::step(int64_t step, const std::function<void()>& body) { return run_step(step, body, false); }

StepResult Resilient::step_by(int64_t step, const std::function<void()>& whole_step) {
  return run_step(step, whole_step, true);
}

StepResult Resilient::run_step(int64_t step, const std::function<void()>& body, bool steps_itself) {
  SHARDOPT_CHECK(!admission_failed_, "step ", step, ": this resilient run failed while admitting a replacement and ",
                 "cannot go on; restart from the last checkpoint");
  StepResult result;
  int64_t at = step;  // the step boundary a failure is counted at
  try {
    if (!current_ || step < current_->step) refresh(step);  // the first copies, or a loop that went back
    body();
    if (!steps_itself) optimizer_->step();
    result.next_step = step + 1;
    // After the step, so that refresh_every 1 loses no completed step (a failure between steps,
    // in a checkpoint say, goes back to the step just completed).
    at = result.next_step;
    if (result.next_step - current_->step >= options_.refresh_every()) {
      refresh(result.next_step);
      result.admission = admit_waiting(result.next_step);
    }
    return result;
  } catch (const std::exception&) {
    // Not a failure of the group (the caller's error), or one during an admission: not survived.
    if (admission_failed_ || !detail::GroupRecovery::broken(*group_)) throw;
  }
  result.recovery = recover(at, detail::GroupRecovery::failure_phase(*group_));
  result.next_step = result.recovery->resume_step;
  return result;
}

std::optional<Recovery> Resilient::run(int64_t step, const std::function<void()>& work) {
  SHARDOPT_CHECK(!admission_failed_, "step ", step, ": this resilient run failed while admitting a replacement and ",
                 "cannot go on; restart from the last checkpoint");
  try {
    work();
    return std::nullopt;
  } catch (const std::exception&) {
    if (!detail::GroupRecovery::broken(*group_)) throw;
  }
  return recover(step, detail::GroupRecovery::failure_phase(*group_));
}

Recovery Resilient::recover(int64_t failed_step, const std::string& phase) {
  try {
    return recover_from(failed_step, phase);
  } catch (const c10::Error& e) {
    const std::string cause = e.what_without_backtrace();
    const std::string prefix = "shardopt: ";
    SHARDOPT_CHECK(false, "recovery after a failure in ", phase.empty() ? "no phase" : phase, " at step ", failed_step,
                   " failed: ", cause.rfind(prefix, 0) == 0 ? cause.substr(prefix.size()) : cause);
  }
  return {};
}

Recovery Resilient::recover_from(int64_t failed_step, const std::string& phase) {
  const auto start = Clock::now();
  std::shared_ptr<ProcessGroup> old = group_;
  detail::GroupRecovery::mark_broken(*old, phase);  // the others leave their phase too (it is marked already when a collective failed)
  const int old_world = old->size();
  SHARDOPT_CHECK(current_, "global rank ", old->global_rank(), " saw a failure in ", phase,
                 " before the first copy of the shards was made (the copies are made at the first step()); restart ",
                 "from the last checkpoint");
  const detail::Survivors who = detail::agree_on_survivors(*old);
  std::vector<int> lost_global;
  for (int r : who.lost) lost_global.push_back(old->global_ranks()[r]);
  SHARDOPT_CHECK(!who.lost.empty(), "the group failed in ", phase, " but every rank is still there (",
                 "a collective timed out or failed without a rank dying",
                 detail::GroupRecovery::failure_cause(*old).empty() ? std::string() : "; here: " + detail::GroupRecovery::failure_cause(*old),
                 "); restart from the last checkpoint");
  const int new_world = static_cast<int>(who.alive.size());
  SHARDOPT_CHECK(new_world >= options_.min_world_size(), "global rank", lost_global.size() == 1 ? " " : "s ",
                 ranks_text(lost_global), lost_global.size() == 1 ? " died" : " died", "; ", new_world,
                 new_world == 1 ? " rank is" : " ranks are", " left, fewer than min_world_size ",
                 options_.min_world_size(), "; restart from the last checkpoint");
  auto is_lost = [&](int r) { return std::find(who.lost.begin(), who.lost.end(), r) != who.lost.end(); };
  // Note [Replica blocks]: block b is ranks [b*B, (b+1)*B), and rank r holds shard r % B.
  const int block = replicated_ ? optimizer_->process_group().size() : 0;
  if (replicated_) {
    for (int i = 0; i < block; ++i) {
      bool held = false;
      std::vector<int> holders;
      for (int r = i; r < old_world; r += block) {
        held = held || !is_lost(r);
        holders.push_back(old->global_ranks()[r]);
      }
      SHARDOPT_CHECK(held, "every copy of shard ", i, " is lost: global ranks ", ranks_text(holders),
                     ", which held it in each block, died; restart from the last checkpoint");
    }
  } else {
    for (int d : who.lost) {
      const int holder = (d + 1) % old_world;
      SHARDOPT_CHECK(!is_lost(holder), "both copies of global rank ", old->global_ranks()[d],
                     "'s shard are lost: it died, and so did global rank ", old->global_ranks()[holder],
                     ", which kept its copy; restart from the last checkpoint");
    }
  }

  // The broken group's objects go; its backend is kept, not destroyed (it may be blocked on the dead).
  CommPhase rebuilding("recovery (rebuilding the group and the shards)");
  detail::orphan_pending_save(*optimizer_);  // its group is being replaced
  ddp_.reset();
  optimizer_.reset();
  detail::GroupRecovery::abandon(*old);
  ++generation_;
  auto store = generation_store();
  // Each survivor says it is joining, so that a failure to make the new group names who did not.
  store->set("shardopt/joining/" + std::to_string(old->global_rank()), std::vector<uint8_t>{1});
  try {
    group_ = detail::GroupRecovery::regroup(*old, store, who.alive);
  } catch (const c10::Error& e) {
    std::vector<int> missing;
    for (int r : who.alive) {
      const int global = old->global_ranks()[r];
      try {
        if (!store->check({"shardopt/joining/" + std::to_string(global)})) missing.push_back(global);
      } catch (const std::exception&) {
        break;  // the store is gone: the error below says the rest
      }
    }
    SHARDOPT_CHECK(missing.empty(), "global rank", missing.size() == 1 ? " " : "s ", ranks_text(missing),
                   " did not join the new group within ", old->timeout().count(), " ms (died during recovery?)");
    throw;
  }
  detail::GroupRecovery::watch_failures(*group_);

  // Which refresh to go back to: the newest that every survivor holds, with the lost ranks' copies.
  auto held = [](const std::unique_ptr<Copy>& c) {
    return std::vector<int64_t>{c ? c->step : -1, c && c->has_buddy ? 1 : 0};
  };
  std::vector<int64_t> mine = held(current_);
  const auto previous_held = held(previous_);
  mine.insert(mine.end(), previous_held.begin(), previous_held.end());
  const auto all = group_->allgather_ints(mine);
  int64_t chosen = -1;
  for (int64_t candidate : {mine[0], mine[2]}) {
    if (candidate < 0 || candidate <= chosen) continue;
    bool ok = true;
    for (int i = 0; i < new_world && ok; ++i) {
      const auto& h = all[i];
      const int old_r = who.alive[i];
      const bool holds = h[0] == candidate || h[2] == candidate;
      const bool holds_buddy = (h[0] == candidate && h[1]) || (h[2] == candidate && h[3]);
      ok = holds && (!is_lost((old_r + old_world - 1) % old_world) || holds_buddy);
    }
    if (ok) chosen = candidate;
  }
  // Every survivor computed the same choice from the same table; one all-reduce checks it.
  at::Tensor agreed = at::tensor({chosen, -chosen}, at::kLong);
  group_->allreduce(agreed, Reduction::kMax);
  SHARDOPT_CHECK(chosen >= 0 && agreed[0].item<int64_t>() == chosen && agreed[1].item<int64_t>() == -chosen,
                 "the survivors hold no complete copy of every shard from one refresh (global rank ",
                 group_->global_rank(), " holds the copies of steps ", mine[0], mine[1] ? "" : " (incomplete)", " and ",
                 mine[2], mine[3] ? "" : " (incomplete)", "; -1: none): a rank died during the first refresh; restart ",
                 "from the last checkpoint");
  std::unique_ptr<Copy>& use = current_ && current_->step == chosen ? current_ : previous_;

  // Parameters and buffers as at the refresh, in fresh storage.
  {
    at::NoGradGuard no_grad;
    auto params = module_->parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      params[i].set_data(use->params[i].to(params[i].device(), params[i].scalar_type(), false, true));
      params[i].mutable_grad() = at::Tensor();
    }
    auto buffers = module_->buffers();
    for (size_t i = 0; i < buffers.size(); ++i) {
      buffers[i].set_data(use->buffers[i].to(buffers[i].device(), buffers[i].scalar_type(), false, true));
    }
  }
  if (auto* scaler = options_.grad_scaler()) scaler->load(use->loss_scale, use->growth_tracker);
  // Each survivor offers its own shard, and (buddy copies) its buddy's when the buddy is lost.
  const int my_old = who.alive[group_->rank()], buddy_old = (my_old + old_world - 1) % old_world;
  std::vector<std::pair<int64_t, const FlatCopy*>> offers{{replicated_ ? my_old % block : my_old, &use->own}};
  if (!replicated_ && is_lost(buddy_old)) offers.emplace_back(buddy_old, &use->buddy);
  const int64_t received = install(chosen, offers);

  Recovery event;
  event.lost = lost_global;
  event.phase = phase.empty() ? "no phase" : phase;
  event.old_world_size = old_world;
  event.world_size = group_->size();
  event.rank = group_->rank();
  event.global_rank = group_->global_rank();
  event.failed_step = failed_step;
  event.resume_step = chosen;
  event.steps_rolled_back = failed_step - chosen;
  event.state_bytes_received = received;
  event.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  recoveries_.push_back(event);
  for (const auto& callback : callbacks_) callback(event);
  return event;
}

}  // namespace shardopt
