// deltafin CUDA kernels: shared definitions. Compiled at run time by NVRTC: the Rust side concatenates this file
// with the other kernels/*.cu sources (no #include), so everything here is plain CUDA C++ without the toolkit's
// headers.
//
// Numbers: every kernel accumulates in f32 and never uses fast-math intrinsics, so results differ from the CPU's
// fixed-order kernels only in summation order.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define WARP 32
#define FULL_MASK 0xffffffffu
#define NEG_INF __int_as_float(0xff800000)

// Sum over the 32 lanes of a warp; every lane gets the result.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

// Max over the 32 lanes of a warp; every lane gets the result.
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

__device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }

// The gated activation of every MLP in the family, exactly as the CPU's `ops::glu`:
// kind 0 = SiTU: (beta tanh(g / beta) sigma(g)) (lin_beta tanh(u / lin_beta)); kind 1 = SiLU(g) u.
// Kinds 2 and 3 return g or u unchanged: the tests use them to check each MXFP4 product on its own.
__device__ __forceinline__ float glu(int kind, float beta, float lin_beta, float g, float u) {
    if (kind == 0) {
        float a = beta * tanhf(g / beta) * sigmoidf_(g);
        float b = lin_beta * tanhf(u / lin_beta);
        return a * b;
    }
    if (kind == 1) return g * sigmoidf_(g) * u;
    if (kind == 2) return g;
    return u;
}

// Shared-memory address of a generic pointer into shared memory.
__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 r;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
    return r;
}

// Asynchronous copies global -> shared (sm_80 and later), waited for by cp_async_wait / cp_async_wait_all in the
// issuing thread; a barrier after the wait makes them visible to the block.
//
// 16 bytes, bypassing L1 (with HINT an L2 miss fetches the surrounding 256 bytes); `bytes` = 0 writes zeros and
// reads nothing.
template <bool HINT>
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, u32 bytes) {
    if (HINT)
        asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes));
    else
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes));
}

// Asynchronous 4-byte copy global -> shared; `bytes` = 0 writes zeros.
__device__ __forceinline__ void cp_async4(u32 dst, const void* src, u32 bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(bytes));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N));
}

__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;"); }
