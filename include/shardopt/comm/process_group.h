// Process groups: how ranks find each other and move tensors.
//
// A ProcessGroup wraps one c10d backend (Gloo; NCCL for CUDA tensors; Gloo also takes CUDA
// tensors, staged through pinned host memory) and makes every collective blocking with a
// timeout: no call here waits longer than `timeout()`; a peer that is gone or late becomes a
// c10::Error naming the collective, the rank and the time waited. `stats()` counts what this
// rank moved, so tests and benchmarks can assert communication volume.
//
//   auto group = shardopt::init_process_group();   // env://: RANK/WORLD_SIZE (or the Open MPI, PMI or
//                                                  // SLURM variables) and MASTER_ADDR/MASTER_PORT
//   group->allreduce(t);                           // sum over ranks, in place
#pragma once

#include <shardopt/comm/timeline.h>

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/arg.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace c10d {
class Backend;
class Store;
class Work;
}  // namespace c10d

namespace shardopt {

namespace detail {
struct GroupFailure;  // a group's failure watch (Note [Failure watch] in csrc/comm/failure_watch.cpp)
struct GroupSetup;    // init_process_group's access to a new group's set-up (csrc/comm/init.cpp)
struct GroupRecovery; // resilience's access to the failure watch and new groups (csrc/comm/group_recovery.h)
class WireCodec;      // how a tensor travels on a compressed wire (csrc/comm/wire_codec.h)
}  // namespace detail
namespace testing {
struct Introspection;  // what the tests read and set of the insides (shardopt/testing/introspection.h)
}  // namespace testing

struct InitOptions {
  TORCH_ARG(std::string, backend) = "auto";        // "gloo" | "nccl" | "auto" (nccl if CUDA, else gloo)
  TORCH_ARG(std::string, init_method) = "env://";  // "env://" | "tcp://HOST:PORT" | "file:///PATH"
  TORCH_ARG(int, rank) = -1;                       // -1: from the environment
  TORCH_ARG(int, world_size) = -1;                 // -1: from the environment
  TORCH_ARG(std::chrono::milliseconds, timeout) = std::chrono::minutes(5);
  // How long forming a group may take: reaching the store, every rank's arrival at the
  // rendezvous and Gloo's connections (a rank started late, a slow scheduler), here and when the
  // group forms subgroups or recovers; the store's waits. 0: `timeout`. The collectives' clock
  // starts once the group has formed. (NCCL: its communicators take `timeout`.)
  TORCH_ARG(std::chrono::milliseconds, setup_timeout) = std::chrono::milliseconds(0);
  // Check before every collective that all ranks call the same one (sequence number and kind,
  // size, root): ranks out of step get an error naming each rank's call instead of a hang or a
  // silent mix-up. Costs one small all-reduce per collective. Also on when the environment has
  // SHARDOPT_CHECK_DESYNC=1.
  TORCH_ARG(bool, check_desync) = false;
  // Gloo only: how Gloo's transport thread (the thread that polls the sockets and reads what
  // arrives) is scheduled, that thread alone (Note [The transport thread's scheduling] in
  // csrc/comm/init.cpp). batch: Linux's SCHED_BATCH (the same share of a core, but its wake-ups
  // do not preempt the running thread). nice: how many nice levels below the calling thread it
  // runs, capped at nice 19.
  TORCH_ARG(bool, transport_thread_batch) = true;
  TORCH_ARG(int, transport_thread_nice) = 0;
};

// What the calling thread is doing, named in the errors of the collectives it starts
// ("backward (gradient reductions)"). RAII; nests.
class CommPhase {
 public:
  explicit CommPhase(const char* phase);
  ~CommPhase();
  CommPhase(const CommPhase&) = delete;
  CommPhase& operator=(const CommPhase&) = delete;
  static const char* current();  // "" outside any phase

