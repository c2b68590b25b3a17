// Aligned plain-text tables for collectivectl's default output.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace collectived::client::ctl {

/// Columns padded to their widest cell, two spaces apart; a header row in
/// capitals. No trailing spaces.
class Table {
 public:
  explicit Table(std::vector<std::string> header) : header_(std::move(header)) {}
  void row(std::vector<std::string> cells) { rows_.push_back(std::move(cells)); }
  bool empty() const { return rows_.empty(); }
  std::string str() const;

 private:
  std::vector<std::string> header_;
  std::vector<std::vector<std::string>> rows_;
};

/// "1.5 GiB", "512 B".
std::string human_bytes(std::uint64_t bytes);
/// "3d 4h", "2h 5m", "4m 10s", "12.3s", "850ms".
std::string human_duration_ms(std::uint64_t ms);

}  // namespace collectived::client::ctl
