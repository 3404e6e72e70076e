// Attention on the GPU: the KDA delta-rule recurrence and absorbed NoPE MLA over the latent cache.

// KDA recurrence, one block per head, the head's state S [D_k, D_v] in shared memory. Per token:
//   S <- diag(exp g) S;  u = S^T k;  delta = beta (v - u);  S <- S + k delta^T;  o = S^T q.
// Thread (j, p) owns column j (a value index) for the key rows k = p, p + P, ...; the sums over k are reduced
// across the P parts through shared memory. q, k are already L2-normalised (q scaled), g is the log decay.
// state: [H, D, D] (in/out); q, k, v, g: [T, H*D]; beta: [T, H]; out: [T, H*D].
#define KDA_PARTS 4
extern "C" __global__ void kda_recurrent(float* state, const float* q, const float* k, const float* v,
                                         const float* g, const float* beta, float* out, int n_tok, int heads,
                                         int d) {
    extern __shared__ float sm[];
    float* s = sm;                    // [d, d]
    float* kv = s + d * d;            // k [d]
    float* qv = kv + d;               // q [d]
    float* dec = qv + d;              // exp(g) [d]
    float* red = dec + d;             // [KDA_PARTS, d] partial sums
    int h = blockIdx.x;
    int j = threadIdx.x;              // value index
    int p = threadIdx.y;              // key part
    int tid = p * blockDim.x + j;
    int nthreads = blockDim.x * blockDim.y;
    float* sh = state + (size_t)h * d * d;
    for (int i = tid; i < d * d; i += nthreads) s[i] = sh[i];
    int c = heads * d;
    for (int t = 0; t < n_tok; t++) {
        size_t off = (size_t)t * c + (size_t)h * d;
        __syncthreads();
        for (int i = tid; i < d; i += nthreads) {
            kv[i] = k[off + i];
            qv[i] = q[off + i];
            dec[i] = expf(g[off + i]);
        }
        __syncthreads();
        float u = 0.f;
        if (j < d) {
            for (int kk = p; kk < d; kk += KDA_PARTS) {
                float x = s[kk * d + j] * dec[kk];
                s[kk * d + j] = x;
                u += x * kv[kk];
            }
            red[p * d + j] = u;
        }
        __syncthreads();
        float b = beta[(size_t)t * heads + h];
        float o = 0.f;
        if (j < d) {
            float uu = 0.f;
            for (int i = 0; i < KDA_PARTS; i++) uu += red[i * d + j];
            float delta = b * (v[off + j] - uu);
            for (int kk = p; kk < d; kk += KDA_PARTS) {
                float x = s[kk * d + j] + kv[kk] * delta;
                s[kk * d + j] = x;
                o += x * qv[kk];
            }
        }
        __syncthreads();
        if (j < d) red[p * d + j] = o;
        __syncthreads();
        if (j < d && p == 0) {
            float oo = 0.f;
            for (int i = 0; i < KDA_PARTS; i++) oo += red[i * d + j];
            out[off + j] = oo;
        }
    }
    __syncthreads();
    for (int i = tid; i < d * d; i += nthreads) sh[i] = s[i];
}

// Absorbed MLA for one (head, query token) per block:
//   q_abs = W_UK,h^T q_nope;  score_s = (q_abs . c_s + q_pe . kpe_s) * scale for s < past + t + 1;
//   p = softmax(score);  ctx = sum_s p_s c_s;  out = W_UV,h ctx.
// q: [T, H, nope + rope]; cache: [N, kvl + rope] (c normalised, k_pe raw), rows past.. are this call's tokens;
// w_uk_t: [H, kvl, nope]; w_uv: [H, vd, kvl]; scores: scratch [H, T, N]; out: [T, H, vd].
#define MLA_THREADS 256
extern "C" __global__ void __launch_bounds__(MLA_THREADS)
    mla_attend(const float* q, const float* cache, const float* w_uk_t, const float* w_uv, float* scores,
               float* out, int n_tok, int past, int n_cache, int heads, int nope, int rope, int kvl, int vd,
               float scale) {
    extern __shared__ float sm[];
    int h = blockIdx.x, t = blockIdx.y;
    int qk = nope + rope, row = kvl + rope;
    float* q_abs = sm;           // [kvl]
    float* qh = q_abs + kvl;     // [qk]
    float* ctx = qh + qk;        // [kvl]
    float* red = ctx + kvl;      // [MLA_THREADS / WARP]
    int warp = threadIdx.x / WARP, lane = threadIdx.x & (WARP - 1);
    int nwarps = blockDim.x / WARP;
    const float* qsrc = q + ((size_t)t * heads + h) * qk;
    for (int i = threadIdx.x; i < qk; i += blockDim.x) qh[i] = qsrc[i];
    __syncthreads();
    const float* uk = w_uk_t + (size_t)h * kvl * nope;
    for (int l = threadIdx.x; l < kvl; l += blockDim.x) {
        float a = 0.f;
        for (int n = 0; n < nope; n++) a += uk[(size_t)l * nope + n] * qh[n];
        q_abs[l] = a;
    }
    __syncthreads();
    int visible = past + t + 1;
    float* sc = scores + ((size_t)h * n_tok + t) * n_cache;
    // One warp per cached row.
    for (int s = warp; s < visible; s += nwarps) {
        const float* r = cache + (size_t)s * row;
        float a = 0.f;
        for (int l = lane; l < kvl; l += WARP) a += q_abs[l] * r[l];
        float b = 0.f;
        for (int l = lane; l < rope; l += WARP) b += qh[nope + l] * r[kvl + l];
        a = warp_sum(a);
        b = warp_sum(b);
        if (lane == 0) sc[s] = (a + b) * scale;
    }
    __syncthreads();
    // max
    float m = NEG_INF;
    for (int s = threadIdx.x; s < visible; s += blockDim.x) m = fmaxf(m, sc[s]);
    m = warp_max(m);
    if (lane == 0) red[warp] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
        float mm = red[0];
        for (int i = 1; i < nwarps; i++) mm = fmaxf(mm, red[i]);
        red[0] = mm;
    }
    __syncthreads();
    m = red[0];
    __syncthreads();
    float total = 0.f;
    for (int s = threadIdx.x; s < visible; s += blockDim.x) {
        float e = expf(sc[s] - m);
        sc[s] = e;
        total += e;
    }
    total = warp_sum(total);
    if (lane == 0) red[warp] = total;
    __syncthreads();
    if (threadIdx.x == 0) {
        float tt = 0.f;
        for (int i = 0; i < nwarps; i++) tt += red[i];
        red[0] = tt;
    }
    __syncthreads();
    total = red[0];
    for (int l = threadIdx.x; l < kvl; l += blockDim.x) {
        float a = 0.f;
        for (int s = 0; s < visible; s++) a += (sc[s] / total) * cache[(size_t)s * row + l];
        ctx[l] = a;
    }
    __syncthreads();
    const float* uv = w_uv + (size_t)h * vd * kvl;
    float* dst = out + ((size_t)t * heads + h) * vd;
    for (int i = warp; i < vd; i += nwarps) {
        float a = 0.f;
        for (int l = lane; l < kvl; l += WARP) a += uv[(size_t)i * kvl + l] * ctx[l];
        a = warp_sum(a);
        if (lane == 0) dst[i] = a;
    }
}
