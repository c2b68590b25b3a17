// The fatbin of client/direct_kernels.cu, carried inside libcollective
// (.incbin of the file nvcc wrote at build time; see client/CMakeLists.txt).
#include "client/direct.h"

#ifdef COLLECTIVED_DIRECT_FATBIN
// cuModuleLoadData wants the fatbin aligned; the symbols stay inside the library.
asm(".section .rodata\n"
    ".balign 64\n"
    ".globl collectived_direct_fatbin_begin\n"
    ".hidden collectived_direct_fatbin_begin\n"
    "collectived_direct_fatbin_begin:\n"
    ".incbin \"" COLLECTIVED_DIRECT_FATBIN "\"\n"
    ".globl collectived_direct_fatbin_end\n"
    ".hidden collectived_direct_fatbin_end\n"
    "collectived_direct_fatbin_end:\n"
    ".previous\n");
extern "C" const unsigned char collectived_direct_fatbin_begin[];
extern "C" const unsigned char collectived_direct_fatbin_end[];
#endif

namespace collectived::client {

std::span<const unsigned char> direct_fatbin() {
#ifdef COLLECTIVED_DIRECT_FATBIN
  return {collectived_direct_fatbin_begin,
          static_cast<std::size_t>(collectived_direct_fatbin_end - collectived_direct_fatbin_begin)};
#else
  return {};
#endif
}

}  // namespace collectived::client
