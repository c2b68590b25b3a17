# For applications (issue H, item 2): the CMake package (find_package(collectived)
# gives collectived::collective and collectived::collective_static) and the
# pkg-config file collectived.pc, both in the `dev` component next to the
# headers and the static archive (cmake/Install.cmake).
#
# The imported targets are written by hand (cmake/collectivedConfig.cmake.in)
# rather than with install(EXPORT): the build targets carry the source tree
# as their include directory and link the uninstalled ipc and cuda_driver
# archives, none of which an installed tree has.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

get_target_property(COLLECTIVED_LIB_VERSION collective VERSION)
get_target_property(COLLECTIVED_LIB_SOVERSION collective SOVERSION)
# What libcollective.a needs besides itself (client/CMakeLists.txt puts ipc's
# and cuda_driver's objects in it): Cap'n Proto's runtime, threads, dlopen
# (the CUDA driver) and GCC's C++ runtime, named even where CMake would add
# it: a C-only project links with the C driver, which does not.
set(COLLECTIVED_STATIC_CMAKE_LIBS "capnp;kj;stdc++;m;Threads::Threads;${CMAKE_DL_LIBS}")
set(COLLECTIVED_STATIC_PC_LIBS "-lcapnp -lkj -pthread -ldl -lstdc++ -lm")

set(config_dir ${CMAKE_INSTALL_LIBDIR}/cmake/collectived)
# Relocatable: PACKAGE_INIT finds the prefix from the installed file's own
# location, so the tree may be copied or unpacked anywhere.
configure_package_config_file(
  ${CMAKE_CURRENT_LIST_DIR}/collectivedConfig.cmake.in
  ${CMAKE_BINARY_DIR}/cmake/collectivedConfig.cmake
  INSTALL_DESTINATION ${config_dir}
  PATH_VARS CMAKE_INSTALL_INCLUDEDIR CMAKE_INSTALL_LIBDIR)
# SameMajorVersion, as the SONAME (libcollective.so.0) promises.
write_basic_package_version_file(${CMAKE_BINARY_DIR}/cmake/collectivedConfigVersion.cmake
                                 VERSION ${PROJECT_VERSION} COMPATIBILITY SameMajorVersion)
install(FILES ${CMAKE_BINARY_DIR}/cmake/collectivedConfig.cmake
              ${CMAKE_BINARY_DIR}/cmake/collectivedConfigVersion.cmake
        DESTINATION ${config_dir} COMPONENT dev)

# collectived.pc names the prefix the tree is installed to, which
# `cmake --install --prefix` may change after configuring: the file is made
# at install time. Its other paths derive from ${prefix}, so
# `pkg-config --define-variable=prefix=DIR` relocates a copied tree.
foreach(dir LIBDIR INCLUDEDIR)
  if(IS_ABSOLUTE "${CMAKE_INSTALL_${dir}}")
    set(PC_${dir} "${CMAKE_INSTALL_${dir}}")
  else()
    set(PC_${dir} "\${prefix}/${CMAKE_INSTALL_${dir}}")
  endif()
endforeach()
set(PC_PREFIX "@PC_PREFIX@")  # kept for the install-time pass below
configure_file(${CMAKE_CURRENT_LIST_DIR}/collectived.pc.in ${CMAKE_BINARY_DIR}/cmake/collectived.pc.in
               @ONLY)
install(CODE "set(PC_PREFIX \"\${CMAKE_INSTALL_PREFIX}\")
  configure_file(\"${CMAKE_BINARY_DIR}/cmake/collectived.pc.in\"
                 \"${CMAKE_BINARY_DIR}/cmake/collectived.pc\" @ONLY)" COMPONENT dev)
install(FILES ${CMAKE_BINARY_DIR}/cmake/collectived.pc
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig COMPONENT dev)
