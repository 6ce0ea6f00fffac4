/* tilegraph C backend: the runtime every emitted module includes.
 *
 * What lives in the runtime rather than in emitted code: the calls into oneDNN (matmul and
 * convolution primitives, their weights reordered once into the layout the primitive
 * prefers), the row kernels (softmax, layer_norm), flash attention and an error slot.
 * Emitted code is the model: loops over its shapes, and calls to these.
 *
 * This header declares them and defines the inline element functions the emitted
 * loops vectorise (exp, tanh, erf, gelu, ...); runtime.c and attention.c define the rest,
 * compiled once into a shared library of its own (build.py), which every module links
 * against, so a model's build compiles only its own code.
 *
 * Every entry point returns 0 on success; on failure it writes one line into
 * tg_err (what failed and why) and returns nonzero, and the Python side raises it.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#include <oneapi/dnnl/dnnl.h>

#define TG_MAX_POST 8
#define TG_MAX_DIMS 12
/* The largest attention block (query rows or keys) tg_attention takes: its working block
 * of bq*bk + bq*(dv+2) floats stays far from overflow; the tile pass picks 16 to 256. */
#define TG_MAX_BLOCK 16384

extern char tg_err[1024];
const char *tg_error(void);
void tg_set_threads(int n);
int tg_max_threads(void);

#define TG_FAIL(...) do { snprintf(tg_err, sizeof tg_err, __VA_ARGS__); return 1; } while (0)
#define TG_DNNL(call, what) do { dnnl_status_t st_ = (call); \
    if (st_ != dnnl_success) TG_FAIL("oneDNN %s failed (status %d)", what, (int)st_); } while (0)

/* An epilogue step oneDNN applies to each output block while it is in cache:
 * an eltwise function (alg, alpha, beta), a binary op with a second tensor
 * (dims broadcast against the output, strides of its own), or (binary == TG_POST_SUM)
 * the sum of what the destination held before: a residual add accumulated in place. */
#define TG_POST_SUM 2
typedef struct {
    int binary;
    int alg;
    float alpha, beta;
    int nd;
    int64_t dims[TG_MAX_DIMS], strides[TG_MAX_DIMS];
} tg_post;

/* A weight reordered once into a primitive's preferred layout, shared by every
 * shape binding whose primitive accepts that layout. */
typedef struct {
    void *data;
    dnnl_memory_desc_t md;
} tg_packed;

typedef struct tg_wino tg_wino; /* winograd.c */
typedef struct tg_sconv tg_sconv; /* strided_conv.c */
typedef struct tg_gemv tg_gemv; /* gemv.c */
typedef struct {
    dnnl_primitive_t prim;
    tg_wino *wino; /* a Winograd convolution (winograd.c) in place of `prim`, or NULL */
    tg_sconv *sconv; /* a strided 1-D convolution as matmuls (strided_conv.c) in place of `prim`, or NULL */
    tg_gemv *gemv; /* a one-row matmul (gemv.c) in place of `prim`, or NULL */
    dnnl_memory_t src, wei, bias, dst, post[TG_MAX_POST], wei_scales;
    int npost, has_bias, scaled; /* scaled: one weight scale per column, given at run as `bias` */
    const void *wei_handle; /* the packed copy, or NULL: the caller's pointer each run */
    /* Where the operands' own layouts have only oneDNN's reference kernel: reorders into
     * (src, a non-constant weight) and out of (dst) the layouts a fast kernel takes, each
     * run, through scratch buffers of the primitive's own (runtime.c, tg_relayout). */
    dnnl_primitive_t re_src, re_wei, re_dst;
    dnnl_memory_t user_src, user_wei, user_dst;
    void *tmp_src, *tmp_wei, *tmp_dst;
    /* A B reordered each run (tg_aliased_rows) into the arena scratch its step passes
     * (tg_prim_scratch) where the emitter reserved enough bytes for it, else into tmp_wei.
     * own_bytes: the scratch this primitive allocated itself (tmp_*), outside the arena. */
    void *wei_arena;
    size_t own_bytes;
    /* A chained source (tg_conv_create's `from`) this primitive could not take as it lies:
     * reordered first into the emitter's f32 layout (scratch tmp_in). */
    dnnl_primitive_t re_in;
    dnnl_memory_t in_from, in_to;
    void *tmp_in;
    /* A blocked convolution that accumulates into the caller's destination (a sum post-op):
     * the caller's values reordered into tmp_dst before the run (conv.c, tg_conv_blocked). */
    dnnl_primitive_t re_acc;
    /* A long GEMM on oneDNN's sgemm in place of `prim` (runtime.c, tg_long_gemm): op(A) is
     * A or A^T ('N'/'T'), row-major, C = op(A) @ op(B). */
    int sgemm;
    char trans_a, trans_b;
    int64_t m, n, k, lda, ldb, ldc;
} tg_prim;

