// The ABI table of collectived's nccl.h.
#include "client/nccl/nccl.h"

#include "tests/nccl/abi_table.h"

ABI_TABLE(nccl_our_table)
