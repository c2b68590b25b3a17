# Warnings for our own targets (not third-party headers, which are SYSTEM).
function(collectived_warnings target)
  target_compile_options(${target} PRIVATE -Wall -Wextra -Wshadow=local -Wnon-virtual-dtor)
  if(COLLECTIVED_WERROR)
    target_compile_options(${target} PRIVATE -Werror)
  endif()
endfunction()
