# `cmake --install`: the daemon and its tools, libcollective and its headers,
# the unit and the annotated profile (issue H, item 1). The unit in the source
# tree names /usr/local/bin and /etc (tests/verify_unit.sh checks it as is);
# the installed copy names where this install puts the daemon and profile.
include(GNUInstallDirs)

install(TARGETS collectived collectivectl collective-perf collective-demo
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(TARGETS collective collective_static
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} NAMELINK_COMPONENT dev
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT dev)
# Applications include "client/collective.h" (as in this tree) with
# <includedir>/collectived on their include path.
install(FILES client/collective.h client/collective.hpp
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/collectived/client COMPONENT dev)
if(TARGET nccl_shim)
  # Its own folder, off the loader's path: NVIDIA's libnccl.so.2 stays the
  # default; LD_LIBRARY_PATH or LD_PRELOAD chooses ours (README).
  install(TARGETS nccl_shim LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}/collectived/nccl NAMELINK_SKIP)
endif()

# Read at configure time: an edit of the unit configures again.
set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/systemd/collectived.service)
file(READ ${PROJECT_SOURCE_DIR}/systemd/collectived.service unit)
string(REPLACE "/usr/local/bin/collectived" "${CMAKE_INSTALL_FULL_BINDIR}/collectived" unit "${unit}")
string(REPLACE "/etc/collectived/" "${CMAKE_INSTALL_FULL_SYSCONFDIR}/collectived/" unit "${unit}")
file(WRITE ${CMAKE_BINARY_DIR}/systemd/collectived.service "${unit}")
install(FILES ${CMAKE_BINARY_DIR}/systemd/collectived.service
        DESTINATION lib/systemd/system)  # not LIBDIR: Debian's is multiarch
install(FILES systemd/collectived.yaml DESTINATION ${CMAKE_INSTALL_FULL_SYSCONFDIR}/collectived)

# The torch backend. The module built here (component torch: not in the
# Debian package, see cmake/Package.cmake) goes to <libdir>/collectived/python
# (PYTHONPATH; `import torch` first loads the libraries it needs). Its sources
# go everywhere, laid out as in this tree, for
# `pip install <datadir>/collectived/torch/client/torch` against any torch 2.x.
if(TARGET collectived_torch)
  install(DIRECTORY ${CMAKE_BINARY_DIR}/python/collectived_torch
          DESTINATION ${CMAKE_INSTALL_LIBDIR}/collectived/python COMPONENT torch
          PATTERN __pycache__ EXCLUDE)
endif()
install(FILES client/collective.h DESTINATION ${CMAKE_INSTALL_DATADIR}/collectived/torch/client)
install(DIRECTORY client/torch/ DESTINATION ${CMAKE_INSTALL_DATADIR}/collectived/torch/client/torch
        FILES_MATCHING PATTERN "*.cc" PATTERN "*.h" PATTERN "*.py"
        PATTERN __pycache__ EXCLUDE)
