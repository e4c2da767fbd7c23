// Bulk copies from global to shared memory (sm_90's copy engine: one thread moves a whole
// contiguous run, no registers in flight) and the shared-memory barriers they complete on,
// with which one producer warp hands filled stages to consumer warps and they hand them back.
// Only for sm_90 and newer; the kernels using them compile to nothing before that and the
// host does not pick them there.

#if __CUDA_ARCH__ >= 900
__device__ __forceinline__ u32 smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }

// A barrier that completes a phase once `count` threads arrived (and the bytes a producer
// announced landed).
__device__ __forceinline__ void barrier_init(u64* bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count)
                 : "memory");
}

// After the barriers' initialisation, before any thread (or the copy engine) uses them.
__device__ __forceinline__ void barrier_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// The producer's arrival: this phase also waits for `bytes` of bulk copies.
__device__ __forceinline__ void barrier_arrive_expect(u64* bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)),
                 "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ void barrier_arrive(u64* bar) {
    asm volatile(
        "{\n"
        ".reg .b64 state;\n"
        "mbarrier.arrive.shared::cta.b64 state, [%0];\n"
        "}" ::"r"(smem_u32(bar))
        : "memory");
}

// Waits until the phase of parity `parity` has completed. A fresh barrier counts its phase
// before the first as completed: waiting on parity 1 returns at once.
__device__ __forceinline__ void barrier_wait(u64* bar, u32 parity) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT;\n"
        "}" ::"r"(smem_u32(bar)),
        "r"(parity)
        : "memory");
}

// `bytes` (a multiple of 16; both addresses 16-byte aligned) from global `src` to shared
// `dst`, counted against `bar`'s announced bytes when they land.
__device__ __forceinline__ void bulk_copy_to_shared(void* dst, const void* src, u32 bytes,
                                                    u64* bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
            smem_u32(dst)),
        "l"(src), "r"(bytes), "r"(smem_u32(bar))
        : "memory");
}

// A barrier of the first `threads` threads of the block only (named barrier 1).
__device__ __forceinline__ void sync_threads_of(u32 threads) {
    asm volatile("bar.sync 1, %0;" ::"r"(threads) : "memory");
}
#endif
