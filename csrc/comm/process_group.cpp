#include <shardopt/comm/process_group.h>
#include <shardopt/check.h>

#include "comm/failure_watch.h"
#include "comm/heartbeat.h"
#include "comm/sum_into.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstdlib>
#include <sstream>

namespace shardopt {

// ---- stats --------------------------------------------------------------------------------

int64_t CommStats::total_calls() const {
  int64_t n = 0;
  for (auto c : calls) n += c;
  return n;
}

int64_t CommStats::total_bytes() const {
  int64_t n = 0;
  for (auto b : bytes) n += b;
  return n;
}

const char* CommStats::name(Kind kind) {
  static const char* names[] = {"broadcast", "allreduce", "reduce", "allgather", "reduce_scatter",
                                "send", "recv", "barrier"};
  return names[kind];
}

std::string CommStats::to_string() const {
  std::ostringstream out;
  for (int k = 0; k < kNumKinds; ++k) {
    if (calls[k] == 0) continue;
    out << name(static_cast<Kind>(k)) << ": " << calls[k] << " calls, " << bytes[k] << " bytes; ";
  }
  return out.str();
}

// ---- work ---------------------------------------------------------------------------------

PendingWork::PendingWork(c10::intrusive_ptr<c10d::Work> work, std::string what, int rank,
                         std::chrono::milliseconds timeout, std::function<std::string()> diagnose)
    : work_(std::move(work)), diagnose_(std::move(diagnose)), what_(std::move(what)), rank_(rank), timeout_(timeout) {}

PendingWork::~PendingWork() = default;
PendingWork::PendingWork(PendingWork&&) noexcept = default;
PendingWork& PendingWork::operator=(PendingWork&&) noexcept = default;

void PendingWork::also_wait_for(c10::intrusive_ptr<c10d::Work> work) { more_.push_back(std::move(work)); }

void PendingWork::set_failure_watch(std::shared_ptr<detail::GroupFailure> failure) { failure_ = std::move(failure); }

void PendingWork::wait_one(const c10::intrusive_ptr<c10d::Work>& work) {
  if (!failure_ || !failure_->watching) {
    TORCH_CHECK(work->wait(timeout_), "not completed");
    return;
  }
  // Note [Failure watch]
  TORCH_CHECK(!failure_->broken, "the group is broken: a rank saw a failure");
  struct Waiting {
    std::atomic<int>& waits;
    explicit Waiting(std::atomic<int>& w) : waits(w) { ++waits; }
    ~Waiting() { --waits; }
  } waiting(failure_->waits);
  if (!detail::waits_in_slices(*work)) {
    failure_->wait_watched(work, timeout_);
    return;
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    try {
      if (work->wait(std::max(std::chrono::milliseconds(1), std::min(left, std::chrono::milliseconds(100))))) return;
    } catch (const std::exception&) {
      // A slice that ends as the work completes throws "Operation timed out!" for a work that then
      // reads as completed: its outcome is its own untimed wait's (at once: it is complete), which
      // throws only the work's own error.
      if (work->isCompleted()) {
        work->wait();
        return;
      }
      if (std::chrono::steady_clock::now() >= deadline) throw;
    }
    TORCH_CHECK(!failure_->broken, "abandoned: a rank saw a failure");
  }
}

void PendingWork::and_then(std::function<void()> next) {
  if (!then_) {
    then_ = std::move(next);
    return;
  }
  then_ = [first = std::move(then_), next = std::move(next)] {
    first();
    next();
  };
}

bool PendingWork::completed() {
  if (!work_) return true;
  if (!work_->isCompleted()) return false;
  if (!std::all_of(more_.begin(), more_.end(), [](const auto& w) { return w->isCompleted(); })) return false;
  seen_complete();
  return true;
}

void PendingWork::on_timeline(timeline::Lane lane, std::string name) {
  if (!timeline::recording() || !work_) return;
  timeline_lane_ = static_cast<int>(lane);
  timeline_name_ = std::move(name);
  timeline_begin_us_ = timeline::now_us();
}

void PendingWork::seen_complete() {
  if (timeline_lane_ < 0) return;
  timeline::record(static_cast<timeline::Lane>(timeline_lane_), std::move(timeline_name_), rank_, timeline_begin_us_,
                   timeline::now_us());
  timeline_lane_ = -1;
}

void PendingWork::wait() {
  if (!work_) return;
  // A wait that blocks, on the timeline (Note [Timeline] in comm/timeline.cpp).
  const bool timed = timeline::recording() && !completed();
  const int64_t waited_from = timed ? timeline::now_us() : 0;
  auto work = std::move(work_);
  auto more = std::move(more_);
  try {
    wait_one(work);
    for (auto& w : more) wait_one(w);
  } catch (const std::exception& e) {
    std::string cause = e.what();
    cause = cause.substr(0, cause.find('\n'));
    // The phase the work was started in is in what_; the one it was waited for in may differ
    // (backward waits for the trainability check forward started).
    const std::string now = CommPhase::current();
    const std::string waited = now.empty() || what_.find("(" + now + ")") != std::string::npos
                                   ? std::string()
                                   : ", waited for in " + now;
    if (failure_ && failure_->watching) {
      failure_->mark(now.empty() ? what_ : now, what_ + waited + ": " + cause);
      SHARDOPT_CHECK(false, "", what_, waited, " on rank ", rank_, " failed (the group is broken; recovery follows): ",
                     cause);
    }
    const std::string gone = diagnose_ ? diagnose_() : std::string();
    SHARDOPT_CHECK(false, "", what_, waited, " on rank ", rank_, " failed or timed out (timeout ", timeout_.count(), " ms)",
                   gone.empty() ? std::string("; a peer may have exited or not called it") : "; " + gone, ": ", cause);
  }
  seen_complete();
  if (timed) timeline::record(timeline::Lane::kWait, "wait: " + what_, rank_, waited_from, timeline::now_us());
  if (then_) {
    auto then = std::move(then_);
    then();
  }
}

// ---- phases -------------------------------------------------------------------------------

namespace {
thread_local const char* current_phase = "";
}  // namespace

// SHARDOPT_FAULT_IN_PHASE=R:TEXT[:N][;R:TEXT[:N]...]: the process whose RANK is R kills itself
// (SIGKILL) when it enters, for the N-th time (1 by default), a phase whose name contains TEXT, in
// a process started by no restart (TORCHELASTIC_RESTART_COUNT unset or 0) and not as a replacement
// (SHARDOPT_REPLACEMENT unset). For tests of rank death in every phase.
namespace {
struct PhaseFault {
  std::string text;
  int64_t nth = 1;
  std::atomic<int64_t> seen{0};
  static std::vector<PhaseFault*>& all() {
    static std::vector<PhaseFault*>* faults = [] {
      auto* list = new std::vector<PhaseFault*>();
      const char* spec = std::getenv("SHARDOPT_FAULT_IN_PHASE");
      const char* rank = std::getenv("RANK");
      const char* restarts = std::getenv("TORCHELASTIC_RESTART_COUNT");
      const char* replacement = std::getenv("SHARDOPT_REPLACEMENT");
      if (!spec || !*spec || !rank || (restarts && std::string(restarts) != "0") ||
          (replacement && std::string(replacement) == "1")) {
        return list;
      }
      std::stringstream specs(spec);
      std::string text;
      while (std::getline(specs, text, ';')) {
        const auto first = text.find(':');
        SHARDOPT_CHECK(first != std::string::npos && first > 0, "SHARDOPT_FAULT_IN_PHASE: '", text,
                       "' is not RANK:TEXT[:N]");
        if (text.substr(0, first) != rank) continue;
        auto* f = new PhaseFault;
        const auto last = text.rfind(':');
        f->text = text.substr(first + 1, last > first ? last - first - 1 : std::string::npos);
        if (last > first) {
          const std::string n = text.substr(last + 1);
          SHARDOPT_CHECK(!n.empty() && n.find_first_not_of("0123456789") == std::string::npos && std::stoll(n) > 0,
                         "SHARDOPT_FAULT_IN_PHASE: '", text, "': N must be a positive integer, got '", n, "'");
          f->nth = std::stoll(n);
        }
        list->push_back(f);
      }
      return list;
    }();
    return *faults;
  }
};
}  // namespace

CommPhase::CommPhase(const char* phase) : previous_(current_phase) {
  current_phase = phase;
  for (auto* fault : PhaseFault::all()) {
    if (std::string(phase).find(fault->text) != std::string::npos && ++fault->seen == fault->nth) std::raise(SIGKILL);
  }
}
CommPhase::~CommPhase() { current_phase = previous_; }
const char* CommPhase::current() { return current_phase; }

// ---- process group ------------------------------------------------------------------------

namespace {

c10d::ReduceOp to_c10d(Reduction op) {
  switch (op) {
    case Reduction::kSum: return c10d::ReduceOp::SUM;
    case Reduction::kMax: return c10d::ReduceOp::MAX;
    case Reduction::kMin: return c10d::ReduceOp::MIN;
  }
  SHARDOPT_CHECK(false, "unknown reduction");
}

int64_t nbytes(const at::Tensor& t) {
  return static_cast<int64_t>(t.numel()) * static_cast<int64_t>(t.element_size());
}

}  // namespace

ProcessGroup::ProcessGroup(c10::intrusive_ptr<c10d::Backend> backend, std::chrono::milliseconds timeout)
    : backend_(std::move(backend)), timeout_(timeout) {
  SHARDOPT_CHECK(backend_, "ProcessGroup needs a c10d backend, got null");
  SHARDOPT_CHECK(timeout_.count() > 0, "ProcessGroup timeout must be positive, got ",
              timeout_.count(), " ms");
  backend_name_ = backend_->getBackendName();
  rank_ = backend_->getRank();
  size_ = backend_->getSize();
  for (int r = 0; r < size_; ++r) global_ranks_.push_back(r);
  failure_ = std::make_shared<detail::GroupFailure>();
}

c10::intrusive_ptr<c10d::Backend> ProcessGroup::native() const {
  return backend_;
}

// Starting a collective can fail too: NCCL makes its communicator at a group's first collective,
// and gives up when a peer has not come within the timeout (Note [NCCL timeouts]); Gloo refuses a
// send or receive at once on a connection a dead peer closed. That failure names the collective,
// the rank and, by the roll call, a peer that is gone, like a failed wait.
c10::intrusive_ptr<c10d::Work> ProcessGroup::start(CommStats::Kind kind,
                                                   const std::function<c10::intrusive_ptr<c10d::Work>()>& call) {
  if (failure_->watching && failure_->broken) {
    failure_->mark(*CommPhase::current() ? CommPhase::current() : label(CommStats::name(kind)), "");
    SHARDOPT_CHECK(false, "", label(CommStats::name(kind)), " on rank ", rank_,
                   " not started: the group is broken (a rank saw a failure; recovery follows)");
  }
  SHARDOPT_CHECK(backend_, "", label(CommStats::name(kind)), " on rank ", rank_,
                 ": this group was abandoned after a failure; use the group recovery made");
  try {
    return call();
  } catch (const std::exception& e) {
    std::string what = CommStats::name(kind);
    if (kind != CommStats::kSend && kind != CommStats::kRecv) what += " #" + std::to_string(sequence_);
    if (failure_->watching) {
      const std::string cause = e.what();
      failure_->mark(*CommPhase::current() ? CommPhase::current() : label(what),
                     label(what) + " could not start: " + cause.substr(0, cause.find('\n')));
      SHARDOPT_CHECK(false, "", label(what), " on rank ", rank_, " could not start (the group is broken; recovery ",
                     "follows): ", cause.substr(0, cause.find('\n')));
    }
    const std::string gone = roll_call();
    const std::string cause = e.what();
    SHARDOPT_CHECK(false, "", label(what), " on rank ", rank_, " could not start (timeout ", timeout_.count(), " ms)",
                   gone.empty() ? std::string("; a peer may have exited or not called it") : "; " + gone, ": ",
                   cause.substr(0, cause.find('\n')));
  }
  return {};
}

PendingWork ProcessGroup::track(CommStats::Kind kind, int64_t bytes,
                                const std::function<c10::intrusive_ptr<c10d::Work>()>& call) {
  return track(kind, bytes, start(kind, call));
}

PendingWork ProcessGroup::track(CommStats::Kind kind, int64_t bytes, c10::intrusive_ptr<c10d::Work> work) {
  stats_.calls[kind] += 1;
  stats_.bytes[kind] += bytes;
  std::string what = CommStats::name(kind);
  if (kind != CommStats::kSend && kind != CommStats::kRecv) what += " #" + std::to_string(sequence_);
  PendingWork pending(std::move(work), label(what), rank_, timeout_, [this] { return roll_call(); });
  pending.set_failure_watch(failure_);
  return pending;
}

std::string ProcessGroup::label(std::string what) const {
  if (*CommPhase::current()) what += std::string(" (") + CommPhase::current() + ")";
  if (global_ranks_[rank_] != rank_) what += " of the sub-group " + describe_sub();
  return what;
}

// Note [CPU tensors on NCCL]
// Note [Staging]
// NCCL moves CUDA tensors only, while the small control messages (agreement checks, the
// trainability hash, clipping's norm, the scaler's found-inf, serialized state and its sizes)
// are CPU tensors. In an NCCL group such a tensor travels through a copy on this rank's current
// CUDA device. The other way round, Gloo's collectives are CPU code: in a Gloo group a CUDA
// tensor travels through a copy in pinned host memory (from PyTorch's caching host allocator, so
// a step's buffers are reused, not pinned anew), which makes OSS and ShardedDDP on CUDA
// parameters work over Gloo, several ranks on one GPU included (NCCL refuses two ranks on one
// device). Either way the result is copied back when the work is waited on.
at::Tensor ProcessGroup::staged(const at::Tensor& tensor, bool copy_in) const {
  if (backend_name_ == "nccl" && tensor.device().is_cpu()) {
    if (!copy_in) return at::empty(tensor.sizes(), tensor.options().device(at::kCUDA));
    return tensor.to(at::Device(at::kCUDA), /*non_blocking=*/false, /*copy=*/true);
  }
  if (backend_name_ != "nccl" && tensor.device().is_cuda()) {
    at::Tensor host = at::empty(tensor.sizes(), tensor.options().device(at::kCPU).pinned_memory(true));
    if (copy_in) host.copy_(tensor);
    return host;
  }
  return tensor;
}

void ProcessGroup::unstage_after(PendingWork& work, at::Tensor tensor, const at::Tensor& staged) {
  if (staged.is_same(tensor)) return;
  work.set_then([tensor, staged]() mutable { tensor.copy_(staged); });
}

PendingWork ProcessGroup::broadcast_async(at::Tensor& tensor, int root, std::optional<at::ScalarType> wire) {
  SHARDOPT_CHECK(root >= 0 && root < size_, "broadcast root ", root, " is outside [0, ", size_, ")");
  if (wire && *wire != tensor.scalar_type() && size_ > 1) return broadcast_on_wire(tensor, root, *wire);
  check_in(CommStats::kBroadcast, nbytes(tensor), root);
  // The root's data goes out and comes back unchanged: only the others' copies are staged back.
  std::vector<at::Tensor> ts{staged(tensor, /*copy_in=*/rank_ == root)};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  opts.timeout = timeout_;
  auto work = track(CommStats::kBroadcast, nbytes(tensor), [&] { return backend_->broadcast(ts, opts); });
  if (rank_ != root) unstage_after(work, tensor, ts[0]);
  return work;
}

void ProcessGroup::broadcast(at::Tensor& tensor, int root) {
  broadcast_async(tensor, root).wait();
}

PendingWork ProcessGroup::allreduce_async(at::Tensor& tensor, Reduction op) {
  check_in(CommStats::kAllreduce, nbytes(tensor), -1);
  std::vector<at::Tensor> ts{staged(tensor)};
  c10d::AllreduceOptions opts;
  opts.reduceOp = to_c10d(op);
  opts.timeout = timeout_;
  auto work = track(CommStats::kAllreduce, nbytes(tensor), [&] { return backend_->allreduce(ts, opts); });
  unstage_after(work, tensor, ts[0]);
  return work;
}

void ProcessGroup::allreduce(at::Tensor& tensor, Reduction op) {
  allreduce_async(tensor, op).wait();
}


// Note [Reduce to one owner]
// Gloo's reduce is ring-based and moves more than the buffer: measured per rank with /proc/self/io
// (Gloo's TCP transport writes with writev), one reduce of a 1/N shard to each of N owners
// sends 1.16x the whole buffer at 2 ranks, 1.11x at 3 and 1.03x at 4, where (N-1)/N of it is
// the least any scheme can send (every rank's gradient of a range it does not own must leave
// it once), and Gloo's reduce-scatter is an all-reduce (2(N-1)/N). So a sum to one root is N-1
// direct transfers: every other rank sends its buffer, the root receives each into a scratch
// tensor and adds them, in rank order, when the work is waited on. With the owners of the
// buckets spread over the ranks, each rank sends (N-1)/N of the gradients per step, and with
// the parameter broadcast (Gloo's sends (N-1)/N of the buffer per rank) a step moves
// 2(N-1)/N, what a ring all-reduce moves (docs/benchmarks-log.md, bytes on the wire). Tags come
// from a per-group sequence, the same on every rank because every rank issues its collectives
// in the same order; they start above the tags callers of send/recv use.
PendingWork ProcessGroup::track_all(CommStats::Kind kind, int64_t bytes,
                                    std::vector<c10::intrusive_ptr<c10d::Work>> works) {
  TORCH_INTERNAL_ASSERT(!works.empty(), "track_all of no work");
  PendingWork work = track(kind, bytes, std::move(works.front()));
  for (size_t i = 1; i < works.size(); ++i) work.also_wait_for(std::move(works[i]));
  return work;
}

int ProcessGroup::next_p2p_tag() {
  constexpr uint32_t kFirstTag = 1u << 24;
  return static_cast<int>(kFirstTag + (p2p_sequence_++ % kFirstTag));
}

PendingWork ProcessGroup::reduce_async(at::Tensor& tensor, int root, Reduction op) {
  return reduce_to(tensor, root, op, 0, 1.0);
}

PendingWork ProcessGroup::reduce_mean_async(at::Tensor& tensor, int root, int64_t numel, double divisor,
                                            std::optional<at::ScalarType> wire, int64_t exact_tail) {
  SHARDOPT_CHECK(numel >= 0 && numel <= tensor.numel(), "reduce_mean_async: ", numel, " leading elements of a tensor of ",
                 tensor.numel());
  SHARDOPT_CHECK(divisor > 0, "reduce_mean_async: divisor must be positive, got ", divisor);
  return reduce_to(tensor, root, Reduction::kSum, numel, divisor, wire, exact_tail);
}

PendingWork ProcessGroup::reduce_to(at::Tensor& tensor, int root, Reduction op, int64_t numel, double divisor,
                                    std::optional<at::ScalarType> wire, int64_t exact_tail) {
  SHARDOPT_CHECK(root >= 0 && root < size_, "reduce root ", root, " is outside [0, ", size_, ")");
  if (wire && *wire != tensor.scalar_type() && size_ >= 2) {
    SHARDOPT_CHECK(op == Reduction::kSum && tensor.is_contiguous(), "reduce on a wire of ", *wire,
                   ": needs a contiguous tensor and a sum");
    return reduce_on_wire(tensor, root, numel, divisor, *wire, exact_tail);
  }
  check_in(CommStats::kReduce, nbytes(tensor), root);
  if (size_ >= 2 && backend_name_ == "gloo" && op == Reduction::kSum && tensor.is_contiguous()) {
    const int tag = next_p2p_tag();
    at::Tensor host = staged(tensor);  // a CUDA tensor's pinned copy (Note [Staging])
    if (rank_ != root) {
      std::vector<at::Tensor> ts{host};
      return track(CommStats::kReduce, nbytes(tensor), [&] { return backend_->send(ts, root, tag); });
    }
    std::vector<at::Tensor> incoming;
    std::vector<c10::intrusive_ptr<c10d::Work>> recvs;
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      std::vector<at::Tensor> ts{at::empty_like(host)};
      incoming.push_back(ts[0]);
      recvs.push_back(start(CommStats::kReduce, [&] { return backend_->recv(ts, r, tag); }));
    }
    PendingWork work = track_all(CommStats::kReduce, nbytes(tensor), std::move(recvs));
    work.set_then([tensor, host, incoming, numel, divisor]() mutable {
      detail::sum_into(host, incoming, numel, divisor);
      if (!host.is_same(tensor)) tensor.copy_(host);
    });
    return work;
  }
  std::vector<at::Tensor> ts{staged(tensor)};
  c10d::ReduceOptions opts;
  opts.rootRank = root;
  opts.reduceOp = to_c10d(op);
  opts.timeout = timeout_;
  auto work = track(CommStats::kReduce, nbytes(tensor), [&] { return backend_->reduce(ts, opts); });
  if (divisor != 1.0 && numel > 0 && rank_ == root) {
    // The mean of the leading elements, on the root only, after the copy back if staged.
    work.set_then([tensor, staged = ts[0], numel, divisor]() mutable {
      if (!staged.is_same(tensor)) tensor.copy_(staged);
      tensor.narrow(0, 0, numel).div_(divisor);
    });
  } else {
    unstage_after(work, tensor, ts[0]);
  }
  return work;
}

