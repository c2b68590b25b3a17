# The include check (cmake/Layering.cmake has the table and says why):
#   cmake -DTABLE=build/layering.txt -DROOT=<source root> -P cmake/check_layering.cmake
# Fails (FATAL_ERROR) naming every forbidden include: file, line, the include,
# its part, and what the file's part may include.
cmake_minimum_required(VERSION 3.25)
if(NOT TABLE OR NOT ROOT)
  message(FATAL_ERROR "usage: cmake -DTABLE=layering.txt -DROOT=<source root> -P check_layering.cmake")
endif()

set(parts "")
file(STRINGS "${TABLE}" table_lines)
foreach(line IN LISTS table_lines)
  string(REGEX REPLACE "[ \t]+" ";" fields "${line}")
  list(POP_FRONT fields kind part)
  if(kind STREQUAL "layer")
    list(JOIN fields " " regex)
    list(APPEND parts ${part})
    set("regex_${part}" "${regex}")
  elseif(kind STREQUAL "deps")
    set("deps_${part}" ${part} ${fields})
  endif()
endforeach()

# The part a path (from the source root) belongs to, or "" for none.
function(part_of path out)
  foreach(part IN LISTS parts)
    if(path MATCHES "${regex_${part}}")
      set(${out} ${part} PARENT_SCOPE)
      return()
    endif()
  endforeach()
  set(${out} "" PARENT_SCOPE)
endfunction()

file(GLOB_RECURSE files RELATIVE "${ROOT}"
  "${ROOT}/ipc/*.h" "${ROOT}/ipc/*.cc" "${ROOT}/config/*.h" "${ROOT}/config/*.cc"
  "${ROOT}/engine/*.h" "${ROOT}/engine/*.cc" "${ROOT}/engine/*.cu" "${ROOT}/engine/*.cuh"
  "${ROOT}/daemon/*.h" "${ROOT}/daemon/*.cc"
  "${ROOT}/client/*.h" "${ROOT}/client/*.cc" "${ROOT}/client/*.cu" "${ROOT}/client/*.cuh")
list(FILTER files EXCLUDE REGEX "_test\\.cc$")

set(violations "")
set(checked 0)
foreach(file IN LISTS files)
  part_of("${file}" part)
  if(part STREQUAL "")
    continue()
  endif()
  if(NOT DEFINED "deps_${part}")
    message(FATAL_ERROR "layering: part ${part} (of ${file}) has no deps line")
  endif()
  math(EXPR checked "${checked} + 1")
  get_filename_component(dir "${file}" DIRECTORY)
  file(STRINGS "${ROOT}/${file}" lines REGEX "^[ \t]*#[ \t]*include[ \t]*\"")
  # Line numbers for the message: the include lines only, found again below.
  foreach(line IN LISTS lines)
    if(NOT line MATCHES "^[ \t]*#[ \t]*include[ \t]*\"([^\"]+)\"")
      continue()
    endif()
    set(inc "${CMAKE_MATCH_1}")
    set(target "${inc}")
    if(NOT inc MATCHES "/")
      set(target "${dir}/${inc}")  # next to the file
    endif()
    part_of("${target}" inc_part)
    if(inc_part STREQUAL "")
      continue()  # not ours (a generated or third-party header)
    endif()
    if(NOT inc_part IN_LIST "deps_${part}")
      list(JOIN "deps_${part}" ", " may)
      list(APPEND violations "${file}: #include \"${inc}\" (${inc_part}): ${part} may include only ${may}")
    endif()
  endforeach()
endforeach()

if(violations)
  list(LENGTH violations n)
  list(JOIN violations "\n  " text)
  message(FATAL_ERROR "layering: ${n} forbidden include(s) (cmake/Layering.cmake):\n  ${text}\n")
endif()
message(STATUS "layering: ${checked} files, every include points one way")