/* The runtime's entry points (runtime.c says what each does). */
void tg_prim_destroy(tg_prim *g);
void tg_prim_scratch(tg_prim *g, void *scratch);
int tg_prim_run(tg_prim *g, const void *src, const void *wei, const void *bias, void *dst,
                void *const *post);
int tg_matmul_create(tg_prim *g, int nd, const int64_t *a_dims, const int64_t *a_str, const int64_t *b_dims,
                     const int64_t *b_str, const int64_t *c_dims, const int64_t *c_str, const int *types,
                     int scaled, const void *weight, tg_packed *pack, int npost, const tg_post *posts,
                     size_t wei_scratch);
int tg_conv_create(tg_prim *g, int nd, const int64_t *x_dims, const int64_t *x_str, int w_nd,
                   const int64_t *w_dims, const int64_t *w_str, const int64_t *y_dims, const int64_t *y_str,
                   int has_bias, const int64_t *strides, const int64_t *dilations, const int64_t *pads,
                   const void *weight, tg_packed *pack, int npost, const tg_post *posts, const tg_prim *from,
                   int chain_out, int stream, int block);
int tg_wino_create(tg_prim *g, int nd, const int64_t *x_dims, const int64_t *x_str, int w_nd,
                   const int64_t *w_dims, const int64_t *w_str, const int64_t *y_dims, const int64_t *y_str,
                   int has_bias, const int64_t *strides, const int64_t *dilations, const int64_t *pads,
                   const void *weight, tg_packed *pack, int npost, const tg_post *posts, const tg_prim *from,
                   int chain_out, int stream, int64_t scratch);
int tg_wino_run(tg_prim *g, const void *src, const void *bias, void *dst, void *const *post);
void tg_wino_free(tg_wino *s);
void tg_set_winograd(int mode);
int tg_winograd_count(void);
int tg_sconv_create(tg_prim *g, int nd, const int64_t *x_dims, const int64_t *x_str, int w_nd,
                    const int64_t *w_dims, const int64_t *w_str, const int64_t *y_dims, const int64_t *y_str,
                    int has_bias, const int64_t *strides, const int64_t *dilations, const int64_t *pads,
                    const void *weight, tg_packed *pack, int npost, const tg_post *posts, const tg_prim *from,
                    int chain_out, int stream, int chosen);
int tg_sconv_run(tg_prim *g, const void *src, void *dst);
void tg_sconv_free(tg_sconv *s);
void tg_set_strided_conv(int mode);
int tg_strided_conv_count(void);
int tg_gemv_create(tg_prim *g, int nd, const int64_t *a_dims, const int64_t *a_str, const int64_t *b_dims,
                   const int64_t *b_str, const int64_t *c_dims, const int64_t *c_str, const int *types, int scaled,
                   const void *weight, tg_packed *pack, int npost, const tg_post *posts, size_t wei_scratch,
                   int wins);
int tg_gemv_conv_create(tg_prim *g, int nd, const int64_t *x_dims, const int64_t *x_str, int w_nd,
                        const int64_t *w_dims, const int64_t *w_str, const int64_t *y_dims, const int64_t *y_str,
                        int has_bias, const int64_t *strides, const int64_t *dilations, const int64_t *pads,
                        const void *weight, tg_packed *pack, int npost, const tg_post *posts, const tg_prim *from,
                        int chain_out, int stream, int block, int wins);
int tg_gemv_run(tg_prim *g, const void *src, const void *bias, void *dst, void *const *post);
void tg_gemv_free(tg_gemv *s);
void tg_set_gemv(int mode);
int tg_gemv_count(void);
int tg_bf16_supported(void);
int tg_reorder_count(void);
void tg_set_huge_pages(int on);
size_t tg_huge_page_bytes(void);
int tg_amx_supported(void);
void tg_set_bf16(int on);
int tg_bf16_on(void);
void tg_set_run_bf16(int on);
int tg_bf16_attention_count(void);
int64_t tg_bf16_attention_pairs(void);
int tg_primitive_count(void);
const char *tg_primitive_report(void);
void tg_softmax_rows(const float *x, float *y, int64_t rows, int64_t n);
void tg_layer_norm_rows(const float *x, float *y, const float *scale, const float *bias, int64_t rows,
                        int64_t n, float eps);
