/* One fused pass of predictive-coding errors per layer group (pcdist.native builds and loads it).
 *
 * For every element of a group's K x B x O block:
 *     u = f(a + bias)       (if `fresh`: au holds a = h_in @ w, bias is the layer's [O] row, and u
 *                            is not stored; else u is read from `u`, and au holds u too, or,
 *                            for gelu, whose f' needs its input, a + bias)
 *     e = pi * (h - u)      (pi: the layer's precision, prec[r / B], only if `prec` is given;
 *                            stored unless `update`: then nothing reads it before the next pass)
 *     d = e * f'(a)         (only if wanted; f' is read from u, as aten's *_backward ops do,
 *                            except gelu's, computed from its input a + bias)
 *     h = h - lr * e        (only if `update`: the value step's own-error term, in place)
 * which replaces up to five memory passes of separate torch ops (the bias copy of baddbmm,
 * f, sub, *_backward, add_) by one. Activation codes match pcdist.native.ACT_CODES; f'(a) at the kinks follows aten's
 * threshold/hardtanh/leaky_relu backward conventions.
 *
 * The residual (μPC) layers' passes, pcd_res_*: s = phi(h) (and a copy x = h where phi' needs its
 * input), e = h - u with the value step's own-error term, and the back-projection into a target
 * target = beta * target + alpha_a * t * phi'(h) + alpha_e * e (phi' read from s, or from x).
 *
 * Built with -O3 -march=native -ffast-math -fopenmp: every (activation, mode) pair gets its
 * own branch-free loop, vectorised with glibc's libmvec for tanh, exp and erf, and split over the
 * OpenMP threads torch already runs.
 */
#include <stddef.h>
#include <math.h>

enum { TANH = 0, SIGMOID = 1, RELU = 2, LEAKY_RELU = 3, HARD_TANH = 4, IDENTITY = 5, GELU = 6, GELU_TANH = 7,
       SILU = 8, SOFTPLUS = 9, ELU = 10, MISH = 11 };

/* gelu constants, as in aten's GeluKernel: 1/sqrt(2), 1/sqrt(2 pi), sqrt(2/pi), 0.044715 */
#define PCD_SQRT1_2 0.70710678118654752440
#define PCD_INV_SQRT_2PI 0.39894228040143267794
#define PCD_SQRT_2_PI 0.79788456080286535588
#define PCD_KAPPA 0.044715

#define CHUNK 8192L /* elements per OpenMP task: small groups run on the calling thread */

/* n elements = rows of O; row r belongs to layer r / B, whose bias is bias + (r / B) * O. */
#define PCD_BODY(T, FWD, DER)                                                             \
    {                                                                                     \
        long rows = n / O, per = CHUNK / O > 0 ? CHUNK / O : 1;                           \
        long nchunks = (rows + per - 1) / per;                                            \
        _Pragma("omp parallel for schedule(static) num_threads(nthreads) if (nchunks > 2)") \
        for (long c = 0; c < nchunks; c++) {                                              \
            long r1 = (c + 1) * per < rows ? (c + 1) * per : rows;                        \
            for (long r = c * per; r < r1; r++) {                                         \
                const T *restrict b = bias + (r / B) * O;                                 \
                const T pk = PREC ? prec[r / B] : (T)1;                                   \
                T *restrict au_ = au + r * O, *restrict h_ = h + r * O, *restrict e_ = e + r * O; \
                T *restrict d_ = d + r * O;                                               \
                const T *restrict u_ = ur + r * O;                                        \
                _Pragma("omp simd")                                                       \
                for (long o = 0; o < O; o++) {                                            \
                    T u;                                                                  \
                    T x = FRESH ? au_[o] + b[o] : au_[o];                                 \
                    if (FRESH) { u = (FWD); } else { u = u_[o]; }                         \
                    T ei = h_[o] - u;                                                     \
                    if (PREC) ei *= pk;                                                   \
                    if (!UPDATE) e_[o] = ei;                                              \
                    if (HAS_D) d_[o] = ei * (DER);                                        \
                    if (UPDATE) h_[o] = h_[o] - lr * ei;                                  \
                }                                                                         \
            }                                                                             \
        }                                                                                 \
    }

/* One specialised kernel per (type, activation, mode); mode = fresh + 2 * (d wanted) + 4 * update + 8 * prec. */
#define PCD_CASE(T, FWD, DER, M, P)                                                       \
    case M + 8 * P: { enum { FRESH = M & 1, HAS_D = (M >> 1) & 1, UPDATE = (M >> 2) & 1, PREC = P }; \
                      PCD_BODY(T, FWD, DER) } break;
