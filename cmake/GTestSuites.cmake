# shardopt_gtest_suites(<target> [PREFIX p] [FILTER f] [TIMEOUT s] [ENVIRONMENT vars...] [LABELS l...]
#                       [COSTS Suite=seconds...])
#
# One ctest entry per GoogleTest suite of <target>: `p<Suite>` runs that suite's tests (those
# FILTER selects) in one process. A process per test would start LibTorch hundreds of times, most
# tests take less time than that. The suites are listed when ctest runs (as
# gtest_discover_tests's PRE_TEST mode does), so a rebuilt binary's new tests are picked up.
# A suite whose every test skipped (GTEST_SKIP) exits 77 (tests/all_skipped.cpp) and shows as
# skipped. COSTS: the seconds of the suites named (CTest's COST, until it has measured its own).
set(SHARDOPT_GTEST_SUITES_SCRIPT ${CMAKE_CURRENT_LIST_DIR}/gtest_suites_add.cmake)

function(shardopt_gtest_suites target)
  cmake_parse_arguments(arg "" "PREFIX;FILTER;TIMEOUT" "ENVIRONMENT;LABELS;COSTS" ${ARGN})
  if(NOT arg_TIMEOUT)
    set(arg_TIMEOUT 600)
  endif()
  string(MAKE_C_IDENTIFIER "${target}_${arg_PREFIX}" id)
  set(script "${CMAKE_CURRENT_BINARY_DIR}/${id}_suites.cmake")
  file(GENERATE OUTPUT "${script}" CONTENT
"set(exe [==[$<TARGET_FILE:${target}>]==])
set(prefix [==[${arg_PREFIX}]==])
set(filter [==[${arg_FILTER}]==])
set(timeout [==[${arg_TIMEOUT}]==])
set(environment [==[${arg_ENVIRONMENT}]==])
set(labels [==[${arg_LABELS}]==])
set(costs [==[${arg_COSTS}]==])
include([==[${SHARDOPT_GTEST_SUITES_SCRIPT}]==])
")
  set_property(DIRECTORY APPEND PROPERTY TEST_INCLUDE_FILES "${script}")
endfunction()
