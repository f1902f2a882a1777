// A timeline of what ShardedDDP and OSS do, for Chrome's trace viewer (chrome://tracing or
// ui.perfetto.dev): each bucket's reduction, its step, its parameter sync, and every wait for a
// collective, beside the spans a program marks itself (its forward, its backward, its step).
//
//   shardopt::timeline::start();
//   { shardopt::timeline::Span s("forward", rank); ... }
//   shardopt::timeline::stop();
//   shardopt::timeline::write("trace.json");
//
// Recording is off until start(); off, each place that would record costs one atomic load. Times
// are microseconds since start(). Every rank of this process (ranks that are threads included)
// records into one timeline, each event under its rank; write() puts each rank in a process of its
// own, with a lane (a thread of the viewer) per kind of event.
#pragma once

#include <cstdint>
#include <string>

namespace shardopt::timeline {

// The lanes events go in.
enum class Lane : uint8_t {
  kCompute,        // the program's own spans (Span)
  kReduction,      // a bucket's gradient reduction, from its launch until it is seen complete
  kStep,           // the optimizer's step of a bucket (or of the whole shard)
  kParameterSync,  // a bucket's parameter sync, from its start until it is seen complete
  kWait,           // a wait for a collective that blocked
};

// Begins recording in this process, clearing what was recorded before.
void start();
// Stops recording; what was recorded stays until the next start().
void stop();
bool recording();

// A span on the compute lane, from construction to destruction, while recording.
class Span {
 public:
  Span(std::string name, int rank);
  ~Span();
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;

 private:
  std::string name_;
  int rank_;
  int64_t begin_us_;
};

// Writes what was recorded as Chrome's trace JSON ({"traceEvents": [...]}). An error naming the
// path if it cannot be written.
void write(const std::string& path);

// Microseconds since start() (0 when not recording), and an event of [begin_us, end_us) on `lane`
// of `rank` (dropped when not recording): what the library records with.
int64_t now_us();
void record(Lane lane, std::string name, int rank, int64_t begin_us, int64_t end_us);

}  // namespace shardopt::timeline
