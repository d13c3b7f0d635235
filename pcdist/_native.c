/* One fused pass of predictive-coding errors per layer group (pcdist.native builds and loads it).
 *
 * For every element of a group's K x B x O block:
 *     u = f(a + bias)       (if `fresh`: au holds a = h_in @ w, bias is the layer's [O] row, and u
 *                            is not stored; else u is read from `u`, and au holds u too, or,
 *                            for gelu, whose f' needs its input, a + bias)
 *     e = h - u             (stored unless `update`: then nothing reads it before the next pass)
 *     d = e * f'(a)         (only if wanted; f' is read from u, as aten's *_backward ops do,
 *                            except gelu's, computed from its input a + bias)
 *     h = h - lr * e        (only if `update`: the value step's own-error term, in place)
 * which replaces up to five memory passes of separate torch ops (the bias copy of baddbmm,
 * f, sub, *_backward, add_) by one. Activation codes match pcdist.native.ACT_CODES; f'(a) at the kinks follows aten's
 * threshold/hardtanh/leaky_relu backward conventions.
 *
 * Built with -O3 -march=native -ffast-math -fopenmp: every (activation, mode) pair gets its
 * own branch-free loop, vectorised with glibc's libmvec for tanh, exp and erf, and split over the
 * OpenMP threads torch already runs.
 */
#include <stddef.h>
#include <math.h>

enum { TANH = 0, SIGMOID = 1, RELU = 2, LEAKY_RELU = 3, HARD_TANH = 4, IDENTITY = 5, GELU = 6, GELU_TANH = 7 };

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
                T *restrict au_ = au + r * O, *restrict h_ = h + r * O, *restrict e_ = e + r * O; \
                T *restrict d_ = d + r * O;                                               \
                const T *restrict u_ = ur + r * O;                                        \
                _Pragma("omp simd")                                                       \
                for (long o = 0; o < O; o++) {                                            \
                    T u;                                                                  \
                    T x = FRESH ? au_[o] + b[o] : au_[o];                                 \
                    if (FRESH) { u = (FWD); } else { u = u_[o]; }                         \
                    T ei = h_[o] - u;                                                     \
                    if (!UPDATE) e_[o] = ei;                                              \
                    if (HAS_D) d_[o] = ei * (DER);                                        \
                    if (UPDATE) h_[o] = h_[o] - lr * ei;                                  \
                }                                                                         \
            }                                                                             \
        }                                                                                 \
    }

/* One specialised kernel per (type, activation, mode). */
#define PCD_ACT(T, SUFFIX, ACTNAME, FWD, DER)                                   \
    static void SUFFIX##_##ACTNAME(int mode, int nthreads, T lo, T hi, T *au, const T *ur, T *h, T *e, \
                                   T *d, const T *bias, long n, long B, long O, T lr) {   \
        const T one = (T)1, zero = (T)0;                                                  \
        (void)nthreads; (void)lo; (void)hi; (void)one; (void)zero; (void)d; (void)lr; (void)bias;                     \
        switch (mode) {                                                                   \
        case 0: { enum { FRESH = 0, HAS_D = 0, UPDATE = 0 }; PCD_BODY(T, FWD, DER) } break; \
        case 1: { enum { FRESH = 1, HAS_D = 0, UPDATE = 0 }; PCD_BODY(T, FWD, DER) } break; \
        case 2: { enum { FRESH = 0, HAS_D = 1, UPDATE = 0 }; PCD_BODY(T, FWD, DER) } break; \
        case 3: { enum { FRESH = 1, HAS_D = 1, UPDATE = 0 }; PCD_BODY(T, FWD, DER) } break; \
        case 4: { enum { FRESH = 0, HAS_D = 0, UPDATE = 1 }; PCD_BODY(T, FWD, DER) } break; \
        case 5: { enum { FRESH = 1, HAS_D = 0, UPDATE = 1 }; PCD_BODY(T, FWD, DER) } break; \
        case 6: { enum { FRESH = 0, HAS_D = 1, UPDATE = 1 }; PCD_BODY(T, FWD, DER) } break; \
        default: { enum { FRESH = 1, HAS_D = 1, UPDATE = 1 }; PCD_BODY(T, FWD, DER) } break; \
        }                                                                                 \
    }

#define PCD_GELU_T(T, TANHF, x) TANHF((T)PCD_SQRT_2_PI * ((x) + (T)PCD_KAPPA * (x) * (x) * (x)))
#define PCD_TYPE(T, SUFFIX, TANHF, EXPF, ERFF)                                            \
    PCD_ACT(T, SUFFIX, tanh, TANHF(x), one - u * u)                                    \
    PCD_ACT(T, SUFFIX, sigmoid, one / (one + EXPF(-x)), (one - u) * u)                 \
    PCD_ACT(T, SUFFIX, relu, x > zero ? x : zero, u > zero ? one : zero)               \
    PCD_ACT(T, SUFFIX, leaky_relu, x > zero ? x : x * lo, u > zero ? one : lo)         \
    PCD_ACT(T, SUFFIX, hard_tanh, x < lo ? lo : (x > hi ? hi : x), (u > lo && u < hi) ? one : zero) \
    PCD_ACT(T, SUFFIX, identity, x, one)                                               \
    PCD_ACT(T, SUFFIX, gelu, (T)0.5 * x * (one + ERFF(x * (T)PCD_SQRT1_2)),             \
            (T)0.5 * (one + ERFF(x * (T)PCD_SQRT1_2)) + x * (T)PCD_INV_SQRT_2PI * EXPF((T)-0.5 * x * x)) \
    PCD_ACT(T, SUFFIX, gelu_tanh, (T)0.5 * x * (one + PCD_GELU_T(T, TANHF, x)),          \
            (T)0.5 * (one + PCD_GELU_T(T, TANHF, x)) + (T)0.5 * x * (one - PCD_GELU_T(T, TANHF, x) * PCD_GELU_T(T, TANHF, x)) \
                * (T)PCD_SQRT_2_PI * (one + (T)(3 * PCD_KAPPA) * x * x))                  \
    /* mode = fresh + 2 * (d wanted) + 4 * update; lo, hi: leaky slope / hard_tanh bounds */ \
    void pcd_errors_##SUFFIX(int act, int mode, int nthreads, double lo, double hi, T *au, const T *ur, \
                             T *h, T *e, T *d, const T *bias, long n, long B, long O, double lr) { \
        void (*k)(int, int, T, T, T *, const T *, T *, T *, T *, const T *, long, long, long, T); \
        switch (act) {                                                                    \
        case TANH: k = SUFFIX##_tanh; break;                                              \
        case SIGMOID: k = SUFFIX##_sigmoid; break;                                        \
        case RELU: k = SUFFIX##_relu; break;                                              \
        case LEAKY_RELU: k = SUFFIX##_leaky_relu; break;                                  \
        case HARD_TANH: k = SUFFIX##_hard_tanh; break;                                    \
        case GELU: k = SUFFIX##_gelu; break;                                              \
        case GELU_TANH: k = SUFFIX##_gelu_tanh; break;                                    \
        default: k = SUFFIX##_identity; break;                                            \
        }                                                                                 \
        k(mode, nthreads, (T)lo, (T)hi, au, ur, h, e, d, bias, n, B, O, (T)lr);                                     \
    }

PCD_TYPE(float, f32, tanhf, expf, erff)
PCD_TYPE(double, f64, tanh, exp, erf)
