#include "engine/plan.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>

#include "engine/reduce.h"

namespace collectived::engine {
namespace {

// Below this many bytes of output per task, splitting costs more in wake-ups
// than it gains in parallel memory bandwidth.
constexpr std::uint64_t kMinTaskBytes = 256 << 10;

/// Runs `on_done` after the last of `n` tasks.
struct Countdown {
  std::atomic<std::size_t> left;
  std::function<void()> on_done;
  void one_done() {
    if (left.fetch_sub(1, std::memory_order_acq_rel) == 1) on_done();
  }
};

/// Element ranges [begin, end) covering [0, count) in `parts` pieces of whole
/// cache lines where possible.
std::vector<std::pair<std::uint64_t, std::uint64_t>> split(std::uint64_t count,
                                                           std::uint64_t elem_bytes,
                                                           std::size_t workers) {
  const std::uint64_t bytes = count * elem_bytes;
  std::uint64_t parts = std::max<std::uint64_t>(1, bytes / kMinTaskBytes);
  parts = std::min<std::uint64_t>(parts, std::max<std::size_t>(1, workers) * 2);
  std::vector<std::pair<std::uint64_t, std::uint64_t>> out;
  if (count == 0) return out;
  std::uint64_t per = (count + parts - 1) / parts;
  const std::uint64_t align = std::max<std::uint64_t>(1, 64 / elem_bytes);
  per = (per + align - 1) / align * align;
  for (std::uint64_t b = 0; b < count; b += per) out.emplace_back(b, std::min(count, b + per));
  return out;
}

std::vector<std::function<void()>> finish(std::vector<std::function<void()>> bodies,
                                          std::function<void()> on_done) {
  if (bodies.empty()) bodies.push_back([] {});
  auto cd = std::make_shared<Countdown>();
  cd->left = bodies.size();
  cd->on_done = std::move(on_done);
  std::vector<std::function<void()>> tasks;
  tasks.reserve(bodies.size());
  for (auto& body : bodies) {
    tasks.push_back([cd, body = std::move(body)] {
      body();
      cd->one_done();
    });
  }
  return tasks;
}

void add_copies(std::vector<std::function<void()>>& bodies, std::byte* dst, const std::byte* src,
                std::uint64_t bytes, std::size_t workers) {
  if (dst == src || bytes == 0) return;
  for (const auto& range : split(bytes, 1, workers)) {
    const std::uint64_t b = range.first, e = range.second;
    bodies.push_back([dst, src, b, e] { std::memcpy(dst + b, src + b, e - b); });
  }
}

}  // namespace

std::vector<std::function<void()>> plan_copy(Span src, Span dst, std::size_t workers,
                                             std::function<void()> on_done) {
  std::vector<std::function<void()>> bodies;
  add_copies(bodies, dst.ptr, src.ptr, std::min(src.bytes, dst.bytes), workers);
  // The spans travel with the tasks: they keep both mappings alive.
  auto hold = std::make_shared<std::pair<Span, Span>>(std::move(src), std::move(dst));
  return finish(std::move(bodies), [hold, on_done = std::move(on_done)] { on_done(); });
}

std::vector<std::function<void()>> plan_collective(CollectivePlanInput in, std::size_t workers,
                                                   std::function<void()> on_done) {
  auto input = std::make_shared<CollectivePlanInput>(std::move(in));
  const CollectivePlanInput& p = *input;
  const std::size_t n = p.send.size();
  const std::uint64_t es = dtype_size(p.dtype);
  const std::uint64_t count = p.count;
  std::vector<std::function<void()>> bodies;

  auto ptrs = [](const std::vector<Span>& spans, std::uint64_t byte_offset) {
    std::vector<std::byte*> out;
    for (const auto& s : spans) out.push_back(s.ptr == nullptr ? nullptr : s.ptr + byte_offset);
    return out;
  };

  switch (p.kind) {
    case OpKind::all_reduce:
    case OpKind::reduce: {
      std::vector<std::byte*> dsts;
      if (p.kind == OpKind::all_reduce) {
        dsts = ptrs(p.recv, 0);
      } else {
        dsts.push_back(p.recv[p.root].ptr);
      }
      const auto srcs = ptrs(p.send, 0);
      for (const auto& range : split(count, es, workers)) {
        const std::uint64_t b = range.first, e = range.second;
        bodies.push_back([=, &p] {
          std::vector<void*> d;
          std::vector<const void*> s;
          for (auto* x : dsts) d.push_back(x + b * es);
          for (auto* x : srcs) s.push_back(x + b * es);
          reduce_multi(p.dtype, p.redop, d.data(), d.size(), s.data(), s.size(), e - b, n);
        });
      }
      break;
    }
    case OpKind::reduce_scatter: {
      // Rank r's result is the reduction of block r of every rank's input.
      for (std::size_t r = 0; r < n; ++r) {
        for (const auto& range : split(count, es, std::max<std::size_t>(1, workers / n))) {
          const std::uint64_t b = range.first, e = range.second;
          bodies.push_back([=, &p] {
            std::vector<const void*> s;
            for (const auto& span : p.send) s.push_back(span.ptr + (r * count + b) * es);
            void* d = p.recv[r].ptr + b * es;
            reduce_multi(p.dtype, p.redop, &d, 1, s.data(), s.size(), e - b, n);
          });
        }
      }
      break;
    }
    case OpKind::all_gather: {
      for (std::size_t r = 0; r < n; ++r) {
        for (std::size_t k = 0; k < n; ++k) {
          add_copies(bodies, p.recv[r].ptr + k * count * es, p.send[k].ptr, count * es,
                     std::max<std::size_t>(1, workers / n));
        }
      }
      break;
    }
    case OpKind::broadcast: {
      for (std::size_t r = 0; r < n; ++r) {
        add_copies(bodies, p.recv[r].ptr, p.send[p.root].ptr, count * es,
                   std::max<std::size_t>(1, workers / n));
      }
      break;
    }
    case OpKind::all_to_all: {
      bool in_place = false;
      for (std::size_t r = 0; r < n; ++r) in_place |= (p.send[r].ptr == p.recv[r].ptr);
      if (in_place) {
        // A rank's input is overwritten by its own output: stage every input
        // first, in one task (the only copy beyond the exchange itself).
        bodies.push_back([=, &p] {
          std::vector<std::vector<std::byte>> staged(n);
          for (std::size_t k = 0; k < n; ++k) {
            staged[k].assign(p.send[k].ptr, p.send[k].ptr + n * count * es);
          }
          for (std::size_t r = 0; r < n; ++r) {
            for (std::size_t k = 0; k < n; ++k) {
              std::memcpy(p.recv[r].ptr + k * count * es, staged[k].data() + r * count * es,
                          count * es);
            }
          }
        });
      } else {
        for (std::size_t r = 0; r < n; ++r) {
          for (std::size_t k = 0; k < n; ++k) {
            add_copies(bodies, p.recv[r].ptr + k * count * es, p.send[k].ptr + r * count * es,
                       count * es, std::max<std::size_t>(1, workers / n));
          }
        }
      }
      break;
    }
    case OpKind::barrier:
    case OpKind::split:
    case OpKind::p2p:
      break;
  }
  if (count == 0) bodies.clear();
  // `input` rides along with every task and on_done: it owns the spans, so the
  // client buffers stay mapped until the last task is over.
  return finish(std::move(bodies), [input, on_done = std::move(on_done)] { on_done(); });
}

}  // namespace collectived::engine
