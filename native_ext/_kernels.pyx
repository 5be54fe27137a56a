# cython: language_level=3
"""Cython kernels for the CPU backend: every hot operation except matrix products.

Private module: the public, validating entry points are in native_ext.kernels, and each
kernel has a plain numpy twin in native_ext.reference. Kernels take C-contiguous float32
memoryviews, release the GIL, and parallelise only over independent rows, so their
results do not depend on the thread count. Reductions across rows run serially.
Dimension letters as in native_ext.reference.
"""

from cython.parallel cimport prange
from libc.math cimport exp, expf, log, sqrt, sqrtf, INFINITY
from libc.stdint cimport int64_t
from libc.stdlib cimport malloc, free
from libc.string cimport memset

ctypedef float f32


def rmsnorm_forward(const f32[:, ::1] x, const f32[::1] weight, double eps,
                    f32[:, ::1] out, f32[::1] rstd):
    cdef Py_ssize_t N = x.shape[0], C = x.shape[1], n, c
    cdef double acc
    cdef f32 r
    with nogil:
        for n in prange(N, schedule="static"):
            acc = 0.0
            for c in range(C):
                acc = acc + <double>x[n, c] * x[n, c]
            r = <f32>(1.0 / sqrt(acc / C + eps))
            rstd[n] = r
            for c in range(C):
                out[n, c] = (x[n, c] * r) * weight[c]


def rmsnorm_backward(const f32[:, ::1] dout, const f32[:, ::1] x, const f32[::1] weight,
                     const f32[::1] rstd, f32[:, ::1] dx, f32[::1] dweight):
    cdef Py_ssize_t N = x.shape[0], C = x.shape[1], n, c
    cdef double acc
    cdef f32 r, dot
    cdef double* dw = <double*>malloc(C * sizeof(double))
    if dw == NULL:
        raise MemoryError("rmsnorm_backward scratch")
    with nogil:
        memset(dw, 0, C * sizeof(double))
        for n in range(N):
            r = rstd[n]
            for c in range(C):
                dw[c] += <double>(dout[n, c] * (x[n, c] * r))
        for c in range(C):
            dweight[c] = dweight[c] + <f32>dw[c]
        for n in prange(N, schedule="static"):
            r = rstd[n]
            acc = 0.0
            for c in range(C):
                acc = acc + <double>((dout[n, c] * weight[c]) * x[n, c])
            dot = <f32>(acc / C)
            for c in range(C):
                dx[n, c] = dx[n, c] + (r * (dout[n, c] * weight[c]) - x[n, c] * ((r * r * r) * dot))
    free(dw)


def rope_forward(const f32[:, :, :, :] x, const f32[:, ::1] cos, const f32[:, ::1] sin,
                 Py_ssize_t position_offset, f32[:, :, :, :, ::1] out):
    cdef Py_ssize_t B = x.shape[0], T = x.shape[1], NH = x.shape[2], D = x.shape[3]
    cdef Py_ssize_t g = out.shape[3]
    cdef Py_ssize_t half = D // 2, bt, b, t, h, i, p, kv, j
    cdef f32 c, s, x1, x2
    with nogil:
        for bt in prange(B * T, schedule="static"):
            b = bt // T
            t = bt % T
            p = t + position_offset
            for h in range(NH):
                for i in range(half):
                    c = cos[p, i]
                    s = sin[p, i]
                    x1 = x[b, t, h, i]
                    x2 = x[b, t, h, i + half]
                    kv = h // g
                    j = h % g
                    out[b, kv, t, j, i] = x1 * c - x2 * s
                    out[b, kv, t, j, i + half] = x2 * c + x1 * s


def rope_backward(const f32[:, :, :, :, ::1] dout, const f32[:, ::1] cos, const f32[:, ::1] sin,
                  Py_ssize_t position_offset, f32[:, :, :, :] dx):
    cdef Py_ssize_t B = dout.shape[0], KV = dout.shape[1], T = dout.shape[2], g = dout.shape[3]
    cdef Py_ssize_t D = dout.shape[4], NH = KV * g
    cdef Py_ssize_t half = D // 2, bt, b, t, h, i, p, kv, j
    cdef f32 c, s, g1, g2
    with nogil:
        for bt in prange(B * T, schedule="static"):
            b = bt // T
            t = bt % T
            p = t + position_offset
            for h in range(NH):
                for i in range(half):
                    c = cos[p, i]
                    s = sin[p, i]
                    kv = h // g
                    j = h % g
                    g1 = dout[b, kv, t, j, i]
                    g2 = dout[b, kv, t, j, i + half]
                    dx[b, t, h, i] = g1 * c + g2 * s
                    dx[b, t, h, i + half] = g2 * c - g1 * s