#define PCD_CASES(T, FWD, DER, P)                                                         \
    PCD_CASE(T, FWD, DER, 0, P) PCD_CASE(T, FWD, DER, 1, P) PCD_CASE(T, FWD, DER, 2, P)  \
    PCD_CASE(T, FWD, DER, 3, P) PCD_CASE(T, FWD, DER, 4, P) PCD_CASE(T, FWD, DER, 5, P)  \
    PCD_CASE(T, FWD, DER, 6, P) PCD_CASE(T, FWD, DER, 7, P)
#define PCD_ACT(T, SUFFIX, ACTNAME, FWD, DER)                                   \
    static void SUFFIX##_##ACTNAME(int mode, int nthreads, T lo, T hi, T *au, const T *ur, T *h, T *e, \
                                   T *d, const T *bias, const T *prec, long n, long B, long O, T lr) { \
        const T one = (T)1, zero = (T)0;                                                  \
        (void)nthreads; (void)lo; (void)hi; (void)one; (void)zero; (void)d; (void)lr; (void)bias; (void)prec; \
        switch (mode) {                                                                   \
        PCD_CASES(T, FWD, DER, 0)                                                         \
        PCD_CASES(T, FWD, DER, 1)                                                         \
        }                                                                                 \
    }

/* The residual passes of one activation: which = 0: s = phi(src) (x = src if x); which = 1:
 * target = beta * target + alpha_a * t * phi'(.) + alpha_e * e, phi' from u = s (or x for gelu);
 * without e (a layer with no skip) the last term is absent; beta 0 ignores the target's old contents. */
