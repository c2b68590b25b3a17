"""collectived's backend for torch.distributed.

    import collectived_torch  # registers the backend "collectived"
    torch.distributed.init_process_group("collectived")

The backend talks to the node's collectived daemon at $COLLECTIVED_SOCKET
(default /run/collectived/collectived.sock). CPU and CUDA tensors both work.
"""
from datetime import timedelta

import torch
import torch.distributed as dist

from . import _C

__all__ = ["BACKEND", "library_version"]

BACKEND = "collectived"
library_version = _C.library_version


def _create(dist_opts, backend_opts):
    timeout = dist_opts.timeout
    if not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    return _C._create_backend(
        dist_opts.store,
        dist_opts.group_rank,
        dist_opts.group_size,
        timeout,
        str(dist_opts.group_id or ""),
    )


if BACKEND.upper() not in dist.Backend._plugins:
    devices = ["cpu", "cuda"] if _C.cuda_built() else ["cpu"]
    dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=devices)
