// The node's CUDA MPS control daemon, as the profile's gpu.mps asks:
//  - managed: collectived starts nvidia-cuda-mps-control -d (unless one already
//    answers) before it creates any CUDA context, and stops it on exit if it
//    started it;
//  - external: someone else runs it; collectived only reports whether it is there;
//  - off: no MPS (processes sharing a GPU time-slice it).
// Clients reach MPS through the same CUDA_MPS_PIPE_DIRECTORY (default
// /tmp/nvidia-mps) as the daemon.
#pragma once

#include <string>

namespace collectived::engine {
class Logger;
}

namespace collectived::engine::gpu {

class MpsControl {
 public:
  MpsControl(Logger& log, std::string mode);
  ~MpsControl();
  MpsControl(const MpsControl&) = delete;
  MpsControl& operator=(const MpsControl&) = delete;

  /// Mode in force and why, for status.
  const std::string& reason() const { return reason_; }
  /// An MPS control daemon answered when the mode was decided: the node's
  /// CUDA contexts share the GPUs through it.
  bool active() const { return active_; }
  /// The pipe directory clients must share.
  static std::string pipe_directory();
  /// An MPS control daemon answers there.
  static bool running();

 private:
  Logger& log_;
  std::string reason_;
  bool started_ = false;
  bool active_ = false;
};

}  // namespace collectived::engine::gpu