void tg_layer_norm_cols(const float *x, float *y, const float *scale, const float *bias, int64_t outer,
                        int64_t n, int64_t inner, float eps);
void tg_layer_norm_rows_bf16(const float *x, uint16_t *y, const float *scale, const float *bias, int64_t rows,
                             int64_t n, float eps);
void tg_dynamic_quantize_rows(const float *x, int8_t *q, float *scale, int64_t rows, int64_t n);
void tg_set_attention_out_bf16(int on);
void tg_set_attention_in_bf16(int bits);
int tg_attention(int nb, const int64_t *bd, const int64_t *qb, const int64_t *kb, const int64_t *vb,
                 const int64_t *mb, const int64_t *ob, const float *q, const float *k, const float *v,
                 const void *mask, float *o, int64_t lq, int64_t lk, int64_t d, int64_t dv, int64_t qr,
                 int64_t kr, int64_t vr, int64_t orow, int mask_kind, int64_t mr, int64_t mc, float scale,
                 int causal, int64_t bq, int64_t bk);
int tg_attention_backward_count(void);
int tg_attention_backward(int nb, const int64_t *bd, const int64_t *bs, const float *q, const float *k,
                          const float *v, const float *gy, const void *mask, float *dq, float *dk, float *dv,
                          int64_t lq, int64_t lk, int64_t d, int64_t e, int64_t qr, int64_t kr, int64_t vr,
                          int64_t gr, int64_t dqr, int64_t dkr, int64_t dvr, int mask_kind, int64_t mr, int64_t mc,
                          float scale, int causal, int64_t bq);

/* Philox2x32-10 (Random123; Salmon et al., SC'11) of the counter (i mod 2^32, site ^ (i >> 32) << 16)
 * under the key of seed's two 32-bit halves xored: tg.dropout's random bits, a pure function of
 * (seed, site, i), the same as ir/kernels.py's philox_bits. */
static inline uint32_t tg_philox(uint64_t i, uint32_t site, uint64_t seed) {
    uint32_t c0 = (uint32_t)i, c1 = site ^ ((uint32_t)(i >> 32) << 16);
    uint32_t key = (uint32_t)seed ^ (uint32_t)(seed >> 32);
    for (int r = 0; r < 10; r++) {
        uint64_t prod = (uint64_t)0xD256D193u * c0;
        c0 = (uint32_t)(prod >> 32) ^ key ^ c1;
        c1 = (uint32_t)prod;
        key += 0x9E3779B9u;
    }
    return c0;
}

/* exp for float32 in straight-line code the compiler vectorises (libm's expf is a
 * call per element): e^x = 2^n e^r, n = round(x log2 e), |r| <= ln2/2, e^r by a
 * degree-6 Taylor polynomial (max relative error 2e-7 on that interval); 2^n built
 * in the exponent bits. Overflow gives inf, underflow 0, NaN stays NaN. */
#pragma omp declare simd notinbranch
static inline float tg_exp_in_range(float t) { /* (t in [-87.33654, 88.72283], or NaN) */
    float n = __builtin_rintf(t * 1.44269504088896341f);
    float r = t - n * 0.693145751953125f;
    r = r - n * 1.428606765330187e-06f;
    float p = 1.f + r * (1.f + r * (0.5f + r * (1.f / 6 + r * (1.f / 24 + r * (1.f / 120 + r * (1.f / 720))))));
    union { float f; int32_t i; } scale;
    scale.i = ((int32_t)n + 127) << 23;
    return p * scale.f;
}
#pragma omp declare simd notinbranch
static inline float tg_expf(float x) {
    float y = tg_exp_in_range(x > 88.72283f ? 88.72283f : (x < -87.33654f ? -87.33654f : x));
    y = x > 88.72283f ? INFINITY : y;
    y = x < -87.33654f ? 0.f : y;
    return x != x ? x : y;
}

/* tanh for float32, vectorisable: an odd Taylor polynomial below |x| = 0.3 (where
 * 1 - 2/(e^2x + 1) would cancel; the next term is under 1e-7 relative), that formula
 * above, with tg_expf. */
#pragma omp declare simd notinbranch
static inline float tg_tanhf(float x) {
    float ax = fabsf(x), x2 = x * x;
    float small = x + x * x2 * (-1.f / 3 + x2 * (2.f / 15 + x2 * (-17.f / 315 + x2 * (62.f / 2835))));
    float big = 1.f - 2.f / (tg_expf(2.f * ax) + 1.f);
    big = x < 0 ? -big : big;
    return ax < 0.3f ? small : (x != x ? x : big);
}

