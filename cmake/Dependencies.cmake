# Third-party dependencies, all from Debian 12 packages (scripts/install-deps).
find_package(Threads REQUIRED)
find_package(Boost 1.81 REQUIRED)           # Asio is header-only
find_package(CapnProto REQUIRED)            # capnp compiler + runtime
find_package(PkgConfig REQUIRED)
pkg_check_modules(YAMLCPP REQUIRED IMPORTED_TARGET yaml-cpp)
pkg_check_modules(SYSTEMD REQUIRED IMPORTED_TARGET libsystemd)
find_path(DOCTEST_INCLUDE_DIR doctest/doctest.h REQUIRED)
find_package(OpenSSL 3.0 REQUIRED COMPONENTS Crypto)  # HMAC-SHA256, RAND_bytes: peer authentication