def softmax_causal_forward(f32[:, :, ::1] scores, double scale, Py_ssize_t group_size,
                           Py_ssize_t past):
    cdef Py_ssize_t G = scores.shape[0], R = scores.shape[1], S = scores.shape[2]
    cdef Py_ssize_t gr, g, r, j, last
    cdef f32 fscale = <f32>scale, mx, z
    cdef double total
    with nogil:
        for gr in prange(G * R, schedule="static"):
            g = gr // R
            r = gr % R
            last = past + r // group_size  # last visible key
            if last > S - 1:
                last = S - 1
            mx = -INFINITY
            for j in range(last + 1):
                z = scores[g, r, j] * fscale
                if z > mx:
                    mx = z
            total = 0.0
            for j in range(last + 1):
                z = expf(scores[g, r, j] * fscale - mx)
                scores[g, r, j] = z
                total = total + z
            for j in range(last + 1):
                scores[g, r, j] = <f32>(scores[g, r, j] / total)
            for j in range(last + 1, S):
                scores[g, r, j] = 0.0


def softmax_backward(const f32[:, :, ::1] probs, f32[:, :, ::1] dprobs, double scale):
    cdef Py_ssize_t G = probs.shape[0], R = probs.shape[1], S = probs.shape[2]
    cdef Py_ssize_t gr, g, r, j
    cdef f32 fscale = <f32>scale, d
    cdef double dot
    with nogil:
        for gr in prange(G * R, schedule="static"):
            g = gr // R
            r = gr % R
            dot = 0.0
            for j in range(S):
                dot = dot + <double>(probs[g, r, j] * dprobs[g, r, j])
            d = <f32>dot
            for j in range(S):
                dprobs[g, r, j] = probs[g, r, j] * (dprobs[g, r, j] - d) * fscale


def flash_block_forward(f32[:, :, ::1] scores, f32[:, ::1] running_max, f32[:, ::1] running_sum,
                        f32[:, ::1] alpha, double scale, Py_ssize_t group_size,
                        Py_ssize_t past, Py_ssize_t key_start):
    cdef Py_ssize_t G = scores.shape[0], R = scores.shape[1], S = scores.shape[2]
    cdef Py_ssize_t gr, g, r, j, visible
    cdef f32 fscale = <f32>scale, mx, old, z, a, safe
    cdef double total
    with nogil:
        for gr in prange(G * R, schedule="static"):
            g = gr // R
            r = gr % R
            visible = past + r // group_size - key_start + 1  # keys [0, visible) are visible
            if visible > S:
                visible = S
            if visible < 0:
                visible = 0
            old = running_max[g, r]
            mx = old
            for j in range(visible):
                z = scores[g, r, j] * fscale
                if z > mx:
                    mx = z
            if mx == -INFINITY:
                safe = 0.0
                a = 1.0
            else:
                safe = mx
                if old == -INFINITY:
                    a = 0.0
                else:
                    a = expf(old - safe)
            total = 0.0
            for j in range(visible):
                z = expf(scores[g, r, j] * fscale - safe)
                scores[g, r, j] = z
                total = total + z
            for j in range(visible, S):
                scores[g, r, j] = 0.0
            running_sum[g, r] = running_sum[g, r] * a + <f32>total
            running_max[g, r] = mx
            alpha[g, r] = a


def flash_block_backward(f32[:, :, ::1] scores, const f32[:, ::1] logsumexp, f32[:, :, ::1] dprobs,
                         const f32[:, ::1] delta, double scale, Py_ssize_t group_size,
                         Py_ssize_t past, Py_ssize_t key_start):
    cdef Py_ssize_t G = scores.shape[0], R = scores.shape[1], S = scores.shape[2]
    cdef Py_ssize_t gr, g, r, j, visible
    cdef f32 fscale = <f32>scale, p, lse, d
    with nogil:
        for gr in prange(G * R, schedule="static"):
            g = gr // R
            r = gr % R
            visible = past + r // group_size - key_start + 1
            if visible > S:
                visible = S
            if visible < 0:
                visible = 0
            lse = logsumexp[g, r]
            d = delta[g, r]
            for j in range(visible):
                p = expf(scores[g, r, j] * fscale - lse)
                scores[g, r, j] = p
                dprobs[g, r, j] = p * (dprobs[g, r, j] - d) * fscale
            for j in range(visible, S):
                scores[g, r, j] = 0.0
                dprobs[g, r, j] = 0.0


