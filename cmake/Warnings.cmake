# Warnings for our own targets (not third-party headers, which are SYSTEM).
function(collectived_warnings target)
  target_compile_options(${target} PRIVATE -Wall -Wextra -Wnon-virtual-dtor)
  if(CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
    target_compile_options(${target} PRIVATE -Wshadow-uncaptured-local)  # fuzz builds
  else()
    target_compile_options(${target} PRIVATE -Wshadow=local)
  endif()
  if(COLLECTIVED_WERROR)
    target_compile_options(${target} PRIVATE -Werror)
    if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU" AND CMAKE_CXX_COMPILER_VERSION VERSION_LESS 13)
      # GCC 12 at -O3 (Release) reports bogus overlaps inside libstdc++'s
      # std::string (GCC bugs 105329, 105651): still printed, not an error.
      target_compile_options(${target} PRIVATE -Wno-error=restrict)
    endif()
  endif()
endfunction()

# A doctest unit test next to the code it tests: executable `name` from
# `source`, linked with the libraries given and doctest_main (tests/CMakeLists.txt),
# registered with ctest (label unit).
function(collectived_unit_test name source)
  if(NOT COLLECTIVED_TESTS)
    return()
  endif()
  add_executable(${name} ${source})
  collectived_warnings(${name})
  target_include_directories(${name} SYSTEM PRIVATE ${DOCTEST_INCLUDE_DIR})
  target_link_libraries(${name} PRIVATE ${ARGN} doctest_main)
  add_test(NAME ${name} COMMAND ${name})
  set_tests_properties(${name} PROPERTIES LABELS unit)
endfunction()