/* erf for float32, vectorisable (libm's erff is a call per element): Eigen's rational
 * approximation x P(x^2) / Q(x^2) on [-4, 4] (past 4, erf is +-1 in float32); relative
 * error under 5e-7 (checked against math.erf on 2e6 points). NaN stays NaN. */
#pragma omp declare simd notinbranch
static inline float tg_erff(float v) {
    float x = v > 4.f ? 4.f : (v < -4.f ? -4.f : v), x2 = x * x;
    float p = -2.72614225801306e-10f;
    p = p * x2 + 2.77068142495902e-08f; p = p * x2 - 2.10102402082508e-06f; p = p * x2 - 5.69250639462346e-05f;
    p = p * x2 - 7.34990630326855e-04f; p = p * x2 - 2.95459980854025e-03f; p = p * x2 - 1.60960333262415e-02f;
    float q = -1.45660718464996e-05f;
    q = q * x2 - 2.13374055278905e-04f; q = q * x2 - 1.68282697438203e-03f; q = q * x2 - 7.37332916720468e-03f;
    q = q * x2 - 1.42647390514189e-02f;
    return v != v ? v : x * p / q;
}

/* gelu as the NumPy backend computes float32 gelu (ir/kernels.py): x * Phi(x) =
 * x / (1 + exp(x G(x^2))), G the polynomial TG_GELU_P the module defines from
 * kernels.py's fit, x clipped for G only. The tanh form: x * sigmoid(2u). */
#ifdef TG_GELU_CLIP /* defined by the module (emit._gelu_defines) */
#pragma omp declare simd notinbranch
static inline float tg_gelu_erf(float x) {
    float t = x > TG_GELU_CLIP ? TG_GELU_CLIP : (x < -TG_GELU_CLIP ? -TG_GELU_CLIP : x);
    float t2 = t * t, p = TG_GELU_P6;
    p = p * t2 + TG_GELU_P5; p = p * t2 + TG_GELU_P4; p = p * t2 + TG_GELU_P3;
    p = p * t2 + TG_GELU_P2; p = p * t2 + TG_GELU_P1; p = p * t2 + TG_GELU_P0;
    return x / (1.f + tg_expf(p * x));
}
#endif
#pragma omp declare simd notinbranch
static inline float tg_gelu_tanh(float x) {
    float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
    return x / (1.f + tg_expf(-2.f * u));
}
static inline double tg_gelu_erf_d(double x) { return 0.5 * x * (1. + erf(x * 0.70710678118654752)); }
static inline double tg_gelu_tanh_d(double x) {
    return 0.5 * x * (1. + tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)));
}
/* sigmoid for float32 from e^-|x|, a quotient on each side (no overflow, and both sides as
 * accurate as the exp). The one-division form 1 / (1 + e^-x) over a clamped exp was 0.6x the
 * time but 4e-7 off where this is 2e-7, and that moved a GGUF decoder's batched logits from
 * its single-prompt ones by 1e-3 in two steps (tests/test_gguf.py), so it stays this. */
#pragma omp declare simd notinbranch
static inline float tg_sigmoid(float x) { float e = tg_expf(-fabsf(x)); return x >= 0 ? 1.f / (1.f + e) : e / (1.f + e); }
/* sigmoid as 1 / (1 + e^-x) for the swish after a convolution (loops.py, _convolution_swish;
 * EfficientNet's runs over 6M values a call): one division where tg_sigmoid takes two, and
 * tg_expf's own range checks left out: its argument clamped to [-87, 88] (e^-x then stays
 * finite and normal, NaN passes through the clamp and the polynomial). 2.3e-7 relative error
 * (tg_sigmoid's 2.5e-7) on every result that is a normal float; below x = -87.3 results of
 * 1e-38 and less come out 6e-39. A swish loop's time: 0.67x tg_sigmoid's (one AVX-512 core,
 * 64K values in cache). A decoder's SiLU keeps tg_sigmoid (tests/test_gguf.py, above). */
#pragma omp declare simd notinbranch
static inline float tg_sigmoid_swish(float x) { return 1.f / (1.f + tg_exp_in_range(x < -88.f ? 88.f : (x > 87.f ? -87.f : -x))); }
static inline double tg_sigmoid_d(double x) { double e = exp(-fabs(x)); return x >= 0 ? 1. / (1. + e) : e / (1. + e); }

