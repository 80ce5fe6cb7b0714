/* Compiles the typed part of a kernel file once per element type: float32 (names ending _f32),
 * then bfloat16 (_bf16). A kernel file written for both has the form
 *
 *     #ifndef NAME              compiled as itself: what does not depend on the type
 *     #include "typed.h"
 *     #define TYPED_FILE "op.c"
 *     #include "each_type.h"    which includes op.c again, once per type, NAME defined
 *     #else
 *     ...                       the kernels, on T, NAME, LOAD, STORE, ROUND, LOAD16, IS_BF16
 *     #endif
 *
 * T: the element type; NAME(x): x with the type's suffix; LOAD(v): a T as float; STORE(x): a
 * float as T; ROUND(x): float x as torch stores it in T; LOAD16(p): 16 Ts as an AVX-512 float
 * vector (used only where the compiler targets AVX-512), LOAD8(p) 8 as an AVX2 one (likewise);
 * IS_BF16: 1 for bfloat16, else 0.
 * Included once, at the end of the kernel file; no include guard on purpose. */
#define T float
#define NAME(x) x##_f32
#define LOAD f32_identity
#define STORE f32_identity
#define ROUND f32_identity
#define LOAD16 load16_f32
#define LOAD8 load8_f32
#define IS_BF16 0
#include TYPED_FILE
#undef T
#undef NAME
#undef LOAD
#undef STORE
#undef ROUND
#undef LOAD16
#undef LOAD8
#undef IS_BF16

#define T bf16
#define NAME(x) x##_bf16
#define LOAD bf16_to_f32
#define STORE f32_to_bf16
#define ROUND bf16_round
#define LOAD16 load16_bf16
#define LOAD8 load8_bf16
#define IS_BF16 1
#include TYPED_FILE /* the last of the kernel file: the macros may stay */
