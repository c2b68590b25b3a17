#include "ipc/fd.h"

#include <unistd.h>

namespace collectived {

void UniqueFd::reset(int fd) {
  // close() is not retried on EINTR: on Linux the descriptor is released anyway.
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

}  // namespace collectived