void ProcessGroup::reduce(at::Tensor& tensor, int root, Reduction op) {
  reduce_async(tensor, root, op).wait();
}

void ProcessGroup::allgather(std::vector<at::Tensor>& outputs, const at::Tensor& input) {
  SHARDOPT_CHECK(static_cast<int>(outputs.size()) == size_, "allgather needs ", size_,
              " outputs, got ", outputs.size());
  int64_t bytes = 0;
  for (const auto& o : outputs) bytes += nbytes(o);
  check_in(CommStats::kAllgather, bytes, -1);
  std::vector<std::vector<at::Tensor>> out{{}};
  for (const auto& o : outputs) out[0].push_back(staged(o, /*copy_in=*/false));
  std::vector<at::Tensor> in{staged(input)};
  c10d::AllgatherOptions opts;
  opts.timeout = timeout_;
  track(CommStats::kAllgather, bytes, [&] { return backend_->allgather(out, in, opts); }).wait();
  for (size_t r = 0; r < outputs.size(); ++r) {
    if (!out[0][r].is_same(outputs[r])) outputs[r].copy_(out[0][r]);
  }
}

void ProcessGroup::reduce_scatter(at::Tensor& output, std::vector<at::Tensor>& inputs) {
  SHARDOPT_CHECK(static_cast<int>(inputs.size()) == size_, "reduce_scatter needs ", size_,
              " inputs, got ", inputs.size());
  int64_t bytes = 0;
  for (const auto& i : inputs) bytes += nbytes(i);
  check_in(CommStats::kReduceScatter, bytes, -1);
  std::vector<at::Tensor> out{staged(output, /*copy_in=*/false)};
  std::vector<std::vector<at::Tensor>> in{{}};
  for (const auto& i : inputs) in[0].push_back(staged(i));
  c10d::ReduceScatterOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  opts.timeout = timeout_;
  track(CommStats::kReduceScatter, bytes, [&] { return backend_->reduce_scatter(out, in, opts); }).wait();
  if (!out[0].is_same(output)) output.copy_(out[0]);
}