def swiglu_forward(const f32[:, ::1] gate_up, f32[:, ::1] out):
    cdef Py_ssize_t N = out.shape[0], F = out.shape[1], n, i
    cdef f32 g
    with nogil:
        for n in prange(N, schedule="static"):
            for i in range(F):
                g = gate_up[n, i]
                out[n, i] = g / (1.0 + expf(-g)) * gate_up[n, F + i]


def swiglu_backward(const f32[:, ::1] dout, const f32[:, ::1] gate_up, f32[:, ::1] dgate_up):
    cdef Py_ssize_t N = dout.shape[0], F = dout.shape[1], n, i
    cdef f32 g, u, sig, d
    with nogil:
        for n in prange(N, schedule="static"):
            for i in range(F):
                g = gate_up[n, i]
                u = gate_up[n, F + i]
                d = dout[n, i]
                sig = 1.0 / (1.0 + expf(-g))
                dgate_up[n, i] = d * u * sig * (1.0 + g * (1.0 - sig))
                dgate_up[n, F + i] = d * g * sig


def cross_entropy_forward_backward(f32[:, ::1] logits, const int64_t[::1] targets,
                                   f32[::1] losses, double grad_scale, int64_t ignore_index):
    cdef Py_ssize_t N = logits.shape[0], V = logits.shape[1], n, j
    cdef int64_t t
    cdef double mx, total, lse
    cdef f32 fscale = <f32>grad_scale
    with nogil:
        for n in prange(N, schedule="static"):
            t = targets[n]
            if t == ignore_index:
                losses[n] = 0.0
                for j in range(V):
                    logits[n, j] = 0.0
                continue
            mx = logits[n, 0]
            for j in range(1, V):
                if logits[n, j] > mx:
                    mx = logits[n, j]
            total = 0.0
            for j in range(V):
                total = total + exp(logits[n, j] - mx)
            lse = log(total) + mx
            losses[n] = <f32>(lse - logits[n, t])
            for j in range(V):
                logits[n, j] = <f32>exp(logits[n, j] - lse) * fscale
            logits[n, t] = logits[n, t] - fscale


def log_softmax_gather(const f32[:, ::1] logits, const int64_t[::1] targets, f32[::1] out):
    cdef Py_ssize_t N = logits.shape[0], V = logits.shape[1], n, j
    cdef double mx, total
    with nogil:
        for n in prange(N, schedule="static"):
            mx = logits[n, 0]
            for j in range(1, V):
                if logits[n, j] > mx:
                    mx = logits[n, j]
            total = 0.0
            for j in range(V):
                total = total + exp(logits[n, j] - mx)
            out[n] = <f32>(logits[n, targets[n]] - (log(total) + mx))


def embedding_backward(const f32[:, ::1] dout, const int64_t[::1] tokens, f32[:, ::1] dtable):
    cdef Py_ssize_t N = dout.shape[0], C = dout.shape[1], n, c
    cdef int64_t t
    with nogil:
        for n in range(N):
            t = tokens[n]
            for c in range(C):
                dtable[t, c] = dtable[t, c] + dout[n, c]


def adam_update(f32[::1] param, const f32[::1] grad, f32[::1] m, f32[::1] v,
                double learning_rate, double beta1, double beta2, double epsilon,
                double weight_decay, double bias_correction1, double bias_correction2):
    cdef Py_ssize_t n = param.shape[0], i
    cdef f32 b1 = <f32>beta1, b2 = <f32>beta2, omb1 = <f32>(1.0 - beta1), omb2 = <f32>(1.0 - beta2)
    cdef f32 wd = <f32>weight_decay, eps = <f32>epsilon
    cdef f32 step_size = <f32>(learning_rate / bias_correction1)
    cdef f32 bc2_sqrt = <f32>sqrt(bias_correction2)
    cdef f32 g, mi, vi
    cdef bint decay = weight_decay != 0.0
    with nogil:
        for i in prange(n, schedule="static"):
            g = grad[i]
            if decay:
                g = g + wd * param[i]
            mi = m[i] * b1
            mi = mi + omb1 * g
            vi = v[i] * b2
            vi = vi + omb2 * (g * g)
            m[i] = mi
            v[i] = vi
            param[i] = param[i] - step_size * (mi / (sqrtf(vi) / bc2_sqrt + eps))
