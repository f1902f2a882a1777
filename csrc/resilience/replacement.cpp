// A replacement joining a resilient run (Note [A replacement joins]): the run's side, which
// admits or refuses it after a refresh, and the replacement's, which asks and waits.
#include <shardopt/resilience/resilient.h>
#include <shardopt/check.h>
#include <shardopt/version.h>

#include "checkpoint/snapshot.h"
#include "comm/group_recovery.h"
#include "resilience/copies.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <sstream>

namespace shardopt {

using detail::ranks_text;
using Clock = std::chrono::steady_clock;

std::string Admission::to_string() const {
  std::ostringstream out;
  if (!joined.empty()) {
    out << (joined.size() == 1 ? "global rank " : "global ranks ") << ranks_text(joined) << " joined at step " << step
        << "; world size " << old_world_size << " -> " << world_size << "; in ";
    char seconds_text[32];
    std::snprintf(seconds_text, sizeof(seconds_text), "%.2f s", seconds);
    out << seconds_text;
  }
  for (const auto& why : refused) out << (out.tellp() > 0 ? "; " : "") << "refused a replacement: " << why;
  return out.str();
}

namespace {
constexpr const char* kJoinRequests = "shardopt/join/requests";
std::string join_key(int64_t id) { return "shardopt/join/" + std::to_string(id); }
std::string answer_key(int64_t id) { return "shardopt/join/" + std::to_string(id) + "/answer"; }
std::vector<std::string> split_text(const std::string& text) {
  std::vector<std::string> parts;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) parts.push_back(item);
  return parts;
}
std::string announced_version() {
  const char* v = std::getenv("SHARDOPT_ANNOUNCE_VERSION");
  return v && *v ? v : version();
}
std::string announced_torch_version() {
  const char* v = std::getenv("SHARDOPT_ANNOUNCE_TORCH_VERSION");
  return v && *v ? v : torch_version();
}
}  // namespace

// Note [A replacement joins]
// A process started for a rank the run lost (by a launcher, or by hand with the same variables)
// finds the rendezvous closed (Note [Closed rendezvous]): init_process_group gives it a group of
// one that is joining, and its Resilient asks to be admitted: it adds itself to a counter of
// requests and writes its global rank, shardopt version and options under its number. The run
// looks at the counter after each refresh of its copies (one all-reduce of the count every rank
// read, so that all decide on the same requests), refuses a request whose version or options differ or whose rank
// is a member (the answer says why, and the joiner fails with it), and admits the others: rank 0
// writes each an answer with the next generation, the step, the requests handled and the member
// list; every member makes the new group, and the state is installed (Note [Installing the state
// on a new group]). The joiner starts its loop at start_step(). A failure while the new group is
// made or the state installed is not survived: the copies were made over the group before, the
// failure is seen on the new one, and a recovery would number one group's shards by the other's
// ranks. It is an error on every member, and the run's later steps raise it again.
std::optional<Admission> Resilient::admit_waiting(int64_t step) {
  at::Tensor count = at::tensor({base_store_->add(kJoinRequests, 0)}, at::kLong);
  group_->allreduce(count, Reduction::kMin);
  const int64_t requests = count.item<int64_t>();
  if (requests <= handled_requests_) return std::nullopt;
  const auto start = Clock::now();
  Admission a;
  a.old_world_size = group_->size();
  a.step = step;
  std::vector<int> members = group_->global_ranks();
  std::vector<int64_t> admitted_ids;
  for (int64_t id = handled_requests_ + 1; id <= requests; ++id) {
    const auto raw = base_store_->get(join_key(id));
    const auto f = split_text(std::string(raw.begin(), raw.end()));
    std::string why;
    if (f.size() != 5) {
      why = "request " + std::to_string(id) + " is malformed";
    } else {
      const int global = std::stoi(f[0]);
      if (f[1] != version()) {
        why = "global rank " + f[0] + " runs shardopt " + f[1] + ", this run " + version();
      } else if (f[4] != torch_version()) {
        why = "global rank " + f[0] + " runs LibTorch " + f[4] + ", this run " + torch_version();
      } else if (global < 0 || global >= original_world_) {
        why = "global rank " + f[0] + " is outside this run's ranks 0.." + std::to_string(original_world_ - 1);
      } else if (std::find(members.begin(), members.end(), global) != members.end()) {
        why = "global rank " + f[0] + " is still a member";
      } else if (std::stoll(f[2]) != options_.refresh_every() || std::stoll(f[3]) != options_.min_world_size()) {
        why = "global rank " + f[0] + " has refresh_every " + f[2] + " and min_world_size " + f[3] + ", this run " +
              std::to_string(options_.refresh_every()) + " and " + std::to_string(options_.min_world_size());
      } else {
        members.push_back(global);
        a.joined.push_back(global);
        admitted_ids.push_back(id);
      }
    }
    if (!why.empty()) {
      a.refused.push_back(why);
      if (group_->rank() == 0) {
        const std::string answer = "refused: " + why;
        base_store_->set(answer_key(id), std::vector<uint8_t>(answer.begin(), answer.end()));
      }
    }
  }
  handled_requests_ = requests;
  if (a.joined.empty()) return a;
  std::sort(members.begin(), members.end());
  ++generation_;
  if (group_->rank() == 0) {
    std::string answer = std::to_string(generation_) + "," + std::to_string(step) + "," + std::to_string(requests);
    for (int m : members) answer += "," + std::to_string(m);
    for (int64_t id : admitted_ids) base_store_->set(answer_key(id), std::vector<uint8_t>(answer.begin(), answer.end()));
  }
  CommPhase phase("admitting a replacement");
  const detail::FlatCopy own = current_->own;  // (install() refreshes the copies)
  const int my_old = replicated_ ? optimizer_->process_group().rank() : group_->rank();
  try {
    detail::orphan_pending_save(*optimizer_);  // its group is being replaced
    ddp_.reset();
    optimizer_.reset();
    std::shared_ptr<ProcessGroup> old = group_;
    group_ = detail::GroupRecovery::form(*old, generation_store(), members);
    detail::GroupRecovery::watch_failures(*group_);
    detail::GroupRecovery::abandon(*old);
    CommPhase installing("admitting a replacement (installing the state)");
    install(step, {{my_old, &own}});
    // A member that failed before here fails this on every other, so that all end alike.
    group_->barrier();
  } catch (const c10::Error& e) {
    // The copies were made over the group before the admission, the failure is seen on the new
    // one: recovering from it would number the shards of one group by the ranks of the other.
    admission_failed_ = true;
    const std::string cause = e.what_without_backtrace();
    const std::string prefix = "shardopt: ";
    SHARDOPT_CHECK(false, "a failure while admitting global rank", a.joined.size() == 1 ? " " : "s ",
                   ranks_text(a.joined), " at step ", step, ": ",
                   cause.rfind(prefix, 0) == 0 ? cause.substr(prefix.size()) : cause,
                   "; a failure during an admission is not survived: restart from the last checkpoint");
  }
  a.world_size = group_->size();
  a.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return a;
}

