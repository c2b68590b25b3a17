// The fatbin of client/direct_kernels.cu, carried inside libcollective
// (.incbin of the file nvcc wrote at build time; see client/CMakeLists.txt).
#include "client/direct.h"

#include <memory>

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

std::unique_ptr<KernelModule> KernelModule::load(const gpu::CudaDriver& cu) {
  const auto fat = direct_fatbin();
  gpu::cu::Module m = nullptr;
  if (fat.empty() || cu.cuModuleLoadData(&m, fat.data()) != gpu::cu::kSuccess) return nullptr;
  return std::unique_ptr<KernelModule>(new KernelModule(cu, m));
}

KernelModule::~KernelModule() {
  cu_.cuModuleUnload(module_);  // an error: the context is gone, and the module with it
}

gpu::cu::Function KernelModule::function(const char* name) const {
  gpu::cu::Function f = nullptr;
  return cu_.cuModuleGetFunction(&f, module_, name) == gpu::cu::kSuccess ? f : nullptr;
}

}  // namespace collectived::client