#define PCD_RES(T, SUFFIX, ACTNAME, FWD, DER)                                                    \
    static void SUFFIX##_res_##ACTNAME(int which, int nthreads, T lo, T hi, const T *src, T *s, T *xs, \
                                       const T *t, const T *e, T *target, long n, T beta, T alpha_a, T alpha_e) { \
        const T one = (T)1, zero = (T)0;                                                       \
        (void)nthreads; (void)lo; (void)hi; (void)one; (void)zero;                             \
        long nchunks = (n + CHUNK - 1) / CHUNK;                                                \
        _Pragma("omp parallel for schedule(static) num_threads(nthreads) if (nchunks > 2)")    \
        for (long c = 0; c < nchunks; c++) {                                                   \
            long i0 = c * CHUNK, i1 = (c + 1) * CHUNK < n ? (c + 1) * CHUNK : n;               \
            if (which == 0) {                                                                  \
                _Pragma("omp simd")                                                            \
                for (long i = i0; i < i1; i++) {                                               \
                    T x = src[i];                                                              \
                    s[i] = (FWD);                                                              \
                }                                                                              \
                if (xs)                                                                        \
                    for (long i = i0; i < i1; i++) xs[i] = src[i];                             \
            } else if (!e) { /* no skip: the error term is absent (e may be of another shape) */ \
                _Pragma("omp simd")                                                            \
                for (long i = i0; i < i1; i++) {                                               \
                    T u = s[i], x = xs ? xs[i] : u;                                            \
                    target[i] = (beta == zero ? zero : beta * target[i]) + alpha_a * t[i] * (DER); \
                }                                                                              \
            } else if (beta == zero) {                                                         \
                _Pragma("omp simd")                                                            \
                for (long i = i0; i < i1; i++) {                                               \
                    T u = s[i], x = xs ? xs[i] : u;                                            \
                    target[i] = alpha_a * t[i] * (DER) + alpha_e * e[i];                       \
                }                                                                              \
            } else {                                                                           \
                _Pragma("omp simd")                                                            \
                for (long i = i0; i < i1; i++) {                                               \
                    T u = s[i], x = xs ? xs[i] : u;                                            \
                    target[i] = beta * target[i] + alpha_a * t[i] * (DER) + alpha_e * e[i];    \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
    }

#define PCD_GELU_T(T, TANHF, x) TANHF((T)PCD_SQRT_2_PI * ((x) + (T)PCD_KAPPA * (x) * (x) * (x)))
/* sigmoid without overflow: exp(-|x|) <= 1, then 1 / (1 + e) or e / (1 + e) */
#define PCD_NABS(T, x) ((x) < (T)0 ? (x) : -(x))
#define PCD_SIG(T, EXPF, x) (((x) >= (T)0 ? (T)1 : EXPF(PCD_NABS(T, x))) / ((T)1 + EXPF(PCD_NABS(T, x))))
/* 1 - sigmoid(x) = sigmoid(-x), without the cancellation of 1 - s: silu' multiplies it by x, so at x = 200 one
 * ulp of s below 1 (as a division made under -ffast-math may give) would be 100 ulp of f' */
#define PCD_SIGC(T, EXPF, x) (((x) >= (T)0 ? EXPF(PCD_NABS(T, x)) : (T)1) / ((T)1 + EXPF(PCD_NABS(T, x))))
#define PCD_LOG1P_f32 log1pf /* log1p and expm1 of each type, picked by the SUFFIX of PCD_EACH */
#define PCD_LOG1P_f64 log1p
#define PCD_EXPM1_f32 expm1f
#define PCD_EXPM1_f64 expm1
/* tanh(softplus(x)), aten's mish formula; x capped at 20, where it is 1 to the last bit (float and double) */
#define PCD_TSP(T, TANHF, EXPF, LOG1PF, x) TANHF(LOG1PF(EXPF((x) < (T)20 ? (x) : (T)20)))
/* softplus with beta = lo and threshold = hi, as aten's: linear above hi, the exponent capped at hi */
#define PCD_SP_EXP(EXPF, x) EXPF((x) * lo < hi ? (x) * lo : hi)
#define PCD_EACH(M, T, SUFFIX, TANHF, EXPF, ERFF)                                          \
    M(T, SUFFIX, tanh, TANHF(x), one - u * u)                                          \
    M(T, SUFFIX, sigmoid, PCD_SIG(T, EXPF, x), (one - u) * u)                          \
    M(T, SUFFIX, relu, x > zero ? x : zero, u > zero ? one : zero)                     \
    M(T, SUFFIX, leaky_relu, x > zero ? x : x * lo, u > zero ? one : lo)               \
    M(T, SUFFIX, hard_tanh, x < lo ? lo : (x > hi ? hi : x), (u > lo && u < hi) ? one : zero) \
    M(T, SUFFIX, identity, x, one)                                                     \
    M(T, SUFFIX, gelu, (T)0.5 * x * (one + ERFF(x * (T)PCD_SQRT1_2)),                   \
      (T)0.5 * (one + ERFF(x * (T)PCD_SQRT1_2)) + x * (T)PCD_INV_SQRT_2PI * EXPF((T)-0.5 * x * x)) \
    M(T, SUFFIX, gelu_tanh, (T)0.5 * x * (one + PCD_GELU_T(T, TANHF, x)),                \
      (T)0.5 * (one + PCD_GELU_T(T, TANHF, x)) + (T)0.5 * x * (one - PCD_GELU_T(T, TANHF, x) * PCD_GELU_T(T, TANHF, x)) \
          * (T)PCD_SQRT_2_PI * (one + (T)(3 * PCD_KAPPA) * x * x))                            \
    M(T, SUFFIX, silu, x * PCD_SIG(T, EXPF, x), PCD_SIG(T, EXPF, x) * (one + x * PCD_SIGC(T, EXPF, x))) \
    M(T, SUFFIX, softplus, x * lo > hi ? x : PCD_LOG1P_##SUFFIX(PCD_SP_EXP(EXPF, x)) / lo,   \
      x * lo > hi ? one : PCD_SP_EXP(EXPF, x) / (PCD_SP_EXP(EXPF, x) + one))              \
    M(T, SUFFIX, elu, x > zero ? x : lo * PCD_EXPM1_##SUFFIX(x), u > zero ? one : u + lo) \
    M(T, SUFFIX, mish, x * PCD_TSP(T, TANHF, EXPF, PCD_LOG1P_##SUFFIX, x),                  \
      PCD_TSP(T, TANHF, EXPF, PCD_LOG1P_##SUFFIX, x) + x * PCD_SIG(T, EXPF, x)              \
          * (one - PCD_TSP(T, TANHF, EXPF, PCD_LOG1P_##SUFFIX, x) * PCD_TSP(T, TANHF, EXPF, PCD_LOG1P_##SUFFIX, x)))

#define PCD_PICK(k, SUFFIX, INFIX, act)                                                   \
    switch (act) {                                                                        \
    case TANH: k = SUFFIX##INFIX##tanh; break;                                            \
    case SIGMOID: k = SUFFIX##INFIX##sigmoid; break;                                      \
    case RELU: k = SUFFIX##INFIX##relu; break;                                            \
    case LEAKY_RELU: k = SUFFIX##INFIX##leaky_relu; break;                                \
    case HARD_TANH: k = SUFFIX##INFIX##hard_tanh; break;                                  \
    case GELU: k = SUFFIX##INFIX##gelu; break;                                            \
    case GELU_TANH: k = SUFFIX##INFIX##gelu_tanh; break;                                  \
    case SILU: k = SUFFIX##INFIX##silu; break;                                            \
    case SOFTPLUS: k = SUFFIX##INFIX##softplus; break;                                    \
    case ELU: k = SUFFIX##INFIX##elu; break;                                              \
    case MISH: k = SUFFIX##INFIX##mish; break;                                            \
    default: k = SUFFIX##INFIX##identity; break;                                          \
    }

#define PCD_TYPE(T, SUFFIX, TANHF, EXPF, ERFF)                                            \
    PCD_EACH(PCD_ACT, T, SUFFIX, TANHF, EXPF, ERFF)                                       \
    PCD_EACH(PCD_RES, T, SUFFIX, TANHF, EXPF, ERFF)                                       \
    /* mode = fresh + 2 * (d wanted) + 4 * update + 8 * (prec given); lo, hi: leaky slope / hard_tanh bounds */ \
    void pcd_errors_##SUFFIX(int act, int mode, int nthreads, double lo, double hi, T *au, const T *ur, \
                             T *h, T *e, T *d, const T *bias, const T *prec, long n, long B, long O, double lr) { \
        void (*k)(int, int, T, T, T *, const T *, T *, T *, T *, const T *, const T *, long, long, long, T); \
        PCD_PICK(k, SUFFIX, _, act)                                                       \
        k(mode, nthreads, (T)lo, (T)hi, au, ur, h, e, d, bias, prec, n, B, O, (T)lr);     \
    }                                                                                     \
    /* which = 0: s = phi(src), x = src if x; 1: the back-projection (see PCD_RES) */    \
    void pcd_res_act_##SUFFIX(int act, int which, int nthreads, double lo, double hi, const T *src, T *s, \
                              T *x, const T *t, const T *e, T *target, long n, double beta, double alpha_a, \
                              double alpha_e) {                                           \
        void (*k)(int, int, T, T, const T *, T *, T *, const T *, const T *, T *, long, T, T, T); \
        PCD_PICK(k, SUFFIX, _res_, act)                                                   \
        k(which, nthreads, (T)lo, (T)hi, src, s, x, t, e, target, n, (T)beta, (T)alpha_a, (T)alpha_e); \
    }                                                                                     \
    /* e = h - u (times prec[i / per] if prec); then h -= lr * e on the first `stepped` elements */ \
    void pcd_res_errors_##SUFFIX(int nthreads, const T *u, T *h, T *e, long n, long stepped, double lr, \
                                 const T *prec, long per) {                               \
        const T l = (T)lr;                                                                \
        long nchunks = (n + CHUNK - 1) / CHUNK;                                           \
        (void)nthreads;                                                                   \
        _Pragma("omp parallel for schedule(static) num_threads(nthreads) if (nchunks > 2)") \
        for (long c = 0; c < nchunks; c++) {                                              \
            long i0 = c * CHUNK, i1 = (c + 1) * CHUNK < n ? (c + 1) * CHUNK : n;          \
            long j1 = i1 < stepped ? i1 : stepped;                                        \
            if (prec) { /* one precision per layer of `per` elements: runs of one layer within the chunk */ \
                for (long a = i0; a < i1;) {                                              \
                    long z = (a / per + 1) * per < i1 ? (a / per + 1) * per : i1;         \
                    long zs = z < j1 ? z : (a > j1 ? a : j1);                              \
                    const T pk = prec[a / per];                                           \
                    _Pragma("omp simd")                                                   \
                    for (long i = a; i < zs; i++) {                                       \
                        T ei = (h[i] - u[i]) * pk;                                        \
                        e[i] = ei;                                                        \
                        h[i] = h[i] - l * ei;                                             \
                    }                                                                     \
                    _Pragma("omp simd")                                                   \
                    for (long i = zs; i < z; i++) e[i] = (h[i] - u[i]) * pk;              \
                    a = z;                                                                \
                }                                                                         \
                continue;                                                                 \
            }                                                                             \
            _Pragma("omp simd")                                                           \
            for (long i = i0; i < j1; i++) {                                              \
                T ei = h[i] - u[i];                                                       \
                e[i] = ei;                                                                \
                h[i] = h[i] - l * ei;                                                     \
            }                                                                             \
            _Pragma("omp simd")                                                           \
            for (long i = (j1 > i0 ? j1 : i0); i < i1; i++) e[i] = h[i] - u[i];            \
        }                                                                                 \
    }

PCD_TYPE(float, f32, tanhf, expf, erff)
PCD_TYPE(double, f64, tanh, exp, erf)
