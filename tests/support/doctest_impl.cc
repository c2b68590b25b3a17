// doctest's implementation, compiled once for every test executable
// (tests/CMakeLists.txt: the doctest_main library). Each test file only
// includes <doctest/doctest.h>: compiling the implementation into each of
// the ~25 test executables cost about 15 s per executable in the sanitizer
// builds, a third of CI's budget on 2 cores.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>
