# Debian's hardening flags (dpkg-buildflags' defaults plus bindnow), for every
# build that is not instrumented: the packaged binaries are these builds.
# Sanitizer and fuzz builds leave them out: ASan replaces the checked string
# functions that _FORTIFY_SOURCE adds.
if(NOT COLLECTIVED_SANITIZE AND NOT COLLECTIVED_FUZZ)
  add_compile_options("$<$<COMPILE_LANGUAGE:C,CXX>:-fstack-protector-strong>")
  # Needs optimisation: not in Debug (GCC warns, and warnings are errors in CI).
  add_compile_definitions("$<$<AND:$<COMPILE_LANGUAGE:C,CXX>,$<NOT:$<CONFIG:Debug>>>:_FORTIFY_SOURCE=2>")
  # Read-only relocations, resolved at load: libibverbs and libcuda are
  # dlopen'ed and checked symbol by symbol, so binding early costs nothing.
  add_link_options(-Wl,-z,relro -Wl,-z,now)
endif()
