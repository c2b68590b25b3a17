# Which part of the tree may include which: the build checks every quoted
# #include of every source file against this table (cmake/check_layering.cmake)
# before it compiles anything, and a forbidden include fails the build with the
# file, the include and what the file's part may include. ctest's `layering` runs the
# same check and shows that it fails on a planted forbidden include.
#
# Each part is a library target (or a leaf of one); a file belongs to the first
# part whose pattern matches its path. Tests (`_test.cc`, tests/) may include
# anything.
set(COLLECTIVED_LAYERS
  # part            files (regex on the path from the source root)
  "ipc            ^ipc/"
  "config         ^config/"
  "cuda_driver    ^engine/gpu/cuda_driver\\.(h|cc)$"
  "gpu_kernels    ^engine/gpu/(reduce_ops\\.cuh|kernels\\.(h|cu))$"
  "verbs_loader   ^engine/transport/verbs/(ibverbs_library|ibverbs_functions|devices|gpudirect)\\.(h|cc)$"
  "engine_select  ^engine/transport/(select\\.(h|cc)|verbs/peer_setup\\.(h|cc))$"
  "engine_tcp     ^engine/transport/tcp/"
  "engine_verbs   ^engine/transport/verbs/"
  "engine_base    ^engine/(log|dtype|op|reduce|host_mapping|registry|message_bytes|algorithm_options)\\.(h|cc)$|^engine/transport/(transport|host_region)\\.h$|^engine/gpu/executor\\.h$"
  "engine_algorithms ^engine/(algorithms/|node_channel\\.h|node_algorithms\\.(h|cc)$)"
  "engine_gpu     ^engine/gpu/"
  "engine         ^engine/"
  "daemon         ^daemon/"
  "client_ctl     ^client/ctl/"
  "client_nccl    ^client/nccl/"
  "client_torch   ^client/torch/"
  "client         ^client/")

# part: the parts its files may include (itself always).
set(COLLECTIVED_LAYER_DEPS
  "ipc"
  "config"
  "cuda_driver       ipc"
  "gpu_kernels"
  "verbs_loader      ipc"
  "engine_base       ipc config"
  "engine_algorithms engine_base ipc"
  "engine_tcp        engine_base ipc config"
  "engine_verbs      verbs_loader engine_base ipc config"
  "engine_select     engine_tcp engine_verbs verbs_loader engine_base ipc config"
  "engine_gpu        gpu_kernels cuda_driver engine_base ipc config"
  "engine            engine_algorithms engine_base ipc config"
  "daemon            engine engine_select engine_tcp engine_gpu engine_base ipc config"
  "client            gpu_kernels cuda_driver ipc"
  "client_ctl        client verbs_loader cuda_driver ipc config"
  "client_nccl       client gpu_kernels cuda_driver ipc"
  "client_torch      client ipc")

# The files checked (recursive globs from the source root; `_test.cc` files
# are left out).
set(COLLECTIVED_LAYERED_GLOBS
  ipc/*.h ipc/*.cc config/*.h config/*.cc engine/*.h engine/*.cc engine/*.cu engine/*.cuh
  daemon/*.h daemon/*.cc client/*.h client/*.cc client/*.cu client/*.cuh)

# The stamp that every library target waits for: rewritten only when the check
# passes, re-run when any source file changes.
list(TRANSFORM COLLECTIVED_LAYERED_GLOBS PREPEND ${PROJECT_SOURCE_DIR}/ OUTPUT_VARIABLE _layered_globs)
file(GLOB_RECURSE _layered_paths CONFIGURE_DEPENDS ${_layered_globs})
list(FILTER _layered_paths EXCLUDE REGEX "_test\\.cc$")
# The table as plain lines for the check ("glob PATTERN", "layer PART REGEX",
# "deps PART ...").
set(_layering_lines "")
foreach(entry IN LISTS COLLECTIVED_LAYERED_GLOBS)
  string(APPEND _layering_lines "glob ${entry}\n")
endforeach()
foreach(entry IN LISTS COLLECTIVED_LAYERS)
  string(APPEND _layering_lines "layer ${entry}\n")
endforeach()
foreach(entry IN LISTS COLLECTIVED_LAYER_DEPS)
  string(APPEND _layering_lines "deps ${entry}\n")
endforeach()
set(COLLECTIVED_LAYERING_TABLE ${CMAKE_BINARY_DIR}/layering.txt)
file(CONFIGURE OUTPUT ${COLLECTIVED_LAYERING_TABLE} CONTENT "${_layering_lines}" @ONLY)
add_custom_command(
  OUTPUT ${CMAKE_BINARY_DIR}/layering.stamp
  COMMAND ${CMAKE_COMMAND} -DTABLE=${COLLECTIVED_LAYERING_TABLE} -DROOT=${PROJECT_SOURCE_DIR}
          -P ${PROJECT_SOURCE_DIR}/cmake/check_layering.cmake
  COMMAND ${CMAKE_COMMAND} -E touch ${CMAKE_BINARY_DIR}/layering.stamp
  DEPENDS ${_layered_paths} ${PROJECT_SOURCE_DIR}/cmake/check_layering.cmake ${COLLECTIVED_LAYERING_TABLE}
  COMMENT "Checking that includes point one way (cmake/Layering.cmake)"
  VERBATIM)
add_custom_target(layering_check DEPENDS ${CMAKE_BINARY_DIR}/layering.stamp)

# Every library of the tree waits for the check.
function(collectived_layered)
  foreach(target IN LISTS ARGN)
    if(TARGET ${target})
      add_dependencies(${target} layering_check)
    endif()
  endforeach()
endfunction()