 private:
  const char* previous_;
};

enum class Reduction { kSum, kMax, kMin };

// What this rank moved, by kind of collective. Bytes are the payload of this rank's buffer:
// the tensor for broadcast/allreduce/reduce/send/recv, the gathered output for allgather, the
// scattered input for reduce_scatter.
struct CommStats {
  enum Kind { kBroadcast, kAllreduce, kReduce, kAllgather, kReduceScatter, kSend, kRecv, kBarrier, kNumKinds };
  std::array<int64_t, kNumKinds> calls{};
  std::array<int64_t, kNumKinds> bytes{};
  int64_t total_calls() const;
  int64_t total_bytes() const;
  static const char* name(Kind kind);
  std::string to_string() const;
};

// A handle on a collective in flight; wait() blocks at most the group's timeout.
class PendingWork {
 public:
  PendingWork() = default;
  // `diagnose` (may be empty) is asked, when the work fails, which ranks are gone.
  PendingWork(c10::intrusive_ptr<c10d::Work> work, std::string what, int rank, std::chrono::milliseconds timeout,
              std::function<std::string()> diagnose = {});
  ~PendingWork();
  PendingWork(PendingWork&&) noexcept;
  PendingWork& operator=(PendingWork&&) noexcept;
  PendingWork(const PendingWork&) = delete;
  PendingWork& operator=(const PendingWork&) = delete;
  // Waits, then runs `then` (if set) once the work completed.
  void wait();
  bool valid() const { return static_cast<bool>(work_); }
  // Whether wait() would not block: no work, or every transfer done (what set_then set still runs
  // in wait(), on the caller's thread).
  bool completed();
  // While shardopt/comm/timeline.h records: this work as an event `name` on `lane`, from now until
  // it is seen complete (by completed() or wait()).
  void on_timeline(timeline::Lane lane, std::string name);
  // Work to finish the operation on this rank after the transfer (for example a local sum).
  void set_then(std::function<void()> then) { then_ = std::move(then); }
  // Runs `next` after what set_then set (if anything).
  void and_then(std::function<void()> next);
  // More transfers of the same operation, waited for after the first one (several receives).
  void also_wait_for(c10::intrusive_ptr<c10d::Work> work);
  // The group's failure watch (set by the group): a failed wait marks the group broken, and a
  // group broken elsewhere ends this wait early.
  void set_failure_watch(std::shared_ptr<detail::GroupFailure> failure);

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  std::vector<c10::intrusive_ptr<c10d::Work>> more_;
  std::function<void()> then_;
  std::function<std::string()> diagnose_;
  std::shared_ptr<detail::GroupFailure> failure_;
  // Waits for one transfer: at most the timeout, and under a failure watch until the group is
  // broken.
  void wait_one(const c10::intrusive_ptr<c10d::Work>& work);
  std::string what_;
  int rank_ = -1;
  std::chrono::milliseconds timeout_{0};
  // Its event on the timeline (on_timeline), until recorded: -1 none.
  int timeline_lane_ = -1;
  std::string timeline_name_;
  int64_t timeline_begin_us_ = 0;
  void seen_complete();
};

class ProcessGroup {
 public:
  // Wraps a backend the caller already holds (for example one made by c10d directly; untested).
  ProcessGroup(c10::intrusive_ptr<c10d::Backend> backend, std::chrono::milliseconds timeout);
  ~ProcessGroup();

