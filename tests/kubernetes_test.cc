// docs/kubernetes as a cluster would use it, on this machine: the DaemonSet's
// profile and container arguments start a daemon that serves (its readiness
// probe passes), and the example Job's program runs two ranks launched the way
// an Indexed Job launches them (JOB_COMPLETION_INDEX, no MPI).
#include <doctest/doctest.h>
#include <sys/stat.h>
#include <yaml-cpp/yaml.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "tests/support/harness.h"

using namespace collectived::test;
using namespace std::chrono_literals;

namespace {

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

void replace_all(std::string& s, const std::string& from, const std::string& to) {
  for (std::size_t at = s.find(from); at != std::string::npos; at = s.find(from, at + to.size())) {
    s.replace(at, from.size(), to);
  }
}

YAML::Node manifest(const std::string& kind, const std::string& file) {
  for (const YAML::Node& doc : YAML::LoadAllFromFile(file)) {
    if (doc["kind"] && doc["kind"].as<std::string>() == kind) return doc;
  }
  FAIL("no " << kind << " in " << file);
  return {};
}

ExitStatus ctl(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {COLLECTIVECTL_BIN};
  argv.insert(argv.end(), args.begin(), args.end());
  return run_program(argv, 30s, {{"COLLECTIVED_SOCKET", ""}});
}

}  // namespace

TEST_CASE("the DaemonSet's profile and arguments start a daemon whose readiness probe passes") {
  const std::string file = std::string(KUBERNETES_DIR) + "/daemonset.yaml";
  TempDir dir;
  const std::string profile = dir.file("collectived.yaml");
  write_file(profile, manifest("ConfigMap", file)["data"]["collectived.yaml"].as<std::string>());
  const std::string secret = dir.file("secret");
  write_file(secret, "kubernetes test cluster secret\n");
  ::chmod(secret.c_str(), 0600);

  const YAML::Node container =
      manifest("DaemonSet", file)["spec"]["template"]["spec"]["containers"][0];
  Daemon::Options o;
  for (const YAML::Node& a : container["args"]) {
    std::string arg = a.as<std::string>();
    // The downward API's values, as the kubelet substitutes them.
    replace_all(arg, "$(NODE_NAME)", "k8s-node");
    replace_all(arg, "$(HOST_IP)", "127.0.0.61");
    if (arg.rfind("--profile=", 0) == 0) {
      CHECK(arg == "--profile=/etc/collectived/collectived.yaml");  // the ConfigMap's mount
      o.profile_file = profile;
    } else {
      REQUIRE_MESSAGE(arg.rfind("--set=", 0) == 0, arg);
      o.overrides.push_back(arg.substr(6));
    }
  }
  CHECK(o.overrides.size() == 3);
  // The secret's mount, and the hostPath socket, here under the test's own directory.
  o.overrides.push_back("peer.secret_file=" + secret);
  Daemon d(o);

  auto s = ctl({"status", "--json", "--socket", d.socket()});
  INFO(s.output << "\ndaemon log:\n" << d.log());
  REQUIRE(s.code == 0);
  CHECK(has(s.output, "\"node\":\"k8s-node\""));
  CHECK(has(s.output, "\"peer_address\":\"127.0.0.61:47600\""));
  CHECK(has(s.output, "\"metrics_address\":\"127.0.0.61:9464\""));

  // The probes, as the kubelet runs them (the socket path is ours).
  for (const char* probe : {"readinessProbe", "livenessProbe"}) {
    std::vector<std::string> argv;
    for (const YAML::Node& a : container[probe]["exec"]["command"]) {
      std::string arg = a.as<std::string>();
      replace_all(arg, "/run/collectived/collectived.sock", d.socket());
      argv.push_back(arg == "/usr/local/bin/collectivectl" ? COLLECTIVECTL_BIN : arg);
    }
    auto p = run_program(argv, 30s, {{"COLLECTIVED_SOCKET", ""}});
    CHECK_MESSAGE(p.code == 0, probe << ": " << p.output);
  }
  // The probe fails once the daemon is gone (so the kubelet restarts it).
  d.terminate(10s);
  auto gone = ctl({"status", "--socket", d.socket()});
  CHECK(gone.code == 2);
}

TEST_CASE("the example Job's program: two ranks started as an Indexed Job starts them, no MPI") {
  Daemon d;
  auto id = ctl({"unique-id", "--socket", d.socket()});
  REQUIRE(id.code == 0);
  std::string text = id.output;
  while (!text.empty() && (text.back() == '\n' || text.back() == '\r')) text.pop_back();
  REQUIRE(text.size() == 256);
  TempDir dir;
  const std::string id_file = dir.file("id");
  write_file(id_file, text + "\n");

  // Rank 0 reads the id from the Secret as an environment variable, rank 1
  // from the Secret mounted as a file.
  std::vector<std::unique_ptr<Child>> ranks;
  for (int index = 0; index < 2; ++index) {
    std::map<std::string, std::string> env = {{"JOB_COMPLETION_INDEX", std::to_string(index)},
                                              {"WORLD_SIZE", "2"},
                                              {"COLLECTIVED_SOCKET", d.socket()}};
    if (index == 0) {
      env["COLLECTIVE_UNIQUE_ID"] = text;
    } else {
      env["COLLECTIVE_UNIQUE_ID_FILE"] = id_file;
    }
    ranks.push_back(std::make_unique<Child>([env, index] {
      auto r = run_program({ALLREDUCE_EXAMPLE_BIN}, 60s, env);
      std::fprintf(stderr, "%s", r.output.c_str());
      const std::string want =
          "rank " + std::to_string(index) + " of 2: all_reduce of 1048576 floats correct (3)";
      return r.exited && r.code == 0 && r.output.find(want) != std::string::npos ? 0 : 1;
    }));
  }
  for (auto& r : ranks) {
    auto s = r->wait(90s);
    CHECK(s.exited);
    CHECK(s.code == 0);
  }
  // Without the launcher's variables it says which to set, and exits 2.
  auto bare = run_program({ALLREDUCE_EXAMPLE_BIN}, 30s, {{"COLLECTIVED_SOCKET", d.socket()}});
  CHECK(bare.code == 2);
  CHECK(has(bare.output, "JOB_COMPLETION_INDEX"));
}
