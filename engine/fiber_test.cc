#include "engine/fiber.h"

#include <doctest/doctest.h>

#include <cfenv>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "ipc/error.h"

namespace collectived::engine {
namespace {

TEST_CASE("fiber: runs until it yields, resumes where it left off, finishes once") {
  std::vector<std::string> trace;
  Fiber f([&] {
    trace.push_back("a");
    Fiber::current()->yield();
    trace.push_back("b");
    Fiber::current()->yield();
    trace.push_back("c");
  });
  CHECK(Fiber::current() == nullptr);
  CHECK_FALSE(f.started());
  CHECK_FALSE(f.resume());
  CHECK(trace == std::vector<std::string>{"a"});
  CHECK(Fiber::current() == nullptr);
  CHECK_FALSE(f.resume());
  CHECK(trace == std::vector<std::string>{"a", "b"});
  CHECK(f.resume());
  CHECK(f.finished());
  CHECK(trace == std::vector<std::string>{"a", "b", "c"});
  CHECK(f.resume());  // a finished fiber stays finished
  CHECK(trace.size() == 3);
}

TEST_CASE("fiber: an exception thrown inside reaches the resume() that ran it") {
  Fiber f([&] {
    Fiber::current()->yield();
    throw std::runtime_error("inside the fiber");
  });
  CHECK_FALSE(f.resume());
  CHECK_THROWS_WITH(f.resume(), "inside the fiber");
  CHECK(f.finished());
}

TEST_CASE("fiber: exceptions thrown and caught inside, across yields, and deep stacks") {
  int caught = 0;
  std::function<int(int)> deep = [&](int n) -> int {
    char pad[1024];
    std::memset(pad, n & 0xff, sizeof pad);
    return n == 0 ? pad[7] : deep(n - 1) + (pad[3] != 0 ? 1 : 0);
  };
  int depth_result = -1;
  Fiber f([&] {
    for (int i = 0; i < 3; ++i) {
      try {
        Fiber::current()->yield();
        throw std::runtime_error("caught inside");
      } catch (const std::exception&) {
        ++caught;
      }
    }
    depth_result = deep(200);  // ~200 KiB of stack
  });
  int resumes = 0;
  while (!f.resume()) ++resumes;
  CHECK(resumes == 3);
  CHECK(caught == 3);
  CHECK(depth_result == 200);
}

TEST_CASE("fiber: many fibers interleaved on one thread keep their own stacks") {
  constexpr int kFibers = 16, kRounds = 50;
  std::vector<long> sums(kFibers, 0);
  std::vector<std::unique_ptr<Fiber>> fibers;
  for (int i = 0; i < kFibers; ++i) {
    fibers.push_back(std::make_unique<Fiber>([&sums, i] {
      long local = 0;  // lives on this fiber's stack across yields
      for (int r = 0; r < kRounds; ++r) {
        local += i * 1000 + r;
        Fiber::current()->yield();
      }
      sums[i] = local;
    }));
  }
  bool all_done = false;
  while (!all_done) {
    all_done = true;
    for (auto& f : fibers) all_done = f->resume() && all_done;
  }
  for (int i = 0; i < kFibers; ++i) {
    CHECK(sums[i] == static_cast<long>(i) * 1000 * kRounds + kRounds * (kRounds - 1) / 2);
  }
}

TEST_CASE("fiber: a fiber resumed from inside another returns to it") {
  std::vector<int> trace;
  Fiber inner([&] {
    trace.push_back(2);
    CHECK(Fiber::current() != nullptr);
    Fiber::current()->yield();
    trace.push_back(4);
  });
  Fiber outer([&] {
    trace.push_back(1);
    Fiber* me = Fiber::current();
    CHECK_FALSE(inner.resume());
    CHECK(Fiber::current() == me);
    trace.push_back(3);
    CHECK(inner.resume());
    trace.push_back(5);
  });
  CHECK(outer.resume());
  CHECK(trace == std::vector<int>{1, 2, 3, 4, 5});
}

TEST_CASE("fiber: the rounding mode and the stack alignment are the fiber's own across switches") {
  // The x87 control word and MXCSR are callee-saved by the ABI: a switch
  // keeps them with the registers (swapcontext does; a hand-written switch
  // must too). A fiber's stack is aligned for SSE, as the snprintf of a
  // double below needs.
  int inside_mode = -1, after_yield_mode = -1;
  std::uintptr_t misaligned = 1;
  char text[32] = {};
  Fiber f([&] {
    alignas(16) volatile double d = 1.0;
    misaligned = reinterpret_cast<std::uintptr_t>(&d) % 16;
    std::fesetround(FE_UPWARD);
    inside_mode = std::fegetround();
    Fiber::current()->yield();
    after_yield_mode = std::fegetround();
    std::snprintf(text, sizeof text, "%.3f", d / 3.0);
    std::fesetround(FE_TONEAREST);
  });
  REQUIRE(std::fegetround() == FE_TONEAREST);
  CHECK_FALSE(f.resume());
  CHECK(inside_mode == FE_UPWARD);
  CHECK(std::fegetround() == FE_TONEAREST);  // the resumer's mode, back
  CHECK(f.resume());
  CHECK(after_yield_mode == FE_UPWARD);
  CHECK(misaligned == 0);
  CHECK(std::string(text) == "0.334");  // rounded up
  CHECK(std::fegetround() == FE_TONEAREST);
}

TEST_CASE("fiber: a finished fiber's stack runs the next fiber; a suspended one's cannot be taken") {
  // The engine's executors hand the stack from one fiber to the next
  // (Executor::drive): a stack mapped per operation cost an mmap, an
  // mprotect, page faults and an munmap (a TLB shootdown) each time.
  std::uintptr_t first = 0, second = 0;
  int deep = 0;
  Fiber a([&] {
    volatile char mark = 0;
    first = reinterpret_cast<std::uintptr_t>(&mark);
    Fiber::current()->yield();
  });
  CHECK_FALSE(a.resume());
  CHECK_THROWS_WITH_AS(a.take_stack(), doctest::Contains("suspended"), Error);
  CHECK(a.resume());
  FiberStack stack = a.take_stack();
  REQUIRE(static_cast<bool>(stack));
  const auto lo = reinterpret_cast<std::uintptr_t>(stack.base());
  const std::size_t size = stack.size();
  CHECK(size >= Fiber::kDefaultStackBytes);
  CHECK(first > lo);
  CHECK(first < lo + size);
  CHECK(a.resume());  // without its stack it stays finished
  CHECK_FALSE(static_cast<bool>(a.take_stack()));

  // A body that recurses through most of the stack: the reused stack is the
  // whole stack, not what the first body left of it.
  std::function<int(int)> down = [&](int n) {
    volatile char pad[1024];
    pad[0] = static_cast<char>(n);
    return n == 0 ? pad[0] : down(n - 1) + 1;
  };
  Fiber b(
      [&] {
        volatile char mark = 0;
        second = reinterpret_cast<std::uintptr_t>(&mark);
        deep = down(256);
      },
      std::move(stack));
  CHECK_FALSE(static_cast<bool>(stack));
  CHECK(b.resume());
  CHECK(second > lo);
  CHECK(second < lo + size);
  CHECK(deep == 256);

  // An empty stack gives a fresh one of the default size.
  bool ran = false;
  Fiber c([&] { ran = true; }, FiberStack{});
  CHECK(c.resume());
  CHECK(ran);
  CHECK(c.take_stack().size() == Fiber::kDefaultStackBytes);
}

}  // namespace
}  // namespace collectived::engine
