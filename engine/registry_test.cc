#include "engine/registry.h"

#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <string>

#include "engine/log.h"
#include "ipc/error.h"

using namespace collectived;
using namespace collectived::engine;

namespace {

UniqueFd sealed_memfd(std::size_t size, unsigned seals = F_SEAL_SHRINK | F_SEAL_GROW) {
  UniqueFd fd(::memfd_create("test", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  REQUIRE(fd);
  REQUIRE(::ftruncate(fd.get(), static_cast<off_t>(size)) == 0);
  if (seals != 0) REQUIRE(::fcntl(fd.get(), F_ADD_SEALS, seals) == 0);
  return fd;
}

Code code_of(auto&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.code();
  }
  return Code::ok;
}

}  // namespace

TEST_CASE("a sealed memfd maps and shares bytes with the client's view") {
  UniqueFd fd = sealed_memfd(8192);
  void* client = ::mmap(nullptr, 8192, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  REQUIRE(client != MAP_FAILED);
  HostMapping m = HostMapping::map_memfd(std::move(fd), 8192);
  std::memcpy(client, "hello", 6);
  CHECK(std::strcmp(reinterpret_cast<const char*>(m.data()), "hello") == 0);
  ::munmap(client, 8192);
}

TEST_CASE("a mapping's region: transports attach once, and lose it before the unmap") {
  UniqueFd fd = sealed_memfd(8192);
  HostMapping m = HostMapping::map_memfd(std::move(fd), 8192);
  HostRegion* region = m.region();
  REQUIRE(region != nullptr);
  CHECK(region->base() == m.data());
  CHECK(region->size() == 8192);
  CHECK(region->contains(m.data(), 8192));
  CHECK(region->contains(m.data() + 4096, 4096));
  CHECK_FALSE(region->contains(m.data() + 4096, 4097));
  CHECK_FALSE(region->contains(m.data() - 1, 1));
  std::memcpy(m.data(), "still mapped", 13);

  // What an attachment's destructor sees: the memory must still be readable
  // there (a transport deregisters its MR before the kernel may reuse the range).
  struct Probe {
    const std::byte* at;
    std::string* seen;
    ~Probe() { *seen = reinterpret_cast<const char*>(at); }
  };
  std::string seen;
  int made = 0;
  auto make = [&] {
    ++made;
    return std::shared_ptr<void>(new Probe{m.data(), &seen});
  };
  const int key = 0;
  CHECK(region->attach(&key, make));
  CHECK_FALSE(region->attach(&key, make));  // one per key
  CHECK(made == 1);
  CHECK(region->attachments() == 1);
  CHECK_THROWS(region->attach(&made, []() -> std::shared_ptr<void> { throw Error(Code::system, "x"); }));
  CHECK(region->attachments() == 1);  // a failed attach leaves nothing
  CHECK(region->attached(&key) != nullptr);
  CHECK(region->attached(&made) == nullptr);

  HostMapping moved = std::move(m);  // the region (and its address) moves along
  CHECK(moved.region() == region);
  CHECK(m.region() == nullptr);
  CHECK(seen.empty());
  moved = HostMapping();  // unmaps: the probe ran first and read the bytes
  CHECK(seen == "still mapped");
}

TEST_CASE("descriptors that are not sealed memfds are refused with a reason") {
  CHECK_THROWS_WITH(HostMapping::map_memfd(sealed_memfd(4096, 0), 4096),
                    doctest::Contains("F_SEAL_SHRINK"));
  CHECK_THROWS_WITH(HostMapping::map_memfd(sealed_memfd(4096), 8192),
                    doctest::Contains("fewer than the 8192"));
  CHECK_THROWS_WITH(HostMapping::map_memfd(sealed_memfd(4096), 0), doctest::Contains("size is 0"));
  int p[2];
  REQUIRE(::pipe(p) == 0);
  ::close(p[1]);
  CHECK_THROWS_WITH(HostMapping::map_memfd(UniqueFd(p[0]), 4096),
                    doctest::Contains("not a memfd"));
  UniqueFd file(::open("/proc/self/exe", O_RDONLY | O_CLOEXEC));
  CHECK_THROWS_WITH(HostMapping::map_memfd(std::move(file), 4096), doctest::Contains("not a memfd"));
  CHECK(code_of([] { HostMapping::map_memfd(UniqueFd(), 4096); }) == Code::invalid_argument);
}

TEST_CASE("registry: owners, foreign and stale handles, ranges, limits") {
  Registry reg({.max_total_bytes = 3 * 4096, .max_per_owner = 2});
  const auto h1 = reg.add(1, HostMapping::map_memfd(sealed_memfd(4096), 4096));
  const auto h2 = reg.add(1, HostMapping::map_memfd(sealed_memfd(4096), 4096));
  CHECK(h1 != h2);
  CHECK(code_of([&] { reg.add(1, HostMapping::map_memfd(sealed_memfd(4096), 4096)); }) ==
        Code::resource_exhausted);
  const auto h3 = reg.add(2, HostMapping::map_memfd(sealed_memfd(4096), 4096));
  CHECK(code_of([&] { reg.add(3, HostMapping::map_memfd(sealed_memfd(4096), 4096)); }) ==
        Code::resource_exhausted);  // node-wide bytes

  CHECK(reg.find(1, h1)->mapping.size() == 4096);
  CHECK(code_of([&] { reg.find(2, h1); }) == Code::permission_denied);
  CHECK(code_of([&] { reg.find(1, 999); }) == Code::not_found);

  CHECK(reg.find_range(1, h1, 0, 4096));
  CHECK(reg.find_range(1, h1, 4096, 0));
  CHECK(code_of([&] { reg.find_range(1, h1, 1, 4096); }) == Code::invalid_argument);
  CHECK(code_of([&] { reg.find_range(1, h1, ~0ull, 2); }) == Code::invalid_argument);
  CHECK(code_of([&] { reg.find_range(1, h1, 8, ~0ull - 4); }) == Code::invalid_argument);

  auto held = reg.find(1, h1);
  reg.remove(1, h1);
  CHECK(code_of([&] { reg.find(1, h1); }) == Code::not_found);
  CHECK(held->mapping.size() == 4096);  // still mapped while an operation holds it
  CHECK(code_of([&] { reg.remove(2, h2); }) == Code::permission_denied);

  CHECK(reg.totals().count == 2);
  CHECK(reg.remove_all(1) == 1);
  CHECK(reg.totals().count == 1);
  CHECK(reg.totals().bytes == 4096);
  CHECK(reg.totals_of(2).count == 1);
  reg.remove(2, h3);
  CHECK(reg.totals().bytes == 0);
}

TEST_CASE("log lines are key=value with quoting") {
  Logger log(config::LogLevel::info, -1);
  const std::string line =
      log.format(config::LogLevel::warn, "client_refused", {{"pid", 42}, {"why", "uid 7 not allowed"}});
  CHECK(line.find("level=warn event=client_refused pid=42 why=\"uid 7 not allowed\"\n") !=
        std::string::npos);
  CHECK_FALSE(log.enabled(config::LogLevel::debug));
  log.set_level(config::LogLevel::debug);
  CHECK(log.enabled(config::LogLevel::debug));
}
