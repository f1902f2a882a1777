#include "progress.h"

#include <fmt/format.h>

#include <cstdio>
#include <unistd.h>

namespace shardopt::app {

namespace {

std::string clock_text(double seconds) {
  const auto s = static_cast<int64_t>(seconds + 0.5);
  return s >= 3600 ? fmt::format("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60) : fmt::format("{}:{:02}", s / 60, s % 60);
}

}  // namespace

Progress::Progress(bool enabled, int64_t total_steps, int64_t samples_per_step, int64_t plain_every)
    : enabled_(enabled),
      live_(enabled && ::isatty(STDOUT_FILENO)),
      total_steps_(total_steps),
      samples_per_step_(samples_per_step),
      plain_every_(plain_every < 1 ? 1 : plain_every),
      start_(std::chrono::steady_clock::now()),
      last_draw_(start_) {}

void Progress::enable() {
  if (enabled_) return;
  enabled_ = true;
  live_ = ::isatty(STDOUT_FILENO);
}

double Progress::seconds() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
}

void Progress::update(int64_t step, int64_t epoch, int64_t epochs, double loss) {
  ++steps_;
  loss_avg_ = steps_ == 1 ? loss : 0.95 * loss_avg_ + 0.05 * loss;
  if (!enabled_) return;
  const auto now = std::chrono::steady_clock::now();
  const bool last = step + 1 == total_steps_;
  if (live_ ? (now - last_draw_ < std::chrono::milliseconds(200) && !last) : ((step + 1) % plain_every_ != 0 && !last)) return;
  last_draw_ = now;
  const double elapsed = seconds();
  const double rate = steps_ / std::max(elapsed, 1e-9);
  const double eta = (total_steps_ - step - 1) / std::max(rate, 1e-9);
  last_ = fmt::format("epoch {}/{}  step {}/{}  loss {:.4f}  {:.0f} samples/s  ETA {}", epoch + 1, epochs, step + 1,
                      total_steps_, loss_avg_, rate * samples_per_step_, clock_text(eta));
  if (live_) {
    std::printf("\r\033[K%s", last_.c_str());
  } else {
    std::printf("%s\n", last_.c_str());
  }
  std::fflush(stdout);
}

void Progress::print(const std::string& text) {
  if (!enabled_) return;
  if (live_) {
    std::printf("\r\033[K%s\n%s", text.c_str(), last_.c_str());
  } else {
    std::printf("%s\n", text.c_str());
  }
  std::fflush(stdout);
}

void Progress::finish() {
  if (enabled_ && live_ && !last_.empty()) std::printf("\n");
  std::fflush(stdout);
  last_.clear();
}

}  // namespace shardopt::app
