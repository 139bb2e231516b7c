// How fast can one SM stream weights, and by which copy? A research probe, not part of northcode (the product's one
// CUDA file is northcode/csrc/megakernel.cu). Each of N blocks (one per SM: the shared memory allows no second)
// streams its own 8 MB into a shared-memory ring and reads every byte; the table gives GB/s per SM and TB/s in all,
// for N = 1 .. all SMs, by seven ways of copying:
//   ldg        plain 16-B loads into registers, 8 in flight per thread (the read-bandwidth kernels' way)
//   frag       cp.async 16 B per lane in the megakernel's MoE fragment order (rows g, g+8 of two 16-row matrices,
//              K = 2048, the warp's 32-column chunk: 8 pieces of 64 B per warp copy), 6 x 16 KB in flight
//   contig     cp.async 16 B per lane, a warp copy 512 contiguous bytes, 6 x 16 KB in flight
//   rows1k     as frag, but a step reads 16 rows x 1 KB (rows2k: 8 rows x 2 KB) of the tile's 4 KB rows
//   bulk512    cp.async.bulk (the copy engine) on an mbarrier per stage: 32 copies of 512 B a stage (warp 0's
//              lanes), 6 x 16 KB in flight, a block barrier per stage before its refill
//   bulk16k    the same with one 16 KB copy a stage
// Build and run (on the GPU machine):
//     nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -o /tmp/probe lab/probes/sm_stream_probe.cu && /tmp/probe
// The question it answers (lab/notebook.md, day 3 session 4): is the ~25-30 GB/s an SM streams in the
// megakernel a property of per-lane cp.async, so that the copy engine would let fewer SMs carry a phase?
#include <cstdio>
#include <cstdint>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>

constexpr int kThreads = 256, kStages = 6, kStep = 16384;
constexpr size_t kPerBlock = 8u << 20;  // bytes each block streams
constexpr int kSteps = kPerBlock / kStep;

__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(dst)), "l"(src));
}

// Every thread folds its 16 B of each stage into a value the host reads (the copies cannot be elided).
__device__ __forceinline__ unsigned fold(const uint4 v) { return v.x ^ v.y ^ v.z ^ v.w; }

__global__ void __launch_bounds__(kThreads, 1) ldg_kernel(const uint4* src, unsigned* out) {
  const uint4* base = src + (size_t)blockIdx.x * (kPerBlock / 16);
  unsigned acc = 0;
  for (int q = 0; q < kSteps; q += 2) {  // two stages' 16 B pieces per thread: 8 loads in flight
    uint4 v[8];
#pragma unroll
    for (int u = 0; u < 8; ++u)
      v[u] = __ldcs(base + (size_t)(q + u / 4) * (kStep / 16) + (u % 4) * kThreads + threadIdx.x);
#pragma unroll
    for (int u = 0; u < 8; ++u) acc ^= fold(v[u]);
  }
  out[blockIdx.x * kThreads + threadIdx.x] = acc;
}

// frag (pattern 0) and contig (pattern 1): the per-lane ring of the megakernel's default MoE stream; patterns
// 1024, 2048: a step reads 16 KB as 16 rows x 1 KB or 8 rows x 2 KB of the 4 KB rows (a warp copy 512 contiguous
// bytes), between frag's 32 rows x 512 B and contig's 4 whole rows: how long must a row's piece be?
template <int kPattern>
__global__ void __launch_bounds__(kThreads, 1) ldgsts_kernel(const unsigned char* src, unsigned* out) {
  extern __shared__ __align__(128) unsigned char smem[];
  uint4* ring = reinterpret_cast<uint4*>(smem);
  const unsigned char* base = src + (size_t)blockIdx.x * kPerBlock;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  auto issue = [&](int q) {
    if (q < kSteps) {
      uint4* slot = ring + (size_t)(q % kStages) * 4 * kThreads + threadIdx.x;
      if constexpr (kPattern == 0) {  // tile = two 16-row matrices of K = 2048 bf16 (64 KB each); step j: chunk
        // warp + 8j
        const int tile = q / 8, j = q % 8, K = 2048, c = warp + 8 * j;
        const unsigned char* wa = base + (size_t)tile * 131072;
        const unsigned char* wb = wa + 65536;
        const size_t lo = ((size_t)g * K + c * 32 + 8 * t) * 2, hi = lo + (size_t)8 * K * 2;
        cp_async16(slot, wa + lo);
        cp_async16(slot + kThreads, wa + hi);
        cp_async16(slot + 2 * kThreads, wb + lo);
        cp_async16(slot + 3 * kThreads, wb + hi);
      } else if constexpr (kPattern == 1) {
        const unsigned char* s = base + (size_t)q * kStep + threadIdx.x * 16;
#pragma unroll
        for (int r = 0; r < 4; ++r) cp_async16(slot + r * kThreads, s + r * 4096);
      } else {  // tile = 32 rows of 4 KB; step j: rows (j / per) * rows_a_step .., bytes (j % per) * kPattern ..
        constexpr int kRows = kStep / kPattern, kPer = 4096 / kPattern;  // rows a step, steps a row band
        const int tile = q / 8, j = q % 8;
        const unsigned char* band = base + (size_t)tile * 131072 + (size_t)(j / kPer) * kRows * 4096;
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int piece = threadIdx.x + kThreads * r, row = piece / (kPattern / 16), u = piece % (kPattern / 16);
          cp_async16(slot + r * kThreads, band + (size_t)row * 4096 + (j % kPer) * kPattern + u * 16);
        }
      }
    }
    asm volatile("cp.async.commit_group;");
  };
  for (int q = 0; q < kStages; ++q) issue(q);
  unsigned acc = 0;
  for (int q = 0; q < kSteps; ++q) {
    asm volatile("cp.async.wait_group %0;" ::"n"(kStages - 1) : "memory");
    const uint4* slot = ring + (size_t)(q % kStages) * 4 * kThreads + threadIdx.x;
#pragma unroll
    for (int r = 0; r < 4; ++r) acc ^= fold(slot[r * kThreads]);
    issue(q + kStages);
  }
  asm volatile("cp.async.wait_group 0;" ::: "memory");
  out[blockIdx.x * kThreads + threadIdx.x] = acc;
}

