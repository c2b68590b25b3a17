#include "daemon/options.h"

#include <doctest/doctest.h>

using collectived::daemon::Options;
using collectived::daemon::parse_options;
using collectived::daemon::UsageError;

TEST_CASE("command line: modes, profile and overrides") {
  auto o = parse_options({"--profile", "/etc/x.yaml", "--set", "log.level=debug",
                          "--set=client.socket=/tmp/a.sock"});
  CHECK(o.mode == Options::Mode::run);
  CHECK(o.profile_file == "/etc/x.yaml");
  CHECK(o.overrides == std::vector<std::string>{"log.level=debug", "client.socket=/tmp/a.sock"});

  o = parse_options({"--check-profile=/tmp/p.yaml"});
  CHECK(o.mode == Options::Mode::check_profile);
  CHECK(o.profile_file == "/tmp/p.yaml");
  CHECK(parse_options({"--print-default-profile"}).mode == Options::Mode::print_default_profile);
  CHECK(parse_options({}).profile_file.empty());
}

TEST_CASE("command line: test hooks, for the tests only") {
  auto o = parse_options({"--test-hook", "peer_version=99", "--test-hook=verbs_qp_error_after=40",
                          "--test-hook", "ibverbs_soname=libibverbs-missing.so.1"});
  CHECK(o.mode == Options::Mode::run);
  CHECK(o.test_hooks.peer_version == 99);
  CHECK(o.test_hooks.verbs_qp_error_after == 40);
  CHECK(o.test_hooks.ibverbs_soname == "libibverbs-missing.so.1");
  CHECK(o.test_hooks.gpu_one_shot_bytes == 0);
  CHECK_FALSE(o.test_hooks.gpu_debug_sync);
  o = parse_options({"--test-hook", "gpu_one_shot_bytes=4096", "--test-hook", "gpu_debug_sync=1"});
  CHECK(o.test_hooks.gpu_one_shot_bytes == 4096);
  CHECK(o.test_hooks.gpu_debug_sync);
  o = parse_options({});
  CHECK(o.test_hooks.peer_version == 0);
  CHECK(o.test_hooks.verbs_qp_error_after == 0);
  CHECK(o.test_hooks.ibverbs_soname.empty());
  CHECK_THROWS_WITH_AS(parse_options({"--test-hook", "nosuch=1"}), doctest::Contains("unknown hook"),
                       UsageError);
  CHECK_THROWS_WITH_AS(parse_options({"--test-hook", "peer_version=x"}),
                       doctest::Contains("expected a number"), UsageError);
  CHECK_THROWS_AS(parse_options({"--test-hook", "peer_version"}), UsageError);
  CHECK_THROWS_AS(parse_options({"--test-hook"}), UsageError);
}

TEST_CASE("command line: mistakes are usage errors that say what to fix") {
  CHECK_THROWS_WITH_AS(parse_options({"--frobnicate"}), doctest::Contains("unknown argument"),
                       UsageError);
  CHECK_THROWS_WITH_AS(parse_options({"--set", "log.level"}),
                       doctest::Contains("expected KEY.PATH=VALUE"), UsageError);
  CHECK_THROWS_AS(parse_options({"--profile"}), UsageError);
  CHECK_THROWS_AS(parse_options({"--version", "--help"}), UsageError);
}
