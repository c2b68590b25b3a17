// The ABI table of the NCCL header the CUDA toolkit ships (found by CMake).
#include <nccl.h>

#include "tests/nccl/abi_table.h"

ABI_TABLE(nccl_reference_table)
