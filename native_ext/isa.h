/* Which instruction-set version of a kernel this CPU runs: the best it has, unless an environment
 * variable asks for one (tests force each version this way: VARIABLE=portable|avx2|avx512; a version the
 * CPU lacks falls back to portable). With needs_fma, both vector versions also need FMA3 (their scalar code
 * fuses multiply-adds too). */
#ifndef KILN_ISA_H
#define KILN_ISA_H

#include <stdlib.h>
#include <string.h>

enum { KILN_ISA_PORTABLE = 0, KILN_ISA_AVX2 = 1, KILN_ISA_AVX512 = 2 };

static int kiln_isa_pick(const char *variable, int needs_fma) {
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
    __builtin_cpu_init();
    const int fma = !needs_fma || __builtin_cpu_supports("fma");
    const int avx2 = __builtin_cpu_supports("avx2") && fma;
    const int avx512 = __builtin_cpu_supports("avx512f") && fma;
    const char *asked = getenv(variable);
    if (asked && strcmp(asked, "portable") == 0) return KILN_ISA_PORTABLE;
    if (asked && strcmp(asked, "avx2") == 0) return avx2 ? KILN_ISA_AVX2 : KILN_ISA_PORTABLE;
    if (asked && strcmp(asked, "avx512") == 0) return avx512 ? KILN_ISA_AVX512 : KILN_ISA_PORTABLE;
    return avx512 ? KILN_ISA_AVX512 : avx2 ? KILN_ISA_AVX2 : KILN_ISA_PORTABLE;
#else
    (void)variable;
    (void)needs_fma;
    return KILN_ISA_PORTABLE;
#endif
}

#endif
