# The Debian package: `scripts/package` (cpack -G DEB in build/) makes
# collectived_<version>_amd64.deb from what `cmake --install` installs.
#
# CPack rather than dpkg-buildpackage: the package holds exactly the files of
# the install rules (cmake/Install.cmake, cmake/Export.cmake), so there is one
# list of files, and the fixed top level has no debian/ folder. The
# maintainer scripts in cmake/deb/ are the ones debhelper would generate for
# a systemd unit, plus the clients' group.
#
# The torch backend is left out (component `torch`): it is a CPython module
# built against one torch wheel, which pip installs into a user's
# environment and dpkg cannot depend on. The package ships its sources
# instead (share/collectived/torch), for `pip install` against that torch.
if(NOT CMAKE_INSTALL_PREFIX STREQUAL "/usr")
  # Only a /usr build is packaged: the unit and docs name its paths.
  message(STATUS "collectived: CMAKE_INSTALL_PREFIX is not /usr: scripts/package refuses this build")
endif()

execute_process(COMMAND dpkg --print-architecture OUTPUT_VARIABLE deb_arch
                OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
if(NOT deb_arch)
  set(deb_arch amd64)
endif()

# lintian: every package carries its copyright and a compressed changelog
# (changelog.gz: a native package, versioned as the project is).
set(deb_doc ${CMAKE_BINARY_DIR}/deb-doc)
file(MAKE_DIRECTORY ${deb_doc})
execute_process(COMMAND gzip -9nc ${PROJECT_SOURCE_DIR}/cmake/deb/changelog
                OUTPUT_FILE ${deb_doc}/changelog.gz)
install(FILES ${PROJECT_SOURCE_DIR}/cmake/deb/copyright ${deb_doc}/changelog.gz
        DESTINATION ${CMAKE_INSTALL_DATADIR}/doc/collectived)

set(CPACK_GENERATOR DEB)
set(CPACK_PACKAGE_NAME collectived)
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGE_CONTACT "collectived developers <maintainers@collectived.example.org>")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "per-node communication daemon for GPU clusters")
set(CPACK_PACKAGE_DESCRIPTION "collectived owns a node's RDMA HCAs, queue pairs, registered
memory and connections to the other nodes' daemons. Applications link
libcollective (or collectived's libnccl.so.2, or the torch.distributed
backend) and submit collectives to it over a Unix socket.")
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
set(CPACK_DEBIAN_FILE_NAME collectived_${PROJECT_VERSION}_${deb_arch}.deb)
set(CPACK_DEBIAN_PACKAGE_ARCHITECTURE ${deb_arch})
set(CPACK_DEBIAN_PACKAGE_SECTION net)
set(CPACK_DEBIAN_PACKAGE_PRIORITY optional)
set(CPACK_DEBIAN_PACKAGE_HOMEPAGE "https://collectived.invalid/")
# Depends: what dpkg-shlibdeps finds the ELF files need, nothing more.
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
set(CPACK_DEBIAN_PACKAGE_GENERATE_SHLIBS ON)
# Loaded at run time with every symbol checked, so neither is required:
# without them the daemon serves over TCP and host memory, and says why.
set(CPACK_DEBIAN_PACKAGE_RECOMMENDS "libibverbs1, ibverbs-providers, libcuda1")
set(CPACK_DEBIAN_PACKAGE_CONTROL_EXTRA
    ${PROJECT_SOURCE_DIR}/cmake/deb/postinst ${PROJECT_SOURCE_DIR}/cmake/deb/prerm
    ${PROJECT_SOURCE_DIR}/cmake/deb/postrm ${PROJECT_SOURCE_DIR}/cmake/deb/conffiles
    ${PROJECT_SOURCE_DIR}/cmake/deb/triggers)
set(CPACK_DEBIAN_PACKAGE_CONTROL_STRICT_PERMISSION ON)
set(CPACK_STRIP_FILES ON)
# Everything but the torch module, in one package.
set(CPACK_DEB_COMPONENT_INSTALL ON)
set(CPACK_COMPONENTS_GROUPING ALL_COMPONENTS_IN_ONE)
set(CPACK_COMPONENTS_ALL Unspecified dev)
set(CPACK_DEBIAN_PACKAGE_NAME collectived)
include(CPack)