// bulk512 (kCopies = 32) and bulk16k (kCopies = 1): the copy engine fills each stage, an mbarrier counts its bytes.
template <int kCopies>
__global__ void __launch_bounds__(kThreads, 1) bulk_kernel(const unsigned char* src, unsigned* out) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ __align__(8) unsigned long long full[kStages];
  const unsigned char* base = src + (size_t)blockIdx.x * kPerBlock;
  if (threadIdx.x < kStages) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(&full[threadIdx.x])));
  }
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  __syncthreads();
  auto issue = [&](int q) {  // warp 0: stage q into slot q % kStages
    if (q >= kSteps || threadIdx.x >= 32) return;
    const unsigned bar = smem_addr(&full[q % kStages]);
    if (threadIdx.x == 0)
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(kStep) : "memory");
    __syncwarp();
    constexpr int kBytes = kStep / kCopies;
    if (threadIdx.x < kCopies) {
      const unsigned dst = smem_addr(smem + (size_t)(q % kStages) * kStep + threadIdx.x * kBytes);
      const unsigned char* s = base + (size_t)q * kStep + threadIdx.x * kBytes;
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                   ::"r"(dst), "l"(s), "r"(kBytes), "r"(bar) : "memory");
    }
  };
  for (int q = 0; q < kStages; ++q) issue(q);
  unsigned acc = 0;
  for (int q = 0; q < kSteps; ++q) {
    const unsigned bar = smem_addr(&full[q % kStages]), parity = (q / kStages) & 1;
    asm volatile(
        "{ .reg .pred done;\n"
        "WAIT_%=: mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT_%=; }" ::"r"(bar), "r"(parity) : "memory");
    const uint4* slot = reinterpret_cast<const uint4*>(smem + (size_t)(q % kStages) * kStep) + threadIdx.x;
#pragma unroll
    for (int r = 0; r < 4; ++r) acc ^= fold(slot[r * kThreads]);
    __syncthreads();  // every thread is done with the slot
    issue(q + kStages);
  }
  out[blockIdx.x * kThreads + threadIdx.x] = acc;
}

static void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(err));
    exit(1);
  }
}

int main() {
  cudaDeviceProp prop;
  check(cudaGetDeviceProperties(&prop, 0), "properties");
  const int sms = prop.multiProcessorCount;
  unsigned char* src;
  unsigned* out;
  check(cudaMalloc(&src, kPerBlock * sms), "malloc");
  check(cudaMalloc(&out, sizeof(unsigned) * kThreads * sms), "malloc");
  check(cudaMemset(src, 1, kPerBlock * sms), "memset");
  const int smem = 120 * 1024;  // one block per SM whatever the kernel
  struct Way { const char* name; const void* fn; };
  const Way ways[] = {{"ldg", (const void*)ldg_kernel}, {"frag", (const void*)ldgsts_kernel<0>},
                      {"contig", (const void*)ldgsts_kernel<1>}, {"rows1k", (const void*)ldgsts_kernel<1024>},
                      {"rows2k", (const void*)ldgsts_kernel<2048>}, {"bulk512", (const void*)bulk_kernel<32>},
                      {"bulk16k", (const void*)bulk_kernel<1>}};
  for (const Way& w : ways)
    check(cudaFuncSetAttribute(w.fn, cudaFuncAttributeMaxDynamicSharedMemorySize, smem), w.name);
  const int counts[] = {1, 4, 16, 33, 66, 99, sms};
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  printf("%-9s%6s%14s%10s\n", "way", "SMs", "GB/s per SM", "TB/s");
  for (const Way& w : ways) {
    for (int n : counts) {
      std::vector<float> ms;
      for (int rep = 0; rep < 7; ++rep) {
        void* args[] = {(void*)&src, (void*)&out};
        cudaEventRecord(a);
        check(cudaLaunchKernel(w.fn, dim3(n), dim3(kThreads), args, smem, 0), w.name);
        cudaEventRecord(b);
        check(cudaEventSynchronize(b), w.name);
        float t;
        cudaEventElapsedTime(&t, a, b);
        ms.push_back(t);
      }
      std::sort(ms.begin(), ms.end());
      const double per_sm = kPerBlock / (ms[3] * 1e-3) / 1e9;
      printf("%-9s%6d%14.1f%10.2f\n", w.name, n, per_sm, per_sm * n / 1e3);
    }
  }
  return 0;
}
