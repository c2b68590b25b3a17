"""Prints what CMake needs to build against the torch of this Python, as
KEY=VALUE lines (client/torch/CMakeLists.txt). Exits 1 without torch."""
import glob
import os
import sys
import sysconfig

try:
    import torch
    import torch.utils.cpp_extension as ext
except Exception as e:  # noqa: BLE001 - any failure means "no usable torch"
    print(f"ERROR={type(e).__name__}: {e}")
    sys.exit(1)

root = os.path.dirname(torch.__file__)
site = os.path.dirname(root)
cudart = sorted(glob.glob(os.path.join(site, "nvidia", "*", "lib", "libcudart.so.*")))
print(f"VERSION={torch.__version__}")
print(f"INCLUDE={';'.join(ext.include_paths())}")
print(f"LIBDIR={os.path.join(root, 'lib')}")
print(f"CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}")
print(f"CUDA={torch.version.cuda or ''}")
print(f"CUDART_DIR={os.path.dirname(cudart[0]) if cudart else ''}")
print(f"PYTHON_INCLUDE={sysconfig.get_paths()['include']}")
print(f"EXT_SUFFIX={sysconfig.get_config_var('EXT_SUFFIX')}")