/* --- integer division and float-to-integer casts, with NumPy's results (ir/kernels.py) ---
 *
 * C leaves these undefined or traps where NumPy defines a result: x / 0 and x % 0 (0 in NumPy),
 * INT_MIN / -1 (a trap), a float out of an integer's range (x86's "integer indefinite", INT_MIN,
 * in NumPy's casts). kernels.div truncates toward zero after np.abs, which leaves INT_MIN
 * negative; the signed helpers repeat that step for step (the module compiles with -fwrapv,
 * and a narrower type converts back modulo its width). */
#define TG_SIGNED_DIVISION(S, T)                                                                     \
    static inline T tg_div_##S(T a, T b) {                                                           \
        if (b == 0) return 0;                                                                        \
        T ua = (T)(a < 0 ? -a : a), ub = (T)(b < 0 ? -b : b); /* np.abs: INT_MIN stays negative */  \
        T q = (T)(ua / ub); /* ub is never -1 */                                                     \
        if ((T)(ua % ub) != 0 && (ua < 0) != (ub < 0)) q = (T)(q - 1); /* // floors */               \
        return (a < 0) != (b < 0) ? (T)-q : q;                                                       \
    }                                                                                                \
    static inline T tg_fmod_##S(T a, T b) { return b == 0 || b == -1 ? 0 : (T)(a % b); }             \
    static inline T tg_mod_##S(T a, T b) { /* np.mod: the sign of the divisor */                    \
        T r = tg_fmod_##S(a, b);                                                                     \
        return r != 0 && (r < 0) != (b < 0) ? (T)(r + b) : r;                                        \
    }
#define TG_UNSIGNED_DIVISION(S, T)                                                                   \
    static inline T tg_div_##S(T a, T b) { return b == 0 ? 0 : (T)(a / b); }                        \
    static inline T tg_fmod_##S(T a, T b) { return b == 0 ? 0 : (T)(a % b); }                       \
    static inline T tg_mod_##S(T a, T b) { return tg_fmod_##S(a, b); }
TG_SIGNED_DIVISION(i8, int8_t)
TG_SIGNED_DIVISION(i16, int16_t)
TG_SIGNED_DIVISION(i32, int32_t)
TG_SIGNED_DIVISION(i64, int64_t)
TG_UNSIGNED_DIVISION(ui8, uint8_t)
TG_UNSIGNED_DIVISION(ui16, uint16_t)
TG_UNSIGNED_DIVISION(ui32, uint32_t)
TG_UNSIGNED_DIVISION(ui64, uint64_t)

/* np.mod on floats (npy_divmod): fmod moved to the divisor's sign, a zero result signed as
 * the divisor, NaN for a zero divisor (as fmod gives). */
static inline double tg_mod_f64(double a, double b) {
    double r = fmod(a, b);
    if (b == 0) return r;
    return r != 0 ? ((b < 0) != (r < 0) ? r + b : r) : copysign(0.0, b);
}
static inline float tg_mod_f32(float a, float b) {
    float r = fmodf(a, b);
    if (b == 0) return r;
    return r != 0 ? ((b < 0) != (r < 0) ? r + b : r) : copysignf(0.f, b);
}

/* A float to int32/int64 as NumPy casts on x86: truncation, and INT_MIN for NaN and out of
 * range; the narrower integers take the int32 result modulo their width, as its casts do. */
static inline int64_t tg_f2i64(double x) {
    return x != x || x >= 9223372036854775808.0 || x < -9223372036854775808.0 ? INT64_MIN : (int64_t)x;
}
static inline int32_t tg_f2i32(double x) {
    return x != x || x >= 2147483648.0 || x < -2147483648.0 ? INT32_MIN : (int32_t)x;
}

/* --- quantization, as ir/quant.py defines it --- */

/* x rounded to bf16 (nearest, ties to even, as oneDNN's conversions and vcvtneps2bf16 round),
 * its 16 bits: what a step writes into a buffer a bf16 GEMM reads as it lies (onednn.py,
 * bf16_sources). A NaN stays a (quiet) NaN: rounding its payload could carry into the sign. */
#pragma omp declare simd notinbranch
static inline uint16_t tg_f2bf(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : rounded);
}

/* y clamped into [lo, hi]; NaN gives 0 (what NumPy's cast of NaN to an integer gives here). */
#pragma omp declare simd notinbranch
static inline float tg_saturate(float y, float lo, float hi) {
    y = y < lo ? lo : y;
    y = y > hi ? hi : y;
    return y != y ? 0.f : y;
}