PendingWork ProcessGroup::send_async(at::Tensor& tensor, int dst, int tag) {
  SHARDOPT_CHECK(dst >= 0 && dst < size_ && dst != rank_, "send to rank ", dst,
              " from rank ", rank_, " of ", size_, " is invalid");
  std::vector<at::Tensor> ts{staged(tensor)};
  return track(CommStats::kSend, nbytes(tensor), [&] { return backend_->send(ts, dst, tag); });
}

PendingWork ProcessGroup::recv_async(at::Tensor& tensor, int src, int tag) {
  SHARDOPT_CHECK(src >= 0 && src < size_ && src != rank_, "recv from rank ", src,
              " on rank ", rank_, " of ", size_, " is invalid");
  std::vector<at::Tensor> ts{staged(tensor, /*copy_in=*/false)};
  auto work = track(CommStats::kRecv, nbytes(tensor), [&] { return backend_->recv(ts, src, tag); });
  unstage_after(work, tensor, ts[0]);
  return work;
}

void ProcessGroup::send(at::Tensor& tensor, int dst, int tag) {
  send_async(tensor, dst, tag).wait();
}

void ProcessGroup::recv(at::Tensor& tensor, int src, int tag) {
  recv_async(tensor, src, tag).wait();
}

void ProcessGroup::send_bytes(const std::vector<char>& bytes, int dst, int tag) {
  at::Tensor size = at::full({1}, static_cast<int64_t>(bytes.size()), at::kLong);
  send(size, dst, tag);
  if (bytes.empty()) return;
  at::Tensor payload = at::from_blob(const_cast<char*>(bytes.data()), {static_cast<int64_t>(bytes.size())}, at::kByte);
  send(payload, dst, tag);
}

