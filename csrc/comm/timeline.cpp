// The timeline (shardopt/comm/timeline.h): events kept in memory while recording, written as
// Chrome's trace JSON.
#include <shardopt/comm/timeline.h>
#include <shardopt/check.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <fstream>
#include <mutex>
#include <set>
#include <sstream>
#include <vector>

namespace shardopt::timeline {

// Note [Timeline]
// While recording, the library puts on the timeline what shows where a step's time goes: each
// bucket's reduction (PendingWork::on_timeline at its launch), its step (OSS, around each bucket's
// fused step), its parameter sync (ShardStore::start_sync_of), and every wait for a collective
// that blocked (PendingWork::wait). A collective's event ends when the library sees it complete:
// PendingWork::completed() (which ShardedDDP asks at every gradient of a step in the backward, for
// the reductions and the syncs) or wait(). So an event can end late, never early. Events are kept
// in memory, under one lock, until write(); off, each place that would record costs one atomic
// load and builds no name.
namespace {

struct Event {
  Lane lane;
  std::string name;
  int rank;
  int64_t begin_us, end_us;
};

std::atomic<bool> on{false};
std::mutex mu;
std::vector<Event> events;
std::chrono::steady_clock::time_point origin;

const char* lane_name(Lane lane) {
  switch (lane) {
    case Lane::kCompute: return "compute";
    case Lane::kReduction: return "gradient reduction";
    case Lane::kStep: return "optimizer step";
    case Lane::kParameterSync: return "parameter sync";
    case Lane::kWait: return "waits";
  }
  return "?";
}

}  // namespace

void start() {
  std::lock_guard<std::mutex> lock(mu);
  events.clear();
  origin = std::chrono::steady_clock::now();
  on = true;
}

void stop() { on = false; }

bool recording() { return on.load(std::memory_order_relaxed); }

int64_t now_us() {
  if (!recording()) return 0;
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - origin).count();
}

void record(Lane lane, std::string name, int rank, int64_t begin_us, int64_t end_us) {
  if (!recording()) return;
  std::lock_guard<std::mutex> lock(mu);
  events.push_back({lane, std::move(name), rank, begin_us, std::max(begin_us, end_us)});
}

Span::Span(std::string name, int rank) : name_(std::move(name)), rank_(rank), begin_us_(now_us()) {}

Span::~Span() { record(Lane::kCompute, std::move(name_), rank_, begin_us_, now_us()); }

namespace {

// A JSON string of `text` (the names are the library's own and the program's spans).
std::string quoted(const std::string& text) {
  std::string out = "\"";
  for (char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += ' ';
    } else {
      out += c;
    }
  }
  return out + "\"";
}

}  // namespace

void write(const std::string& path) {
  std::ostringstream trace;
  trace << "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [";
  std::set<std::pair<int, int>> lanes;  // (rank, lane) that hold an event
  bool first = true;
  auto next = [&]() -> std::ostringstream& {
    trace << (first ? "\n" : ",\n");
    first = false;
    return trace;
  };
  {
    std::lock_guard<std::mutex> lock(mu);
    for (const Event& e : events) {
      next() << "{\"name\": " << quoted(e.name) << ", \"cat\": " << quoted(lane_name(e.lane))
             << ", \"ph\": \"X\", \"ts\": " << e.begin_us << ", \"dur\": " << e.end_us - e.begin_us
             << ", \"pid\": " << e.rank << ", \"tid\": " << static_cast<int>(e.lane) << "}";
      lanes.emplace(e.rank, static_cast<int>(e.lane));
    }
  }
  std::set<int> ranks;
  for (const auto& [rank, lane] : lanes) {
    next() << "{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": " << rank << ", \"tid\": " << lane
           << ", \"args\": {\"name\": " << quoted(lane_name(static_cast<Lane>(lane))) << "}}";
    if (ranks.insert(rank).second) {
      next() << "{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": " << rank
             << ", \"args\": {\"name\": \"rank " << rank << "\"}}";
    }
  }
  trace << "\n]}\n";
  std::ofstream out(path);
  SHARDOPT_CHECK(out, "timeline: cannot write '", path, "'");
  out << trace.str();
  out.flush();
  SHARDOPT_CHECK(out.good(), "timeline: writing '", path, "' failed");
}

}  // namespace shardopt::timeline
