// Which parts of c10d's Backend and Work the torch being built against has,
// so that one source builds against several torch 2.x releases (torch-ccl's
// users' first complaint is a build that breaks with each torch release).
#pragma once

// torch/version.h, by the path that needs no extra include folder.
#include <torch/csrc/api/include/torch/version.h>

#define COLLECTIVED_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||              \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

// Work::blockCurrentStream, Backend::getBackendOptions and setTimeout (virtual
// from 2.9; 2.8 lacks them, 2.9-2.11 were built here).
#define COLLECTIVED_TORCH_HAS_BACKEND_OPTIONS COLLECTIVED_TORCH_AT_LEAST(2, 9)
// c10d::ErrorType and Backend::getError.
#define COLLECTIVED_TORCH_HAS_ERROR_TYPE COLLECTIVED_TORCH_AT_LEAST(2, 7)