std::vector<char> ProcessGroup::recv_bytes(int src, int tag) {
  at::Tensor size = at::empty({1}, at::kLong);
  recv(size, src, tag);
  const int64_t n = size.item<int64_t>();
  SHARDOPT_CHECK(n >= 0, "recv_bytes from rank ", src, " got a negative length ", n);
  std::vector<char> bytes(n);
  if (n == 0) return bytes;
  at::Tensor payload = at::from_blob(bytes.data(), {n}, at::kByte);
  recv(payload, src, tag);
  return bytes;
}

void ProcessGroup::barrier() {
  check_in(CommStats::kBarrier, 0, -1);
  c10d::BarrierOptions opts;
  opts.timeout = timeout_;
  track(CommStats::kBarrier, 0, [&] { return backend_->barrier(opts); }).wait();
}

std::vector<std::vector<int64_t>> ProcessGroup::allgather_ints(const std::vector<int64_t>& values) {
  std::vector<std::vector<int64_t>> result(size_);
  if (size_ == 1) {
    result[0] = values;
    return result;
  }
  auto opts = at::TensorOptions().dtype(at::kLong);
  at::Tensor len = at::full({1}, static_cast<int64_t>(values.size()), opts);
  std::vector<at::Tensor> lens;
  for (int r = 0; r < size_; ++r) lens.push_back(at::empty({1}, opts));
  allgather(lens, len);
  int64_t max_len = 0;
  for (auto& l : lens) max_len = std::max(max_len, l.item<int64_t>());
  at::Tensor mine = at::zeros({std::max<int64_t>(max_len, 1)}, opts);
  std::copy(values.begin(), values.end(), mine.data_ptr<int64_t>());
  std::vector<at::Tensor> all;
  for (int r = 0; r < size_; ++r) all.push_back(at::empty_like(mine));
  allgather(all, mine);
  for (int r = 0; r < size_; ++r) {
    const int64_t* p = all[r].data_ptr<int64_t>();
    result[r].assign(p, p + lens[r].item<int64_t>());
  }
  return result;
}

}  // namespace shardopt
