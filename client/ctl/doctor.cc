#include "client/ctl/doctor.h"

#include <dirent.h>

#include <algorithm>
#include <fstream>

#include "client/ctl/json.h"

namespace collectived::client::ctl {

std::string_view to_string(Verdict v) {
  switch (v) {
    case Verdict::pass: return "PASS";
    case Verdict::warn: return "WARN";
    case Verdict::fail: return "FAIL";
    case Verdict::skip: return "SKIP";
  }
  return "?";
}

void Report::add(std::string check, Verdict v, std::string detail, std::string fix) {
  findings_.push_back({std::move(check), v, std::move(detail), std::move(fix)});
}

int Report::exit_code() const {
  int code = kExitOk;
  for (const auto& f : findings_) {
    if (f.verdict == Verdict::fail) return kExitFailures;
    if (f.verdict == Verdict::warn) code = kExitWarnings;
  }
  return code;
}

std::string Report::text() const {
  std::size_t width = 0;
  for (const auto& f : findings_) width = std::max(width, f.check.size());
  std::string out;
  int counts[4] = {0, 0, 0, 0};
  for (const auto& f : findings_) {
    ++counts[static_cast<int>(f.verdict)];
    out += std::string(to_string(f.verdict)) + "  " + f.check +
           std::string(width - f.check.size() + 2, ' ') + f.detail + "\n";
    if (!f.fix.empty() && (f.verdict == Verdict::warn || f.verdict == Verdict::fail)) {
      out += std::string(6 + width + 2, ' ') + "fix: " + f.fix + "\n";
    }
  }
  // Appended piece by piece: GCC 12 at -O3 sees a false overlap (-Wrestrict)
  // in a "literal" + std::string chain (GCC bug 105651).
  out += "\n";
  out += std::to_string(counts[0]);
  out += " passed, ";
  out += std::to_string(counts[1]);
  out += " warnings, ";
  out += std::to_string(counts[2]);
  out += " failed, ";
  out += std::to_string(counts[3]);
  out += " skipped; exit code ";
  out += std::to_string(exit_code());
  out += "\n";
  return out;
}

std::string Report::json() const {
  Json j;
  j.begin_object().field("exit_code", exit_code()).key("checks").begin_array();
  for (const auto& f : findings_) {
    j.begin_object()
        .field("check", f.check)
        .field("verdict", std::string(to_string(f.verdict)))
        .field("detail", f.detail)
        .field("fix", f.fix)
        .end_object();
  }
  j.end_array().end_object();
  return j.str();
}

bool DoctorContext::uses_verbs() const {
  if (!profile) return true;
  return std::find(profile->transports.begin(), profile->transports.end(),
                   config::TransportKind::verbs) != profile->transports.end();
}

std::optional<std::string> read_line(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::string line;
  std::getline(in, line);
  if (in.bad()) return std::nullopt;
  while (!line.empty() && (line.back() == '\n' || line.back() == '\r' || line.back() == ' ')) {
    line.pop_back();
  }
  return line;
}

std::vector<std::string> list_dir(const std::string& path) {
  std::vector<std::string> out;
  if (DIR* d = ::opendir(path.c_str())) {
    while (dirent* e = ::readdir(d)) {
      const std::string n = e->d_name;
      if (n != "." && n != "..") out.push_back(n);
    }
    ::closedir(d);
  }
  std::sort(out.begin(), out.end());
  return out;
}

Report run_doctor(const DoctorOptions& options) {
  DoctorContext ctx;
  ctx.options = options;
  Report r;
  check_profile(ctx, r);
  check_daemon(ctx, r);
  check_socket(ctx, r);
  check_memlock(ctx, r);
  check_ibverbs(ctx, r);
  check_hcas(ctx, r);
  check_cuda(ctx, r);
  check_gpudirect_rdma(ctx, r);
  check_gds(ctx, r);
  check_peers(ctx, r);
  return r;
}

}  // namespace collectived::client::ctl
