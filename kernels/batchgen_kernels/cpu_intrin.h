// The x86 intrinsics. GCC 12 warns that its own _mm512_undefined_* helpers are used uninitialized
// wherever they are inlined (GCC bug 105593, fixed in GCC 13); those warnings are silenced for
// these headers only, so that the kernels build with -Wall -Wextra -Werror.
#pragma once
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
