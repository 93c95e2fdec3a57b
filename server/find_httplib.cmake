# cpp-httplib for the server. Debian's libcpp-httplib-dev ships it compiled
# (httplib.h declarations + libcpp-httplib.so, with OpenSSL / zlib / Brotli
# support switched on by its pkg-config flags, which must match the
# library's); a header-only copy found without pkg-config is used as it is.
# Sets REWIND_HTTPLIB_FOUND and the target rewind_httplib.
set(REWIND_HTTPLIB_FOUND OFF)
find_package(PkgConfig QUIET)
if(PKG_CONFIG_FOUND)
  pkg_check_modules(CPP_HTTPLIB QUIET IMPORTED_TARGET GLOBAL cpp-httplib)
endif()
find_path(REWIND_HTTPLIB_INCLUDE_DIR httplib.h)
if(REWIND_HTTPLIB_INCLUDE_DIR)
  find_package(Threads REQUIRED)
  add_library(rewind_httplib INTERFACE)
  if(CPP_HTTPLIB_FOUND)
    target_link_libraries(rewind_httplib INTERFACE PkgConfig::CPP_HTTPLIB Threads::Threads)
  else()
    target_include_directories(rewind_httplib SYSTEM INTERFACE ${REWIND_HTTPLIB_INCLUDE_DIR})
    target_link_libraries(rewind_httplib INTERFACE Threads::Threads)
  endif()
  set(REWIND_HTTPLIB_FOUND ON)
endif()
