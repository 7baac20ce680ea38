// The one place cpp-httplib is included: the tests' HTTP client, an implementation independent of
// the server's (Boost.Beast). Debian builds libcpp-httplib with OpenSSL, zlib and Brotli support
// (see its cpp-httplib.pc), and those macros change the layout of httplib's classes, so every
// file that includes the header must define them exactly as the library was built, or the objects we
// make and the ones the library expects differ in size.
#pragma once

#ifndef CPPHTTPLIB_OPENSSL_SUPPORT
#define CPPHTTPLIB_OPENSSL_SUPPORT
#endif
#ifndef CPPHTTPLIB_ZLIB_SUPPORT
#define CPPHTTPLIB_ZLIB_SUPPORT
#endif
#ifndef CPPHTTPLIB_BROTLI_SUPPORT
#define CPPHTTPLIB_BROTLI_SUPPORT
#endif

#include <httplib.h>