void Resilient::join() {
  const int global = group_->global_rank();
  const int64_t id = base_store_->add(kJoinRequests, 1);
  const std::string request = std::to_string(global) + "," + announced_version() + "," +
                              std::to_string(options_.refresh_every()) + "," + std::to_string(options_.min_world_size()) +
                              "," + announced_torch_version();
  base_store_->set(join_key(id), std::vector<uint8_t>(request.begin(), request.end()));
  try {
    base_store_->wait({answer_key(id)}, group_->timeout());
  } catch (const std::exception&) {
    SHARDOPT_CHECK(false, "global rank ", global, " was started to replace a rank of a resilient run, which did not ",
                   "admit it within ", group_->timeout().count(), " ms (the run admits replacements after a refresh ",
                   "of its copies; it may have ended)");
  }
  const auto raw = base_store_->get(answer_key(id));
  const std::string answer(raw.begin(), raw.end());
  SHARDOPT_CHECK(answer.rfind("refused: ", 0) != 0, "global rank ", global, " was started to replace a rank of a ",
                 "resilient run, which refused it: ", answer.substr(9));
  const auto f = split_text(answer);
  generation_ = std::stoi(f[0]);
  start_step_ = std::stoll(f[1]);
  handled_requests_ = std::stoll(f[2]);
  std::vector<int> members;
  for (size_t i = 3; i < f.size(); ++i) members.push_back(std::stoi(f[i]));
  std::shared_ptr<ProcessGroup> alone = group_;
  try {
    group_ = detail::GroupRecovery::form(*alone, generation_store(), members);
    detail::GroupRecovery::watch_failures(*group_);
    CommPhase installing("admitting a replacement (installing the state)");
    install(start_step_, {});
    group_->barrier();  // the members' last collective of the admission
  } catch (const c10::Error& e) {
    const std::string cause = e.what_without_backtrace();
    const std::string prefix = "shardopt: ";
    SHARDOPT_CHECK(false, "a failure while global rank ", global, " was being admitted at step ", start_step_, ": ",
                   cause.rfind(prefix, 0) == 0 ? cause.substr(prefix.size()) : cause,
                   "; a failure during an admission is not survived: restart from the last checkpoint");
  }
}

}  // namespace shardopt