  int rank() const { return rank_; }
  int size() const { return size_; }
  const std::string& backend() const { return backend_name_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  const CommStats& stats() const { return stats_; }
  void reset_stats() { stats_ = CommStats{}; }
  c10::intrusive_ptr<c10d::Backend> native() const;

  // Blocking collectives (each waits at most timeout()).
  void broadcast(at::Tensor& tensor, int root);
  void allreduce(at::Tensor& tensor, Reduction op = Reduction::kSum);
  void reduce(at::Tensor& tensor, int root, Reduction op = Reduction::kSum);
  // outputs[r] receives rank r's input; all shapes equal.
  void allgather(std::vector<at::Tensor>& outputs, const at::Tensor& input);
  // output receives the sum over ranks of inputs[rank()]; all shapes equal.
  void reduce_scatter(at::Tensor& output, std::vector<at::Tensor>& inputs);
  void send(at::Tensor& tensor, int dst, int tag = 0);
  void recv(at::Tensor& tensor, int src, int tag = 0);
  // A byte string of any length (its length goes first), for serialized state.
  void send_bytes(const std::vector<char>& bytes, int dst, int tag = 0);
  std::vector<char> recv_bytes(int src, int tag = 0);
  void barrier();

  // Started, not waited: for overlapping communication with computation.
  PendingWork reduce_async(at::Tensor& tensor, int root, Reduction op = Reduction::kSum);
  // The sum to `root`, whose first `numel` elements the root then divides by `divisor` (a mean of
  // the leading elements; the ones after them, counts for example, stay sums). On Gloo the
  // division is in the same pass over memory as the sum, with the rounding of sum then div_.
  // With `wire` (a dtype other than the tensor's), every contribution travels in that dtype and
  // the root sums them in the tensor's (Note [Gradient wire] in csrc/comm/wire.cpp). A kChar
  // wire is int8 in blocks with fp32 scales (Note [Int8 wire]), whose last `exact_tail` elements
  // (counts, flags) travel exactly.
  PendingWork reduce_mean_async(at::Tensor& tensor, int root, int64_t numel, double divisor,
                                std::optional<at::ScalarType> wire = std::nullopt, int64_t exact_tail = 0);
  PendingWork allreduce_async(at::Tensor& tensor, Reduction op = Reduction::kSum);
  // send() and recv() started: on Gloo a send and a receive in flight together move both ways at
  // once (NCCL's block on the device unless grouped, which these are not). Messages between two
  // ranks with one tag arrive in the order they were started.
  PendingWork send_async(at::Tensor& tensor, int dst, int tag = 0);
  PendingWork recv_async(at::Tensor& tensor, int src, int tag = 0);
  // With `wire` (a dtype other than the tensor's), the root first rounds its tensor through
  // `wire` in place, and the broadcast moves `wire` bytes: every rank ends with the same rounded
  // values (Note [Parameter wire] in csrc/comm/wire.cpp).
  PendingWork broadcast_async(at::Tensor& tensor, int root, std::optional<at::ScalarType> wire = std::nullopt);
  // Rows (Note [Rows]): a 1-D contiguous `flat` whose length is a multiple of size() is cut into
  // size() equal rows, row r owned by rank r. reduce_scatter_rows_async leaves in this rank's
  // row the sum over ranks of their copies of that row, divided by `divisor` (rounded as the sum,
  // in rank order starting with this rank's own row, then div_; on Gloo at a size
  // of 8 or more with rows of at most 64 KiB, a tree: Note [Row rounds]); the other rows are left
  // unspecified. allgather_rows_async sets every rank's row r to rank r's row r. Each is one
  // collective in stats() (kReduceScatter, kAllgather) counting the bytes of `flat`, and each
  // rank sends (size - 1) / size of `flat`. With `out` (one row, of flat's dtype and device) the
  // sum goes there instead, and this rank's row of `flat` is left unspecified too.
  // With `wire`, each row travels in that dtype (Note [Gradient wire]; kChar: int8 blocks, each
  // row's last `exact_tail` elements exact, Note [Int8 wire]). With `used` (one count per row),
  // row r's elements from used[r] up to its last `exact_tail` are padding that nobody reads, and
  // a row with used[r] 0 is empty: on Gloo's exact wire they are not moved (Note [Rows with
  // padding]), and the padding of the result holds this rank's own values.
  PendingWork reduce_scatter_rows_async(at::Tensor& flat, double divisor = 1.0, at::Tensor out = {},
                                        std::optional<at::ScalarType> wire = std::nullopt, int64_t exact_tail = 0,
                                        const std::vector<int64_t>& used = {});
  // The same with this rank's own contribution in `out` (not in its row of `flat`, which is not
  // read and is left unspecified), summed into there with the others: ShardedDDP keeps a rank's
  // own gradients of a row bucket where they are reduced.
  PendingWork reduce_scatter_rows_into_async(at::Tensor& flat, at::Tensor& out, double divisor = 1.0,
                                             std::optional<at::ScalarType> wire = std::nullopt,
                                             int64_t exact_tail = 0, const std::vector<int64_t>& used = {});
  // With `wire`, each rank first rounds its own row through `wire` in place, and the rows
  // travel in `wire` (Note [Parameter wire]). With `own` (one contiguous row of flat's dtype and
  // device), this rank's row is first set from `own` (through `wire`, as the others receive it,
  // in the pass that packs it): OSS's owners sync from their masters so. With `used`, only each
  // row's first used[r] elements are copied to the other ranks (on Gloo's exact wire; Note [Rows
  // with padding]); the rest of their rows is left as it was.
  PendingWork allgather_rows_async(at::Tensor& flat, std::optional<at::ScalarType> wire = std::nullopt,
                                   const at::Tensor& own = at::Tensor(), const std::vector<int64_t>& used = {});

  // Small control messages: every rank's vector of integers (lengths may differ).
  std::vector<std::vector<int64_t>> allgather_ints(const std::vector<int64_t>& values);

  // (Agreement, in agree.h, checks that all ranks hold the same values.)

  // The desync check (init_process_group sets it from InitOptions::check_desync).
  void set_check_desync(bool on) { check_desync_ = on; }
  bool check_desync() const { return check_desync_; }
  // Collectives started on this group so far (the sequence number the desync check compares).
  uint64_t sequence() const { return sequence_; }

  // ---- sub-groups ----
  // Collective over this group: every rank passes the same list of distinct ranks of this group;
  // the listed ranks get a new group in which rank i is ranks[i], the others get nullptr. The new
  // group keeps this group's timeout and desync check, counts its own stats, and its errors name
  // the global rank beside the group rank. Several sub-groups may be live at once, a rank in
  // several; a rank that passes another list makes every rank fail with each rank's list named.
  std::shared_ptr<ProcessGroup> split(const std::vector<int>& ranks);
  // This group's ranks in the group init_process_group made (the identity there).
  const std::vector<int>& global_ranks() const { return global_ranks_; }
  int global_rank() const { return global_ranks_.at(rank_); }
  // "rank 1", or "rank 1 (global rank 3)" in a sub-group: how errors name rank r of this group.
  std::string describe_rank(int r) const;
  std::string describe_sub() const;  // "of global ranks [3, 1] (this is global rank 1)"
  // How this group makes a backend of its kind (init_process_group and split set it).
  using BackendFactory = std::function<c10::intrusive_ptr<c10d::Backend>(const c10::intrusive_ptr<c10d::Store>&, int, int)>;

  // When a collective failed: watches every rank's heartbeat in the store for a few seconds and
  // returns which ranks' stopped ("" when all beat, or without a store).
  std::string roll_call();
  // The rendezvous store this group's keys live in (null for a group made from a bare backend).
  const c10::intrusive_ptr<c10d::Store>& store() const { return store_; }

  // A group of one for a process that arrived after its rendezvous closed (Note [Closed
  // rendezvous], at close_rendezvous below): its global rank is the one it was started as, and
  // it waits to be admitted by the job that closed the rendezvous.
  bool joining() const { return joining_; }

 private:
  // What surviving a dead rank does with a group (the failure watch, leaving a broken group, new
  // groups of the survivors) is detail::GroupRecovery's, in csrc/comm/group_recovery.cpp, which
  // works on this state as a friend; resilience/ reaches it through that header only.
  friend struct detail::GroupRecovery;
  // Set-up, by init_process_group (through detail::GroupSetup) and by the groups this one makes.
  friend struct detail::GroupSetup;
  // The rendezvous store, for naming dead ranks (a roll call when a collective fails) and for
  // the desync check.
  void set_store(c10::intrusive_ptr<c10d::Store> store);
  void set_backend_factory(BackendFactory factory) { make_backend_ = std::move(factory); }
  // Makes this group the joining placeholder for `global_rank`.
  void set_joining(int global_rank, c10::intrusive_ptr<c10d::Store> store);
  PendingWork track(CommStats::Kind kind, int64_t bytes, c10::intrusive_ptr<c10d::Work> work);
  PendingWork track(CommStats::Kind kind, int64_t bytes, const std::function<c10::intrusive_ptr<c10d::Work>()>& call);
  // Runs `call` (the backend's call that starts a collective); a failure becomes an error naming
  // the collective, this rank and any peer the roll call finds gone.
  c10::intrusive_ptr<c10d::Work> start(CommStats::Kind kind, const std::function<c10::intrusive_ptr<c10d::Work>()>& call);
  // What the backend is handed for `tensor` (Note [Staging]): the tensor itself; for a CPU
  // tensor in an NCCL group, a copy on this rank's CUDA device; for a CUDA tensor in a Gloo
  // group, a copy in pinned host memory. `copy_in` false: a buffer the collective only writes (a
  // receive, an output), not filled from `tensor`.
  at::Tensor staged(const at::Tensor& tensor, bool copy_in = true) const;
  // After `work`, copies a staged tensor back into `tensor` (no-op when it was not staged).
  static void unstage_after(PendingWork& work, at::Tensor tensor, const at::Tensor& staged);
  // `what` with the phase and, in a sub-group, its global ranks: how errors name an operation.
  std::string label(std::string what) const;
  PendingWork reduce_scatter_rows(at::Tensor& flat, double divisor, at::Tensor out, bool own_in_out,
                                  std::optional<at::ScalarType> wire, int64_t exact_tail,
                                  const std::vector<int64_t>& used);
  // The collectives on a compressed wire (csrc/comm/on_wire.cpp; Note [Gradient wire], Note
  // [Parameter wire], Note [Int8 wire]).
  PendingWork reduce_scatter_rows_on_wire(at::Tensor& flat, double divisor, const at::Tensor& mine,
                                          const at::Tensor& own, at::ScalarType wire, int64_t exact_tail);
  PendingWork allgather_rows_on_wire(at::Tensor& flat, at::ScalarType wire, const at::Tensor& own);
  PendingWork broadcast_on_wire(at::Tensor& tensor, int root, at::ScalarType wire);
  PendingWork reduce_on_wire(at::Tensor& tensor, int root, int64_t numel, double divisor, at::ScalarType wire,
                             int64_t exact_tail);
  // The int8 wire's reductions on a backend's own collectives (Note [Int8 wire on collectives] in
  // csrc/comm/on_wire.cpp): NCCL's, and Gloo's where wire_by_collectives_ is set.
  PendingWork reduce_scatter_rows_by_alltoall(at::Tensor& flat, double divisor, const at::Tensor& mine,
                                              const at::Tensor& own, const detail::WireCodec& codec);
  PendingWork reduce_by_gather(at::Tensor& tensor, int root, int64_t numel, double divisor,
                               const detail::WireCodec& codec);
  // The tests run the path NCCL takes on Gloo (testing::Introspection::wire_by_collectives).
  friend struct testing::Introspection;
  bool wire_by_collectives_ = false;
  // The desync check before a collective (when on): every rank's (sequence, kind, bytes, root).
  void check_in(CommStats::Kind kind, int64_t bytes, int root);
  // A group over `backend` whose rank i is this group's rank members[i] (split, regroup); with
  // `failure`, it shares that failure watch (a sub-group, its parent's).
  std::shared_ptr<ProcessGroup> member_group(c10::intrusive_ptr<c10d::Backend> backend, const std::vector<int>& members,
                                             const c10::intrusive_ptr<c10d::Store>& store,
                                             std::shared_ptr<detail::GroupFailure> failure = nullptr) const;
  // reduce_async and reduce_mean_async (numel 0: no division).
  PendingWork reduce_to(at::Tensor& tensor, int root, Reduction op, int64_t numel, double divisor,
                        std::optional<at::ScalarType> wire = std::nullopt, int64_t exact_tail = 0);

  c10::intrusive_ptr<c10d::Backend> backend_;
  std::string backend_name_;
  int rank_ = 0;
  int size_ = 1;
  std::chrono::milliseconds timeout_;
  CommStats stats_;
  // One collective made of several transfers (`works`, at least one): counted once in stats(),
  // waited for as one.
  PendingWork track_all(CommStats::Kind kind, int64_t bytes, std::vector<c10::intrusive_ptr<c10d::Work>> works);
  // The tag of a collective made of point-to-point transfers (reduce to one owner, rows): from a
  // per-group sequence, the same on every rank, above the tags callers of send/recv use.
  int next_p2p_tag();
  uint32_t p2p_sequence_ = 0;
  c10::intrusive_ptr<c10d::Store> store_;
  bool check_desync_ = false;
  uint64_t sequence_ = 0;
  // Note [Roll call]: a thread that counts this rank's heartbeat in the store once a second.
  struct Heartbeat;
  std::unique_ptr<Heartbeat> heartbeat_;
  std::vector<int> global_ranks_;
  BackendFactory make_backend_;
  int splits_ = 0;
  std::shared_ptr<detail::GroupFailure> failure_;
  bool joining_ = false;
};

// This rank's index among the ranks of its machine, from the launcher's environment:
// LOCAL_RANK (torchrun, tools/launch), OMPI_COMM_WORLD_LOCAL_RANK (Open MPI), MPI_LOCALRANKID
// (MPICH), SLURM_LOCALID (SLURM), in that order; -1 when none is set. An NCCL group uses
// CUDA device local_rank() % device count.
int local_rank();

// Creates the process group of this rank as described by `options` (see docs/api.md for the
// environment variables env:// reads).
std::shared_ptr<ProcessGroup> init_process_group(InitOptions options = {});

// Creates a group over a store the caller made (a c10d::HashStore shared by threads gives several
// ranks in one process). rank and world_size must be set in `options`.
std::shared_ptr<ProcessGroup> init_process_group(const c10::intrusive_ptr<c10d::Store>& store,
                                                 InitOptions options);

// Note [Closed rendezvous]
// A job that goes on past its first rendezvous and takes in processes that arrive later (a
// resilient run takes in a replacement for a rank it lost: shardopt::Resilient) closes the
// rendezvous in its store once every rank is past it. A process that then calls
// init_process_group on that store does not wait for a rendezvous that is over: it gets a group
// of one that is joining(), and the job that closed the rendezvous admits it (or refuses it).
// A launcher reads the same mark to tell a job under way from one still starting.
void close_rendezvous(c10d::Store& store);
bool rendezvous_closed(c10d::Store& store);

}  // namespace shardopt
