"""pip install client/torch: collectived_torch against an existing libcollective.

    COLLECTIVED_LIBDIR=/path/with/libcollective.so pip install --no-build-isolation client/torch

or, where the Debian package is installed (libcollective in the system's
library folder):

    pip install --no-build-isolation /usr/share/collectived/torch/client/torch

Headers come from this source tree (client/collective.h); libcollective from
COLLECTIVED_LIBDIR (default: the tree's build/lib, else the system's). Built
with torch.utils.cpp_extension, so torch's include paths, C++ ABI flag and
pybind11 are the ones of the torch it is installed beside. The CMake build
(client/torch/CMakeLists.txt) makes the same module from the same sources.
"""
import glob
import os
import sys
import tempfile

import torch
from setuptools import setup
from torch.utils import cpp_extension

here = os.path.dirname(os.path.abspath(__file__))
os.chdir(here)  # sources and the package are named relative to this folder
root = os.path.abspath(os.path.join(here, "..", ".."))
libdir = os.environ.get("COLLECTIVED_LIBDIR", os.path.join(root, "build", "lib"))
sources = [f for f in (
    "backend.cc", "collectives.cc", "p2p.cc", "launch.cc", "work.cc", "host_memory.cc",
    "dtype.cc", "cuda_launch.cc", "module.cc")]

site = os.path.dirname(os.path.dirname(torch.__file__))
cudart = sorted(glob.glob(os.path.join(site, "nvidia", "*", "lib", "libcudart.so.*")))
use_cuda = bool(torch.version.cuda) and cpp_extension.CUDA_HOME is not None
include_dirs = [root]
library_dirs = [libdir]
libraries = ["collective"]
extra_link = []
if use_cuda:
    include_dirs.append(os.path.join(cpp_extension.CUDA_HOME, "include"))
    libraries.append("c10_cuda")
    if cudart:
        library_dirs.append(os.path.dirname(cudart[0]))
        extra_link.append("-l:" + os.path.basename(cudart[0]))
    else:
        libraries.append("cudart")
if os.path.isdir(libdir):
    extra_link.append("-Wl,-rpath," + libdir)

# The installed sources (/usr/share/collectived/torch) are read-only: build
# beside them in a temporary folder instead.
options = {}
if not os.access(here, os.W_OK):
    scratch = tempfile.mkdtemp(prefix="collectived-torch-build-")
    options = {"build": {"build_base": scratch}, "egg_info": {"egg_base": scratch}}

setup(
    options=options,
    name="collectived_torch",
    version="0.1.0",
    description="collectived's torch.distributed backend",
    packages=["collectived_torch"],
    package_dir={"collectived_torch": "collectived_torch"},
    ext_modules=[cpp_extension.CppExtension(
        "collectived_torch._C", sources,
        include_dirs=include_dirs, library_dirs=library_dirs, libraries=libraries,
        define_macros=[("COLLECTIVED_TORCH_CUDA", "1" if use_cuda else "0")],
        extra_compile_args=["-std=c++20", "-O2"], extra_link_args=extra_link)],
    cmdclass={"build_ext": cpp_extension.BuildExtension},
)
