// Our nccl.h against NVIDIA's (NCCL 2.28.9 in the CUDA toolkit here): every
// entry of abi_table.h must be equal, since programs built against either
// header run on either library. Prints each difference; exit 1 on any.
#include <cstdio>
#include <map>

#include "tests/nccl/abi_table.h"

abi::Table nccl_reference_table();
abi::Table nccl_our_table();

int main() {
  const abi::Table ref = nccl_reference_table();
  const abi::Table ours = nccl_our_table();
  std::map<std::string, std::string> theirs(ref.begin(), ref.end());
  int wrong = 0;
  for (const auto& [name, value] : ours) {
    const auto it = theirs.find(name);
    if (it == theirs.end() || it->second != value) {
      std::printf("FAIL %s: ours %s, NCCL's %s\n", name.c_str(), value.c_str(),
                  it == theirs.end() ? "(missing)" : it->second.c_str());
      ++wrong;
    }
  }
  std::printf("%zu ABI facts compared (NCCL %s): %d differ\n", ours.size(),
              theirs["NCCL_VERSION_CODE"].c_str(), wrong);
  return wrong == 0 && ours.size() == ref.size() ? 0 : 1;
}
