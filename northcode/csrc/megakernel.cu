// ====  0. Header  ==============================================================================
//   The northcode decode megakernel: one persistent launch runs a whole decode step of a
//   cohere2_moe model (North Mini Code) for a batch of 1..NC_MAX_BATCH rows, each row a
//   (sequence, position) pair. One block of 256 threads per SM walks its own host-built task
//   list (northcode/megakernel/tasks.py builds it in dependency waves); every cross-SM
//   dependency is a uint32 counter in global memory with a target baked into the waiting task.
//   Counters are zeroed by one memset before each launch. Producers: __syncthreads, then thread
//   0 fences and adds; consumers: thread 0 spins (acquire) and the block syncs. A task only waits
//   on tasks of strictly earlier waves, so the lists cannot deadlock.
//   Matrix products: mma.sync m16n8k16 (bf16 in, fp32 accumulate), the weight is the 16-row A
//   operand, the batch rows are the 8 columns of B. Two ways to feed them: register loads behind an L2
//   prefetch (QKV, dense, LM head), or a per-lane cp.async ring in shared memory (the routed experts,
//   streamed across tile boundaries: section 11; o_proj; the router, whose tile is copied whole before
//   its wait); attention pages stream through a ring too, filled before q is ready. The experts a
//   step needs are known on the device only (TOPK).
//   Geometry is compile-time (-DNC_HIDDEN=... from megakernel.py): every per-layer shape; the depth
//   is not (the task lists carry the layers), so one build serves a model and its shallow test copies.
//   Target sm_90a; no PyTorch headers. ABI: nc_* functions below; one Params struct by pointer;
//   NC_ABI_VERSION. Token masks come late: a constrained row's SAMPLE waits for the host to release its
//   MaskSlot in mapped host memory (section 14), so the host computes the mask while the step runs; a dormant
//   grammar's rule (text tokens and its trigger) reads one static text mask in device memory instead.
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#define NC_ABI_VERSION 9

#if !defined(NC_HIDDEN) || !defined(NC_HEADS) || !defined(NC_KV_HEADS) || \
    !defined(NC_HEAD_DIM) || !defined(NC_VOCAB) || !defined(NC_EXPERTS) || !defined(NC_TOPK) ||   \
    !defined(NC_EXPERT_WIDTH) || !defined(NC_DENSE_WIDTH)
#error "geometry: build through northcode/megakernel/kernel.py, which passes -DNC_HIDDEN=... etc."
#endif
#ifndef NC_MAX_BATCH
#define NC_MAX_BATCH 8
#endif
#ifndef NC_RMS_NORM
#define NC_RMS_NORM 1  // 0: mean-centred LayerNorm without bias
#endif
#ifndef NC_SELECT_SIGMOID
#define NC_SELECT_SIGMOID 1  // 0: softmax over the selected logits
#endif
#ifndef NC_NORM_TOPK
#define NC_NORM_TOPK 0
#endif
#ifndef NC_MAX_SPLITS
#define NC_MAX_SPLITS 32
#endif

// ====  1. Constants and TaskType  ==============================================================
typedef __nv_bfloat16 bf16;

constexpr int kHidden = NC_HIDDEN;            // H
constexpr int kHeads = NC_HEADS;              // query heads
constexpr int kKvHeads = NC_KV_HEADS;
constexpr int kHeadDim = NC_HEAD_DIM;         // D
constexpr int kVocab = NC_VOCAB;
constexpr int kExperts = NC_EXPERTS;          // E
constexpr int kTopK = NC_TOPK;
constexpr int kExpertWidth = NC_EXPERT_WIDTH;  // I (per routed expert)
constexpr int kDenseWidth = NC_DENSE_WIDTH;    // dense-layer MLP width
constexpr int kMaxBatch = NC_MAX_BATCH;
constexpr int kMaxSplits = NC_MAX_SPLITS;
constexpr int kGroup = kHeads / kKvHeads;      // query heads per KV head
constexpr int kQSize = kHeads * kHeadDim;
constexpr int kKvSize = kKvHeads * kHeadDim;
constexpr int kPage = 64;                      // tokens per KV block (docs/architecture.md)
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaskWords = (kVocab + 127) / 128 * 4;  // a token mask: ceil(V / 32) words, padded to uint4s

static_assert(kMaxBatch == 8, "the batch is the n8 operand of mma.m16n8k16");
static_assert(kHidden % 32 == 0 && kQSize % 32 == 0 && kExpertWidth % 32 == 0 && kDenseWidth % 32 == 0,
              "every reduction dimension must be a multiple of 32 (one mma k-chunk pair)");
static_assert(kHeadDim % 16 == 0 && kHeadDim % 8 == 0, "head_dim must be a multiple of 16");
static_assert(kExpertWidth % 32 == 0 && kDenseWidth % 16 == 0 && kHidden % 64 == 0, "MoE tiles: 16 channels, 32 rows");
static_assert(kHeads % kKvHeads == 0, "GQA group");
static_assert(kExperts <= 256 && kTopK <= 32, "router sizes");

// Mirrors TaskType in northcode/megakernel/tasks.py.
enum TaskType : int {
  TASK_STOP = 0,
  TASK_NORM = 1,        // arg0 row, arg1 1: final norm: (embed on layer 0) residual round, norm -> h
  TASK_QKV = 2,         // arg0 first 16-row tile, arg1 tiles, arg2 rope: q, and K/V into the pages
  TASK_ATTN = 3,        // arg0 row, arg1 kv head, arg2 split, arg3 splits, arg4 window (0 none)
  TASK_COMBINE = 4,     // arg0 row, arg1 kv head, arg2 splits -> attn_out
  TASK_OPROJ = 5,       // arg0 first tile, arg1 tiles: x += o_proj(attn_out)
  TASK_ROUTER = 6,      // arg0 tile: router logits
  TASK_TOPK = 7,        // all rows: selection, expert slots, slot weights
  TASK_MOE_UP = 8,      // one per SM: arg0 last blocks without up tiles, arg1 first "slot done" counter, arg2 claims
  TASK_MOE_DOWN = 9,    // one per SM: arg1 first "slot done" counter (its tiles: a contiguous range)
  TASK_DENSE_UP = 10,   // arg0 first tile, arg1 tiles: silu(gate) * up
  TASK_DENSE_DOWN = 11, // arg0 first 32-row tile, arg1 tiles: x += down(act)
  TASK_LM_HEAD = 12,    // arg0 first 32-row tile, arg1 tiles, arg2 task index: logits + partial argmaxes
  TASK_SAMPLE = 13,     // arg0 row, arg1 LM-head task count: next token
  NUM_TASK_TYPES = 14,
};

// Status codes written to Params.status[0] (megakernel.py turns them into messages).
enum StatusCode : int { NC_OK = 0, NC_ERR_TIMEOUT = 1, NC_ERR_BAD_TASK = 2, NC_ERR_BAD_PAGE = 3, NC_ERR_BAD_TOKEN = 4,
                        NC_ERR_MASK_TIMEOUT = 5 };

// ====  2. ABI structs  =========================================================================
struct Task {  // 16 int32, built by megakernel.py
  int type, layer;
  int arg[6];
  int wait[2];    // counter indices, -1: none
  int target[2];  // wait until counter >= target
  int signal;     // counter to add 1 to when done, -1: none
  int pad[3];
};
static_assert(sizeof(Task) == 64, "Task is 16 int32");

// A constrained row's token mask, in pinned host memory the device reads directly (megakernel.py MaskSlots). The
// host may write it while the step runs: words, trigger and dormant first, then, after a store fence, ready = the
// row's mask_seq (nc_release_mask). SAMPLE waits for that before it reads the rest (section 14). Where the words
// do not apply, a row with a dormant rule (a grammar that bans markers until its trigger) may sample a text
// token (Params.text_mask) or its trigger only.
constexpr int kNoMask = -2;  // a trigger: the words never apply this step (a dormant grammar, a failed host)
struct MaskSlot {
  unsigned ready;              // the sequence number of the step whose mask this is
  int trigger;                 // -1: the words apply; >= 0: only if the row fed this token; kNoMask: they do not
  int dormant;                 // -1: where the words do not apply the row is unconstrained; >= 0: the trigger a
                               // dormant rule allows besides Params.text_mask
  unsigned pad;
  unsigned words[kMaskWords];  // bit v % 32 of word v / 32: token v allowed
};
static_assert(offsetof(MaskSlot, dormant) == 8 && offsetof(MaskSlot, words) == 16, "MaskSlot layout");

struct RowState {  // one batch row, uploaded by the host each step
  int position;        // position of this row's token (= tokens already cached for its sequence)
  int seq;             // block-table row of its sequence
  int step;            // draw counter of the request (seeds the noise)
  int top_k;           // 0: off
  unsigned long long seed;
  float temperature;   // <= 0: greedy
  float top_p;         // 1: off
  float min_p;         // 0: off
  int mask_seq;        // the value mask->ready takes once this step's mask is written; -1 without a slot
  const MaskSlot* mask; // null: unconstrained; else the row's slot in mapped host memory
};
static_assert(sizeof(RowState) == 48, "RowState layout");

enum LayerPtr { LP_NORM = 0, LP_Q, LP_K, LP_V, LP_O, LP_ROUTER, LP_EXPERT_GATE_UP, LP_EXPERT_DOWN,
                LP_GATE, LP_UP, LP_DOWN, NUM_LAYER_PTRS };

struct Params {
  // weights (bf16, canonical layouts of docs/architecture.md)
  const unsigned long long* layer_ptrs;  // [layers][NUM_LAYER_PTRS] device addresses, 0 where unused
  const bf16* embed;                     // [V, H]
  const bf16* final_norm;                // [H]
  const bf16* lm_head;                   // [V, H]
  const float* inv_freq;                 // [D/2] RoPE inverse frequencies (fp32, as the reference)
  // paged KV cache
  bf16* k_pool;                          // [num_pages, 64, KVH, D]
  bf16* v_pool;
  const int* block_tables;               // [layers, max_seqs, max_pages_per_seq], -1 unmapped
  long long num_pages;
  int max_seqs;
  int max_pages_per_seq;
  // the task lists
  const Task* tasks;                     // all SMs' lists, back to back
  const int* task_start;                 // [num_blocks + 1] offsets into tasks
  int num_blocks;                        // grid size (<= SMs: all resident)
  int batch_size;                        // rows in use (<= NC_MAX_BATCH)
  unsigned int* counters;                // [num_counters], zeroed before each launch
  int num_counters;
  const RowState* rows;                  // [NC_MAX_BATCH]
  int* tokens;                           // [NC_MAX_BATCH] in: this step's tokens; out: sampled tokens
  int* status;                           // [4] code, detail, detail, 0
  const unsigned* text_mask;             // [kMaskWords] the text tokens (every dormant rule's), device; null: none yet
  // scratch (device buffers owned by megakernel.py)
  float* x;                              // [8, H] residual stream (fp32, rounded to bf16 per layer)
  bf16* h;                               // [8, H] normed input of the current layer
  bf16* q;                               // [8, Hq*D] queries after RoPE
  float* attn_partial;                   // [8, KVH, MAX_SPLITS, G*D] unnormalised outputs
  float* attn_ml;                        // [8, KVH, MAX_SPLITS, G, 2] running max, sum
  bf16* attn_out;                        // [8, Hq*D]
  float* router_logits;                  // [8, E]
  int* moe_slots;                        // [1 + E]: number of distinct experts, then expert of each slot
  float* slot_weight;                    // [E, 8] routing weight of (slot, row), 0 if not routed
  bf16* moe_act;                         // [E, 8, I] silu(gate) * up per slot
  bf16* dense_act;                       // [8, I_dense]
  float* logits;                         // [8, V] fp32 after logit_scale
  float* noisy;                          // [8, V] logit / T + Gumbel of the rows with a mask slot (sampled, unfiltered)
  float* lm_partial;                     // [lm tasks, 8, 4]: greedy max, idx, gumbel max, idx
  int* expert_counts;                    // [layers] distinct experts routed this step (for byte counts)
  int* routed;                           // [layers, 8, top_k] experts each row chose (tests check them)
  long long* profile;                    // null, or [num_tasks, 3] ns: task start, dependencies met, done
  float norm_eps;
  float logit_scale;
  long long timeout_ns;                  // a wait longer than this aborts the step (status TIMEOUT)
  // whole-step checks (null: off): what each NORM reads, what each ROUTER computes
  float* trace_x;                        // [layers + 1, 8, H] the bf16-rounded residual layer l reads (l = layers: final norm)
  float* trace_router;                   // [layers, 8, E] router logits (bf16-rounded, as router_logits)
};

// ====  3. Device helpers  ======================================================================
__device__ __forceinline__ float bf16_round(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }
__device__ __forceinline__ float to_f(bf16 v) { return __bfloat162float(v); }

__device__ __forceinline__ uint4 load_weight16(const void* ptr) {  // immutable: skip L1
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(ptr));
  return r;
}
__device__ __forceinline__ uint4 load_act16(const void* ptr) {  // written in this launch: L2 only
  return __ldcg(reinterpret_cast<const uint4*>(ptr));
}
__device__ __forceinline__ void prefetch_l2(const void* ptr) {
  asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(ptr));
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src));
}
// Copies of data read once a step (the MoE experts, the KV pages): the lines leave L2 first, so that what the L2
// prefetch brought in (evict_last) survives the ~75 MB of experts a layer streams past it (1.6-1.9% of the step
// for the experts, 0.7-0.8% more for the KV pages).
__device__ __forceinline__ void cp_async16_evict_first(void* dst, const void* src) {
  const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("{ .reg .b64 policy;\n"
               "  createpolicy.fractional.L2::evict_first.b64 policy, 1.0;\n"
               "  cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, policy; }" ::"r"(d), "l"(src));
}

__device__ __forceinline__ long long global_ns() {
  long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ unsigned load_acquire(const unsigned* ptr) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(ptr) : "memory");
  return v;
}
// Loads of mapped host memory the host writes during the step: at system scope, so that no cache line of an
// earlier step's value is taken (L2 may hold system-memory lines).
__device__ __forceinline__ unsigned load_acquire_sys(const unsigned* ptr) {
  unsigned v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(ptr) : "memory");
  return v;
}
__device__ __forceinline__ uint4 load_relaxed_sys16(const void* ptr) {
  uint4 r;
  asm volatile("ld.relaxed.sys.global.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(ptr) : "memory");
  return r;
}

__device__ void report(const Params& p, int code, int a, int b) {
  if (atomicCAS(p.status, 0, code) == 0) {
    p.status[1] = a;
    p.status[2] = b;
  }
}

// Thread 0 spins until counters[idx] >= target (or the step aborted); the block then syncs.
__device__ void wait_counter(const Params& p, int idx, int target) {
  if (threadIdx.x == 0 && idx >= 0) {
    const long long start = global_ns();
    while (load_acquire(p.counters + idx) < (unsigned)target) {
      if (*(volatile int*)p.status != 0) break;
      if (global_ns() - start > p.timeout_ns) { report(p, NC_ERR_TIMEOUT, idx, target); break; }
      __nanosleep(64);
    }
  }
  __syncthreads();
}

// After the block's outputs are written: make them visible GPU-wide, then count one.
__device__ void signal_counter(const Params& p, int idx) {
  __syncthreads();
  if (threadIdx.x == 0 && idx >= 0) {
    __threadfence();
    atomicAdd(p.counters + idx, 1u);
  }
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// Block-wide sum; `scratch` holds kWarps floats. All threads get the result.
__device__ float block_sum(float v, float* scratch) {
  v = warp_sum(v);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < kWarps; ++w) total += scratch[w];
  return total;
}
__device__ float block_max(float v, float* scratch) {
  v = warp_max(v);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  float m = -INFINITY;
  for (int w = 0; w < kWarps; ++w) m = fmaxf(m, scratch[w]);
  return m;
}

// (value, index) argmax; ties go to the lower index, as torch.argmax.
struct ArgMax { float value; int index; };
__device__ __forceinline__ ArgMax better(ArgMax a, ArgMax b) {
  if (b.value > a.value || (b.value == a.value && b.index < a.index)) return b;
  return a;
}
__device__ ArgMax warp_argmax(ArgMax a) {
  for (int o = 16; o; o >>= 1) {
    ArgMax other{__shfl_xor_sync(0xffffffffu, a.value, o), __shfl_xor_sync(0xffffffffu, a.index, o)};
    a = better(a, other);
  }
  return a;
}
__device__ ArgMax block_argmax(ArgMax a, ArgMax* scratch) {
  a = warp_argmax(a);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = a;
  __syncthreads();
  ArgMax best = scratch[0];
  for (int w = 1; w < kWarps; ++w) best = better(best, scratch[w]);
  return best;
}

// Counter-based noise: uniform in (0, 1) from (seed, draw counter, token id).
__device__ __forceinline__ unsigned long long mix64(unsigned long long z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
__device__ __forceinline__ float gumbel_noise(unsigned long long seed, int step, int token) {
  unsigned long long r = mix64(seed ^ mix64(((unsigned long long)(unsigned)step << 32) | (unsigned)token));
  float u = ((float)(r >> 40) + 0.5f) * (1.0f / 16777216.0f);  // 24 bits, never 0 or 1
  return -logf(-logf(u));
}

// ---- the tensor-core product: out[n][r][b] = sum_k W_n[r][k] * act[b][k] for NT 16-row tiles ----
// Each warp takes every 8th 32-wide k-chunk; a lane loads 16 contiguous bytes of weight rows g and
// g+8 and of activation row g (g = lane/4) and uses them for two mma k16 steps. The k order inside a
// chunk is permuted identically for A and B, which a dot product does not notice. Partial sums of
// the 8 warps are reduced through shared memory into out (fp32 [NT][16][8]).
// Sums the 8 warps' fragments of NT 16x8 tiles into out (fp32 [NT][16][8]), in warp order.
template <int NT>
__device__ __forceinline__ void reduce_warps(const float (&acc)[NT][4], float* red, float* out) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  __syncthreads();  // the previous tile's epilogue has read `out`
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    float* r = red + (warp * NT + n) * 128;  // [16][8]
    r[g * 8 + 2 * t] = acc[n][0];
    r[g * 8 + 2 * t + 1] = acc[n][1];
    r[(g + 8) * 8 + 2 * t] = acc[n][2];
    r[(g + 8) * 8 + 2 * t + 1] = acc[n][3];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < NT * 128; i += kThreads) {
    const int n = i >> 7, e = i & 127;
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) s += red[(w * NT + n) * 128 + e];
    out[i] = s;
  }
  __syncthreads();
}

// One k16 pair of mma steps on a 16-byte piece of weight rows g, g+8 (wa, wb) and of activation row g (xa).
__device__ __forceinline__ void mma_piece(float (&acc)[4], const uint4& wa, const uint4& wb, const uint4& xa) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
      : "r"(wa.x), "r"(wb.x), "r"(wa.y), "r"(wb.y), "r"(xa.x), "r"(xa.y));
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
      : "r"(wa.z), "r"(wb.z), "r"(wa.w), "r"(wb.w), "r"(xa.z), "r"(xa.w));
}

template <int NT>
__device__ void mma_tiles(const bf16* const (&w_tile)[NT], const int (&valid_rows)[NT], int K,
                          const bf16* act, int act_stride, int batch, float* red, float* out) {
  // k-chunks in flight per lane (8 for one-tile products, one round trip for K = 2048 instead of two, spilled
  // 220 bytes at 255 registers)
  constexpr int U = 4;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int nchunk = K / 32;
  const bf16* w_lo[NT];
  const bf16* w_hi[NT];
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    const int r_lo = min(g, valid_rows[n] - 1), r_hi = min(g + 8, valid_rows[n] - 1);
    w_lo[n] = w_tile[n] + (size_t)r_lo * K + 8 * t;
    w_hi[n] = w_tile[n] + (size_t)r_hi * K + 8 * t;
  }
  const bool has_row = g < batch;
  const bf16* a_row = act + (size_t)g * act_stride + 8 * t;
  float acc[NT][4];
#pragma unroll
  for (int n = 0; n < NT; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;

  for (int c0 = warp; c0 < nchunk; c0 += kWarps * U) {
    uint4 wa[NT][U], wb[NT][U], xa[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + kWarps * u;
      if (c < nchunk) {
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          wa[n][u] = load_weight16(w_lo[n] + c * 32);
          wb[n][u] = load_weight16(w_hi[n] + c * 32);
        }
        xa[u] = has_row ? load_act16(a_row + c * 32) : make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (c0 + kWarps * u < nchunk) {
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          asm volatile(
              "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
              "{%0,%1,%2,%3};"
              : "+f"(acc[n][0]), "+f"(acc[n][1]), "+f"(acc[n][2]), "+f"(acc[n][3])
              : "r"(wa[n][u].x), "r"(wb[n][u].x), "r"(wa[n][u].y), "r"(wb[n][u].y), "r"(xa[u].x), "r"(xa[u].y));
          asm volatile(
              "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
              "{%0,%1,%2,%3};"
              : "+f"(acc[n][0]), "+f"(acc[n][1]), "+f"(acc[n][2]), "+f"(acc[n][3])
              : "r"(wa[n][u].z), "r"(wb[n][u].z), "r"(wa[n][u].w), "r"(wb[n][u].w), "r"(xa[u].z), "r"(xa[u].w));
        }
      }
    }
  }
  reduce_warps<NT>(acc, red, out);
}

// Shared-memory regions of the product (both fit any task's layout: they are used alone).
struct GemmSmem {
  float red[kWarps * 2 * 128];
  float out[2 * 128];
  ArgMax best[128];
};
// The per-lane rings' shared memory follows GemmSmem: the MoE ring's kMoeStages steps of 16 KB (section 11); the
// o_proj ring (8) and the router tile (9) use the same memory. 4 steps tie with 5 and beat 6 by 1% at B = 1; at 8
// the step was 6% slower (o_proj beside the stream).
constexpr size_t kRingOffset = (sizeof(GemmSmem) + 15) / 16 * 16;
constexpr int kMoeStages = 4;
constexpr size_t kRingBytes = (size_t)kMoeStages * 4 * kThreads * 16;  // 64 KB

__device__ __forceinline__ const bf16* layer_ptr(const Params& p, int layer, int which) {
  return reinterpret_cast<const bf16*>(p.layer_ptrs[layer * NUM_LAYER_PTRS + which]);
}

// ====  4. Task: NORM  ==========================================================================
//   One row: on layer 0 the residual is the embedding of tokens[row]; on later layers it is rounded
//   to bf16 (the reference keeps the residual in bf16). h = norm(x) * weight in bf16. arg1 != 0: the
//   final norm (t.layer = the number of layers). Inputs: x [8, H] (fp32). Outputs: x, h [8, H], and
//   the rounded residual into trace_x[t.layer] when tracing.
__device__ void task_norm(const Params& p, const Task& t, unsigned char* smem) {
  constexpr int kPer = (kHidden + kThreads - 1) / kThreads;
  float* scratch = reinterpret_cast<float*>(smem);
  const int row = t.arg[0], layer = t.layer;
  const bool final_norm = t.arg[1] != 0, embed = layer == 0 && !final_norm;
  float* xr = p.x + (size_t)row * kHidden;
  float* trace = p.trace_x ? p.trace_x + ((size_t)layer * kMaxBatch + row) * kHidden : nullptr;
  const bf16* weight = final_norm ? p.final_norm : layer_ptr(p, layer, LP_NORM);
  int token = 0;
  if (embed) {
    token = __ldcg(p.tokens + row);
    if (token < 0 || token >= kVocab) {
      if (threadIdx.x == 0) report(p, NC_ERR_BAD_TOKEN, row, token);
      token = 0;
    }
  }
  float v[kPer], w[kPer];
  float sum = 0.f;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {  // the weight's loads go out with x's (after the sum they cost a round trip)
    const int i = threadIdx.x + j * kThreads;
    w[j] = i < kHidden ? to_f(weight[i]) : 0.f;
  }
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int i = threadIdx.x + j * kThreads;
    v[j] = 0.f;
    if (i < kHidden) {
      v[j] = embed ? to_f(p.embed[(size_t)token * kHidden + i]) : bf16_round(__ldcg(xr + i));
      xr[i] = v[j];
      if (trace) trace[i] = v[j];
      sum += v[j];
    }
  }
#if NC_RMS_NORM
  float sq = 0.f;
#pragma unroll
  for (int j = 0; j < kPer; ++j) sq += v[j] * v[j];
  const float inv = 1.0f / sqrtf(block_sum(sq, scratch) / kHidden + p.norm_eps);
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int i = threadIdx.x + j * kThreads;
    if (i < kHidden) p.h[(size_t)row * kHidden + i] = __float2bfloat16_rn(w[j] * bf16_round(v[j] * inv));
  }
#else
  const float mean = block_sum(sum, scratch) / kHidden;
  float sq = 0.f;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int i = threadIdx.x + j * kThreads;
    if (i < kHidden) sq += (v[j] - mean) * (v[j] - mean);
  }
  const float inv = 1.0f / sqrtf(block_sum(sq, scratch) / kHidden + p.norm_eps);
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int i = threadIdx.x + j * kThreads;
    if (i < kHidden) p.h[(size_t)row * kHidden + i] = __float2bfloat16_rn(w[j] * ((v[j] - mean) * inv));
  }
#endif
}

// ====  5. Task: QKV  ===========================================================================
//   16-row tiles of the stacked [q; k; v] projection of h (K = H). Epilogue per (row r, batch b):
//   round to bf16, GPT-J RoPE on q and k where the layer uses it (pairs 2i, 2i+1 are rows r, r^1 of
//   the tile), then q -> q buffer, k and v -> the paged cache at the row's slot.
__device__ void qkv_epilogue(const Params& p, int layer, int tile, bool rope, const float* out) {
  const int i = threadIdx.x;
  if (i >= 128) return;
  const int r = i >> 3, b = i & 7;
  if (b >= p.batch_size) return;
  const int R = tile * 16 + r;  // row of the stacked projection
  float val = bf16_round(out[r * 8 + b]);
  const RowState rs = p.rows[b];
  if (rope && R < kQSize + kKvSize) {
    const int d = R % kHeadDim;
    const float partner = bf16_round(out[(r ^ 1) * 8 + b]);
    const float angle = (float)rs.position * p.inv_freq[d >> 1];
    const float c = bf16_round(cosf(angle)), s = bf16_round(sinf(angle));
    val = bf16_round(val * c + ((d & 1) ? partner : -partner) * s);
  }
  if (R < kQSize) {
    p.q[(size_t)b * kQSize + R] = __float2bfloat16_rn(val);
    return;
  }
  const bool is_k = R < kQSize + kKvSize;
  const int kv_row = is_k ? R - kQSize : R - kQSize - kKvSize;
  const int head = kv_row / kHeadDim, d = kv_row % kHeadDim;
  const int page = p.block_tables[((size_t)layer * p.max_seqs + rs.seq) * p.max_pages_per_seq + rs.position / kPage];
  if (page < 0 || page >= p.num_pages) {
    report(p, NC_ERR_BAD_PAGE, layer, b);
    return;
  }
  const size_t slot = (size_t)page * kPage + rs.position % kPage;
  (is_k ? p.k_pool : p.v_pool)[(slot * kKvHeads + head) * kHeadDim + d] = __float2bfloat16_rn(val);
}

__device__ const bf16* qkv_weight_tile(const Params& p, int layer, int tile) {
  const int R = tile * 16;
  return R < kQSize ? layer_ptr(p, layer, LP_Q) + (size_t)R * kHidden
       : R < kQSize + kKvSize ? layer_ptr(p, layer, LP_K) + (size_t)(R - kQSize) * kHidden
                              : layer_ptr(p, layer, LP_V) + (size_t)(R - kQSize - kKvSize) * kHidden;
}

__device__ void task_qkv(const Params& p, const Task& t, unsigned char* smem) {
  GemmSmem& s = *reinterpret_cast<GemmSmem*>(smem);
  const int end = t.arg[0] + t.arg[1];
  for (int tile = t.arg[0]; tile < end; tile += 2) {  // two tiles per product when the task has them
    if (tile + 1 < end) {
      const bf16* tiles[2] = {qkv_weight_tile(p, t.layer, tile), qkv_weight_tile(p, t.layer, tile + 1)};
      const int valid[2] = {16, 16};
      mma_tiles<2>(tiles, valid, kHidden, p.h, kHidden, p.batch_size, s.red, s.out);
      qkv_epilogue(p, t.layer, tile, t.arg[2] != 0, s.out);
      qkv_epilogue(p, t.layer, tile + 1, t.arg[2] != 0, s.out + 128);
    } else {
      const bf16* tiles[1] = {qkv_weight_tile(p, t.layer, tile)};
      const int valid[1] = {16};
      mma_tiles<1>(tiles, valid, kHidden, p.h, kHidden, p.batch_size, s.red, s.out);
      qkv_epilogue(p, t.layer, tile, t.arg[2] != 0, s.out);
    }
  }
}

// ====  6. Task: ATTN  ==========================================================================
//   Split-KV decode attention for one (row, KV head, split): the split's share of the row's visible
//   pages (the whole history, or the window's: keys p-W+1..p). K and V pages stream through a ring of
//   kKvStages shared-memory stages by cp.async; the pages wholly before the row's position are issued
//   BEFORE the task waits for this step's q (attn_preload, called by the dispatcher), so at B = 1 the
//   whole split is usually in shared memory when q arrives. Scores S[tok][head] = K q^T and the update
//   O^T[d][head] += V^T P^T run on tensor cores (mma m16n8k16: K or V^T as the 16-row operand, the
//   group's query heads as the 8 columns, fp32 accumulation); the online softmax is fp32 per query head,
//   and P enters the product as two bf16 parts (hi + lo), so the output keeps fp32-like precision.
//   Outputs: the unnormalised O and (max, sum) per head to attn_partial / attn_ml.
constexpr int kKvRow = kHeadDim + 8;  // bf16 per shared row: +16 B keeps the fragment loads conflict-free
// KV pages in flight per task (35 KB each at head_dim 128): 2 were as fast; 5 were 1.8% slower at B = 1, the larger
// shared memory leaving less L1 to the other tasks
constexpr int kKvStages = 3;
constexpr int kProbRow = kPage + 8;
constexpr int kDTiles = kHeadDim / 16;  // 16-row tiles of O^T
static_assert(kGroup <= 8, "the query heads of a KV group are the n8 operand of the attention mma");
static_assert(kDTiles <= kWarps, "one O^T tile per warp");
struct KvStage {
  bf16 k[kPage][kKvRow];
  bf16 v[kPage][kKvRow];
};
struct AttnSmem {
  bf16 q[8][kKvRow];                 // the group's queries (rows >= kGroup are zero)
  bf16 prob[2][8][kProbRow];         // this page's probabilities as bf16 hi + lo parts (rows >= kGroup: zero)
  float score[kGroup][kPage];        // this page's scaled scores (-inf outside the visible range)
  float m[8], l[8], alpha[8];
  KvStage kv[kKvStages];             // the ring
};
static_assert(sizeof(AttnSmem) <= 227 * 1024, "attention shared memory beyond the 227 KB a block may have");

struct AttnRange {  // the pages [p0, p1) a split reads, and the visible positions [lo, pos]
  int p0, p1, lo, pos;
};
__device__ AttnRange attn_range(const Params& p, const Task& t) {
  const int b = t.arg[0], split = t.arg[2], nsplit = t.arg[3], window = t.arg[4];
  const int pos = p.rows[b].position;
  const int lo = window > 0 ? max(0, pos - window + 1) : 0;
  const int first = lo / kPage, npages = pos / kPage - first + 1;
  return AttnRange{first + split * npages / nsplit, first + (split + 1) * npages / nsplit, lo, pos};
}

__device__ int attn_page_of(const Params& p, const Task& t, int pg) {
  const RowState& rs = p.rows[t.arg[0]];
  const int page = __ldcg(p.block_tables + ((size_t)t.layer * p.max_seqs + rs.seq) * p.max_pages_per_seq + pg);
  if (page < 0 || page >= p.num_pages) {
    if (threadIdx.x == 0) report(p, NC_ERR_BAD_PAGE, t.layer, t.arg[0]);
    return 0;
  }
  return page;
}

// Issues the cp.async copies of one page (64 tokens of one KV head, K and V) into a stage; one commit group.
__device__ void load_kv_page(const Params& p, AttnSmem& s, int stage, int page, int kvh) {
  constexpr int kChunks = kHeadDim / 8;  // 16-byte pieces per token row
  for (int i = threadIdx.x; i < kPage * kChunks; i += kThreads) {
    const int o = i / kChunks, c = i % kChunks;
    const size_t src = (((size_t)page * kPage + o) * kKvHeads + kvh) * kHeadDim + c * 8;
    cp_async16_evict_first(&s.kv[stage].k[o][c * 8], p.k_pool + src);
    cp_async16_evict_first(&s.kv[stage].v[o][c * 8], p.v_pool + src);
  }
  asm volatile("cp.async.commit_group;");
}

// How many of the split's first pages may be copied before this step's K/V is written: those wholly
// before the row's position (its own page receives the new token), at most kKvStages.
__device__ __forceinline__ int attn_early_pages(const AttnRange& r) {
  return max(0, min(min(r.p1, r.pos / kPage) - r.p0, kKvStages));
}

// Before the dependency wait (dispatcher): start copying the pages that do not depend on this step.
__device__ void attn_preload(const Params& p, const Task& t, unsigned char* smem) {
  AttnSmem& s = *reinterpret_cast<AttnSmem*>(smem);
  const AttnRange r = attn_range(p, t);
  const int early = attn_early_pages(r);
  for (int j = 0; j < early; ++j) load_kv_page(p, s, j, attn_page_of(p, t, r.p0 + j), t.arg[1]);
}

// Waits until at most `pending` commit groups are still in flight (wait_group takes an immediate).
__device__ __forceinline__ void cp_async_wait_pending(int pending) {
  switch (min(pending, 7)) {
    case 0: asm volatile("cp.async.wait_group 0;"); break;
    case 1: asm volatile("cp.async.wait_group 1;"); break;
    case 2: asm volatile("cp.async.wait_group 2;"); break;
    case 3: asm volatile("cp.async.wait_group 3;"); break;
    case 4: asm volatile("cp.async.wait_group 4;"); break;
    case 5: asm volatile("cp.async.wait_group 5;"); break;
    case 6: asm volatile("cp.async.wait_group 6;"); break;
    default: asm volatile("cp.async.wait_group 7;"); break;
  }
}

__device__ __forceinline__ unsigned smem_u32(const bf16* ptr) { return *reinterpret_cast<const unsigned*>(ptr); }

__device__ __forceinline__ void mma_bf16(float (&c)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                         unsigned b0, unsigned b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Scores of one page: warps 0..3 each take 16 tokens, S[tok][head] = K[tok] . q[head] over head_dim.
__device__ __forceinline__ void attn_scores(AttnSmem& s, int stage, int lo_tok, int hi_tok, float scale) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  if (warp >= kPage / 16) return;
  float c[4] = {0.f, 0.f, 0.f, 0.f};
  const int tok = warp * 16 + g;
#pragma unroll
  for (int kk = 0; kk < kHeadDim; kk += 16) {
    mma_bf16(c, smem_u32(&s.kv[stage].k[tok][kk + 2 * t]), smem_u32(&s.kv[stage].k[tok + 8][kk + 2 * t]),
             smem_u32(&s.kv[stage].k[tok][kk + 2 * t + 8]), smem_u32(&s.kv[stage].k[tok + 8][kk + 2 * t + 8]),
             smem_u32(&s.q[g][kk + 2 * t]), smem_u32(&s.q[g][kk + 2 * t + 8]));
  }
#pragma unroll
  for (int e = 0; e < 4; ++e) {  // c[e]: token tok + 8 (e >> 1), head 2t + (e & 1)
    const int o = tok + 8 * (e >> 1), hq = 2 * t + (e & 1);
    if (hq < kGroup) s.score[hq][o] = (o >= lo_tok && o <= hi_tok) ? c[e] * scale : -INFINITY;
  }
}

// Online softmax of one page, one warp per query head: probabilities (bf16) and the rescale factor.
__device__ __forceinline__ void attn_softmax(AttnSmem& s) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int hq = warp; hq < kGroup; hq += kWarps) {
    const float v0 = s.score[hq][lane], v1 = s.score[hq][lane + 32];
    const float m_old = s.m[hq];
    const float m_new = fmaxf(m_old, warp_max(fmaxf(v0, v1)));
    float p0 = 0.f, p1 = 0.f, alpha = 1.f;
    if (m_new != -INFINITY) {
      p0 = __expf(v0 - m_new);
      p1 = __expf(v1 - m_new);
      alpha = m_old == -INFINITY ? 0.f : __expf(m_old - m_new);
    }
    const float sum = warp_sum(p0 + p1);
    const bf16 hi0 = __float2bfloat16_rn(p0), hi1 = __float2bfloat16_rn(p1);
    s.prob[0][hq][lane] = hi0;  // P = hi + lo to ~2^-16: the product keeps fp32-like precision in two bf16 mmas
    s.prob[0][hq][lane + 32] = hi1;
    s.prob[1][hq][lane] = __float2bfloat16_rn(p0 - to_f(hi0));
    s.prob[1][hq][lane + 32] = __float2bfloat16_rn(p1 - to_f(hi1));
    if (lane == 0) {
      s.l[hq] = s.l[hq] * alpha + sum;
      s.m[hq] = m_new;
      s.alpha[hq] = alpha;
    }
  }
}

// O^T[d][head] = O^T * alpha[head] + V^T P^T for this warp's 16 dims (V^T fragments by ldmatrix.trans).
__device__ __forceinline__ void attn_pv(const AttnSmem& s, int stage, float (&acc)[4]) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  if (warp >= kDTiles) return;
  acc[0] *= s.alpha[2 * t];
  acc[1] *= s.alpha[2 * t + 1];
  acc[2] *= s.alpha[2 * t];
  acc[3] *= s.alpha[2 * t + 1];
  const int row_in = (lane & 7) + ((lane >> 4) & 1) * 8, col = warp * 16 + ((lane >> 3) & 1) * 8;
#pragma unroll
  for (int k0 = 0; k0 < kPage; k0 += 16) {
    unsigned a0, a1, a2, a3;
    const unsigned addr = (unsigned)__cvta_generic_to_shared(&s.kv[stage].v[k0 + row_in][col]);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(a0), "=r"(a1), "=r"(a2), "=r"(a3) : "r"(addr));
    mma_bf16(acc, a0, a1, a2, a3, smem_u32(&s.prob[0][g][k0 + 2 * t]), smem_u32(&s.prob[0][g][k0 + 2 * t + 8]));
    mma_bf16(acc, a0, a1, a2, a3, smem_u32(&s.prob[1][g][k0 + 2 * t]), smem_u32(&s.prob[1][g][k0 + 2 * t + 8]));
  }
}

__device__ void task_attn(const Params& p, const Task& t, unsigned char* smem) {
  AttnSmem& s = *reinterpret_cast<AttnSmem*>(smem);
  const int b = t.arg[0], kvh = t.arg[1], split = t.arg[2];
  const AttnRange r = attn_range(p, t);
  const int n = r.p1 - r.p0;
  int issued = attn_early_pages(r);  // attn_preload's pages
  for (int i = threadIdx.x; i < 8 * kKvRow; i += kThreads) {  // queries (heads >= kGroup: zero)
    const int hq = i / kKvRow, d = i % kKvRow;
    s.q[hq][d] = hq < kGroup && d < kHeadDim ? __ldcg(p.q + (size_t)b * kQSize + (kvh * kGroup + hq) * kHeadDim + d)
                                             : __float2bfloat16_rn(0.f);
  }
  for (int i = threadIdx.x; i < 2 * 8 * kProbRow; i += kThreads) (&s.prob[0][0][0])[i] = __float2bfloat16_rn(0.f);
  if (threadIdx.x < 8) {
    s.m[threadIdx.x] = -INFINITY;
    s.l[threadIdx.x] = 0.f;
    s.alpha[threadIdx.x] = 0.f;
  }
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  const float scale = rsqrtf((float)kHeadDim);
  for (int j = 0; j < n; ++j) {
    for (; issued < n && issued < j + kKvStages; ++issued)
      load_kv_page(p, s, issued % kKvStages, attn_page_of(p, t, r.p0 + issued), kvh);
    cp_async_wait_pending(issued - j - 1);
    __syncthreads();
    const int stage = j % kKvStages, pg = r.p0 + j;
    const int lo_tok = max(r.lo - pg * kPage, 0), hi_tok = min(r.pos - pg * kPage, kPage - 1);
    if (lo_tok > 0 || hi_tok < kPage - 1) {  // rows outside the visible range get P = 0: make V finite there
      for (int i = threadIdx.x; i < kPage * kHeadDim; i += kThreads) {
        const int o = i / kHeadDim;
        if (o < lo_tok || o > hi_tok) s.kv[stage].v[o][i % kHeadDim] = __float2bfloat16_rn(0.f);
      }
    }
    attn_scores(s, stage, lo_tok, hi_tok, scale);
    __syncthreads();
    attn_softmax(s);
    __syncthreads();
    attn_pv(s, stage, acc);
    __syncthreads();  // the stage is refilled next
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
  const size_t base = ((size_t)(b * kKvHeads + kvh) * kMaxSplits + split);
  if (warp < kDTiles) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {  // acc[e]: dim warp*16 + g + 8 (e >> 1), head 2 tq + (e & 1)
      const int d = warp * 16 + g + 8 * (e >> 1), hq = 2 * tq + (e & 1);
      if (hq < kGroup) p.attn_partial[base * kGroup * kHeadDim + hq * kHeadDim + d] = acc[e];
    }
  }
  if (threadIdx.x < kGroup) {
    p.attn_ml[(base * kGroup + threadIdx.x) * 2] = s.m[threadIdx.x];
    p.attn_ml[(base * kGroup + threadIdx.x) * 2 + 1] = s.l[threadIdx.x];
  }
}

// ====  7. Task: COMBINE  =======================================================================
//   Merge the splits of one (row, KV head): out = sum_s acc_s e^(m_s - M) / sum_s l_s e^(m_s - M),
//   written as bf16 into attn_out [8, Hq*D].
static_assert(2 * kMaxSplits * 8 <= kWarps * 2 * 128 && kHeadDim % 4 == 0, "combine: scratch in GemmSmem.red, float4 outputs");
static_assert(kMaxSplits <= 32, "combine: a lane per split");
__device__ void combine_row(const Params& p, int b, int kvh, int nsplit, float* scratch) {
  float* m_s = scratch;                      // [kMaxSplits][8] each split's running max, then its weight
  float* l_s = scratch + kMaxSplits * 8;     // [kMaxSplits][8] each split's sum
  const size_t base = (size_t)(b * kKvHeads + kvh) * kMaxSplits;
  __syncthreads();  // the previous user of the scratch is done
  // tid through asm volatile: the compiler cannot hoist this loop's per-thread indices out of the task loop, where
  // two of them spilled 8 bytes
  int tid;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
  for (int i = tid; i < nsplit * kGroup; i += kThreads) {  // all (split, head) pairs in one round trip
    const int sp = i / kGroup, hq = i % kGroup;
    m_s[sp * 8 + hq] = __ldcg(p.attn_ml + ((base + sp) * kGroup + hq) * 2);
    l_s[sp * 8 + hq] = __ldcg(p.attn_ml + ((base + sp) * kGroup + hq) * 2 + 1);
  }
  __syncthreads();
  // weight of split sp for head hq: e^(m_sp - M) / sum_s l_s e^(m_s - M); a warp per head, a lane per split
  // (a serial pass per head took ~2 us of the combine at 32 splits)
  const int lane = threadIdx.x & 31;
  for (int hq = threadIdx.x >> 5; hq < kGroup; hq += kWarps) {
    const float ms = lane < nsplit ? m_s[lane * 8 + hq] : -INFINITY;
    const float m = warp_max(ms);
    const float l = warp_sum(ms == -INFINITY ? 0.f : l_s[lane * 8 + hq] * __expf(ms - m));
    if (lane < nsplit) m_s[lane * 8 + hq] = (ms == -INFINITY || l <= 0.f) ? 0.f : __expf(ms - m) / l;
  }
  __syncthreads();
  for (int idx = 4 * threadIdx.x; idx < kGroup * kHeadDim; idx += 4 * kThreads) {  // 4 outputs a thread, 16 loads in flight
    const int hq = idx / kHeadDim;
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 16
    for (int sp = 0; sp < nsplit; ++sp) {
      const float4 part = __ldcg(reinterpret_cast<const float4*>(p.attn_partial + (base + sp) * kGroup * kHeadDim + idx));
      const float f = m_s[sp * 8 + hq];
      o.x += part.x * f, o.y += part.y * f, o.z += part.z * f, o.w += part.w * f;
    }
    bf16* out = p.attn_out + (size_t)b * kQSize + kvh * kGroup * kHeadDim + idx;
    out[0] = __float2bfloat16_rn(o.x), out[1] = __float2bfloat16_rn(o.y);
    out[2] = __float2bfloat16_rn(o.z), out[3] = __float2bfloat16_rn(o.w);
  }
}

__device__ void task_combine(const Params& p, const Task& t, unsigned char* smem) {
  combine_row(p, t.arg[0], t.arg[1], t.arg[2], reinterpret_cast<GemmSmem*>(smem)->red);
}

// ====  8. Task: OPROJ  =========================================================================
//   16-row tiles of o_proj (K = Hq*D, 128 KB a tile) over attn_out; x[b][row] += bf16(result) (atomic:
//   the MLP branch adds into the same rows). Each tile streams through a per-lane ring of kOprojStages
//   steps in the rings' memory (rows g and g+8, 16 B each, at the warp's k-chunks: 8 KB a step, 64 KB in
//   flight per SM all along the tile); mma_tiles' register loads keep 32 KB in flight and drain them
//   between passes: latency-bound, they ran 50% slower in builds whose timing put them beside more of the
//   MoE stream. The first tile's first steps go out before the dependency wait (oproj_prologue); the
//   activation pieces (attn_out, from L2) are loaded two steps ahead.
// Adds o_proj's result for rows 16 tile .. + 15 into x.
__device__ __forceinline__ void oproj_add(const Params& p, int tile, const float* out) {
  const int i = threadIdx.x, r = i >> 3, b = i & 7;
  if (i < 128 && b < p.batch_size) atomicAdd(p.x + (size_t)b * kHidden + tile * 16 + r, bf16_round(out[i]));
}

constexpr int kOprojSteps = (kQSize / 32 + kWarps - 1) / kWarps;  // k-chunks per warp (16 at North Mini Code)
constexpr int kOprojStages = 2 * kMoeStages;  // a step is half a MoE step
static_assert((size_t)kOprojStages * 2 * kThreads * 16 <= kRingBytes, "the o_proj ring in the rings' memory");

__device__ __forceinline__ void oproj_issue(const bf16* w, uint4* ring, int step) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
  const int c = warp + kWarps * step;
  if (step < kOprojSteps && c < kQSize / 32) {
    uint4* slot = ring + (size_t)(step % kOprojStages) * 2 * kThreads + threadIdx.x;
    const size_t lo = (size_t)g * kQSize + c * 32 + 8 * tq;
    cp_async16(slot, w + lo);
    cp_async16(slot + kThreads, w + lo + (size_t)8 * kQSize);
  }
  asm volatile("cp.async.commit_group;");
}

// The first tile's first kOprojStages steps, issued by the dispatcher before the task's dependency wait (weights
// are immutable; the previous task left the ring's memory with no copy in flight): at the layer's end the wait is
// already met, and its round trip (~1.5 us) then overlaps the first loads.
__device__ void oproj_prologue(const Params& p, const Task& t, unsigned char* smem) {
  uint4* ring = reinterpret_cast<uint4*>(smem + kRingOffset);
  const bf16* w = layer_ptr(p, t.layer, LP_O) + (size_t)t.arg[0] * 16 * kQSize;
  for (int j = 0; j < kOprojStages; ++j) oproj_issue(w, ring, j);
}

__device__ void task_oproj(const Params& p, const Task& t, unsigned char* smem) {
  GemmSmem& s = *reinterpret_cast<GemmSmem*>(smem);
  uint4* ring = reinterpret_cast<uint4*>(smem + kRingOffset);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
  const bf16* act = p.attn_out + (size_t)g * kQSize + warp * 32 + 8 * tq;
  auto piece = [&](int j) {
    return g < p.batch_size && j < kOprojSteps && warp + kWarps * j < kQSize / 32
               ? load_act16(act + (size_t)kWarps * 32 * j) : make_uint4(0, 0, 0, 0);
  };
  for (int tile = t.arg[0]; tile < t.arg[0] + t.arg[1]; ++tile) {
    const bf16* w = layer_ptr(p, t.layer, LP_O) + (size_t)tile * 16 * kQSize;
    if (tile > t.arg[0])  // the first tile's prologue went out before the wait (oproj_prologue)
      for (int j = 0; j < kOprojStages; ++j) oproj_issue(w, ring, j);
    uint4 xa[3] = {piece(0), piece(1), make_uint4(0, 0, 0, 0)};
    float acc[1][4] = {{0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int j = 0; j < kOprojSteps; ++j) {
      if (j + 2 < kOprojSteps) xa[(j + 2) % 3] = piece(j + 2);
      asm volatile("cp.async.wait_group %0;" ::"n"(kOprojStages - 1) : "memory");
      if (warp + kWarps * j < kQSize / 32) {
        const uint4* slot = ring + (size_t)(j % kOprojStages) * 2 * kThreads + threadIdx.x;
        mma_piece(acc[0], slot[0], slot[kThreads], xa[j % 3]);
      }
      oproj_issue(w, ring, j + kOprojStages);
    }
    reduce_warps<1>(acc, s.red, s.out);
    oproj_add(p, tile, s.out);
  }
  asm volatile("cp.async.wait_group 0;" ::: "memory");  // no copy outlives the task (the next reuses the memory)
  __syncthreads();
}

// ====  9. Task: ROUTER  ========================================================================
//   One 16-row tile of the router (E rows, K = H) a task: router_logits[b][e], rounded to bf16 as the
//   reference. The tile's whole weight (64 KB at H = 2048) is copied into the rings' memory by cp.async
//   before the dependency wait (router_prologue, from the dispatcher), so that once h is ready only h's
//   pieces make a round trip. The router sits on the step's critical chain (NORM -> ROUTER -> TOPK ->
//   every MoE up): through mma_tiles' loads (two round trips and the signal) it took 5.9 us, 3.0 this way.
// A tile's logits (out [16 rows x 8 batch rows], fp32) rounded to bf16 as the reference: router_logits [b][e].
__device__ __forceinline__ void router_epilogue(const Params& p, int layer, int tile, const float* out) {
  const int i = threadIdx.x, r = i >> 3, b = i & 7, e = tile * 16 + r;
  if (i < 128 && b < p.batch_size && e < kExperts) {
    p.router_logits[b * kExperts + e] = bf16_round(out[i]);
    if (p.trace_router) p.trace_router[((size_t)layer * kMaxBatch + b) * kExperts + e] = bf16_round(out[i]);
  }
}

constexpr int kRouterSteps = (kHidden / 32 + kWarps - 1) / kWarps;  // k-chunks per warp (8 at H = 2048)
static_assert((size_t)kRouterSteps * 2 * kThreads * 16 <= kRingBytes, "a router tile in the rings' memory");

// Step j of this lane: rows g and g + 8 (clamped to the tile's valid rows, as mma_tiles), k-chunk warp + 8 j.
__device__ void router_prologue(const Params& p, const Task& t, unsigned char* smem) {
  uint4* ring = reinterpret_cast<uint4*>(smem + kRingOffset);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
  const int valid = min(16, kExperts - t.arg[0] * 16), r_lo = min(g, valid - 1), r_hi = min(g + 8, valid - 1);
  const bf16* w = layer_ptr(p, t.layer, LP_ROUTER) + (size_t)t.arg[0] * 16 * kHidden + warp * 32 + 8 * tq;
#pragma unroll
  for (int j = 0; j < kRouterSteps; ++j) {
    if (warp + kWarps * j < kHidden / 32) {
      uint4* slot = ring + (size_t)j * 2 * kThreads + threadIdx.x;
      cp_async16(slot, w + (size_t)r_lo * kHidden + kWarps * 32 * j);
      cp_async16(slot + kThreads, w + (size_t)r_hi * kHidden + kWarps * 32 * j);
    }
  }
  asm volatile("cp.async.commit_group;");
}

__device__ void task_router(const Params& p, const Task& t, unsigned char* smem) {
  GemmSmem& s = *reinterpret_cast<GemmSmem*>(smem);
  const uint4* ring = reinterpret_cast<const uint4*>(smem + kRingOffset);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
  const bf16* act = p.h + (size_t)g * kHidden + warp * 32 + 8 * tq;
  uint4 xa[kRouterSteps];  // all of this lane's h pieces in one round trip
#pragma unroll
  for (int j = 0; j < kRouterSteps; ++j)
    xa[j] = g < p.batch_size && warp + kWarps * j < kHidden / 32 ? load_act16(act + kWarps * 32 * j)
                                                                  : make_uint4(0, 0, 0, 0);
  asm volatile("cp.async.wait_group 0;" ::: "memory");  // this lane's own slots of the tile
  float acc[1][4] = {{0.f, 0.f, 0.f, 0.f}};
#pragma unroll
  for (int j = 0; j < kRouterSteps; ++j)
    if (warp + kWarps * j < kHidden / 32) {
      const uint4* slot = ring + (size_t)j * 2 * kThreads + threadIdx.x;
      mma_piece(acc[0], slot[0], slot[kThreads], xa[j]);
    }
  reduce_warps<1>(acc, s.red, s.out);
  router_epilogue(p, t.layer, t.arg[0], s.out);
  __syncthreads();  // the ring's memory is free for the next task
}

// ====  10. Task: TOPK  =========================================================================
//   Picks each row's top-k router logits (ties: lower expert id), weights them (sigmoid, optionally
//   renormalised, or softmax over the k), then the block numbers the distinct experts in ascending id
//   order ("slots") and writes moe_slots and slot_weight [slot][row]. Up to 2 pairs (row, expert) a thread
//   (B <= 4 at E = 128), a thread per pair counts the keys that beat its own (its rank; rank < k: chosen, at
//   place rank), all at once (TOPK 4.4 -> 2.9 us at B = 1, on the step's critical chain router -> top-k ->
//   every MoE up); beyond, a warp per row takes k warp-wide maxima in turn (ranks are B E^2 comparisons: they
//   cost 1-1.7 us more at B = 8).
struct TopkSmem {
  int expert[kMaxBatch][kTopK];
  float weight[kMaxBatch][kTopK];
  int used[kExperts];         // 1 where any row chose the expert
  int warp_count[kWarps];     // used experts among each warp's 32
  float logit[kMaxBatch][kExperts];     // topk_ranks: NaN read as -inf
  alignas(16) unsigned key[kMaxBatch][kExperts];  // topk_ranks: topk_key, larger key, earlier place (uint4 reads)
};
static_assert(kExperts <= kThreads, "top-k: one thread per expert numbers the slots");

// Row b's top-k weights in place order: s.weight[b] holds the sigmoid weights (renormalised to sum 1 where
// NC_NORM_TOPK, the sum rounded to bf16 first), or the chosen logits (softmax over them).
__device__ void finish_topk_weights(TopkSmem& s, int b) {
#if NC_SELECT_SIGMOID
#if NC_NORM_TOPK
  float total = 0.f;
  for (int k = 0; k < kTopK; ++k) total += s.weight[b][k];
  total = bf16_round(total);
  for (int k = 0; k < kTopK; ++k) s.weight[b][k] = bf16_round(s.weight[b][k] / total);
#endif
#else
  const float m = s.weight[b][0];
  float total = 0.f;
  for (int k = 0; k < kTopK; ++k) total += expf(s.weight[b][k] - m);
  for (int k = 0; k < kTopK; ++k) s.weight[b][k] = bf16_round(expf(s.weight[b][k] - m) / total);
#endif
}

__device__ void topk_row(const Params& p, int layer, int b, TopkSmem& s) {
  constexpr int kPer = (kExperts + 31) / 32;
  const int lane = threadIdx.x & 31;
  float v[kPer];
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int e = lane + 32 * j;
    v[j] = e < kExperts ? __ldcg(p.router_logits + b * kExperts + e) : -INFINITY;
  }
  for (int k = 0; k < kTopK; ++k) {
    ArgMax best{-INFINITY, 1 << 30};
#pragma unroll
    for (int j = 0; j < kPer; ++j)
      if (lane + 32 * j < kExperts) best = better(best, ArgMax{v[j], lane + 32 * j});
    best = warp_argmax(best);
#pragma unroll
    for (int j = 0; j < kPer; ++j)
      if (lane + 32 * j == best.index) v[j] = -INFINITY;
    if (lane == 0) {
      s.expert[b][k] = best.index;
      s.weight[b][k] = best.value;
      p.routed[(layer * kMaxBatch + b) * kTopK + k] = best.index;
    }
  }
  __syncwarp();
  if (lane == 0) {
    if (NC_SELECT_SIGMOID)
      for (int k = 0; k < kTopK; ++k) s.weight[b][k] = bf16_round(1.f / (1.f + expf(-s.weight[b][k])));
    finish_topk_weights(s, b);
  }
}

// A logit's key: the bf16 logit's bits made monotonic in the upper half (the router's logits are rounded to
// bf16, so the lower half of the float is free), 0xFFFF - expert in the lower half: keys are distinct, and the
// larger key is the larger logit, or the equal one with the lower id (topk_row's order).
__device__ __forceinline__ unsigned topk_key(float v, int e) {
  const unsigned u = __float_as_uint(v);
  const unsigned monotonic = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return (monotonic & 0xFFFF0000u) | (0xFFFFu - (unsigned)e);
}
// s.expert / s.weight [b][place] of every row's top-k and s.used, by ranks: the (row, expert) pair's rank is the
// number of the row's keys above its own (where E is a multiple of 32 a warp shares its row: the reads of the
// row's keys are broadcasts, four at a time). Sigmoid weights are computed by the chosen pairs' threads;
// renormalising and softmax go over the k in place order (one thread a row), as topk_row does. Comparing floats
// and ids took ~3.4 us more than topk_row at B = 8 (4 pairs a thread); keys make it one compare.
static_assert(kExperts % 4 == 0, "top-k ranks: a row's keys are read four at a time");
__device__ void topk_ranks(const Params& p, int layer, TopkSmem& s) {
  const int pairs = p.batch_size * kExperts;
  for (int i = threadIdx.x; i < pairs; i += kThreads) {
    const float raw = __ldcg(p.router_logits + i), v = isnan(raw) ? -INFINITY : raw + 0.f;  // -0 -> +0: one key
    s.logit[i / kExperts][i % kExperts] = v;
    s.key[i / kExperts][i % kExperts] = topk_key(v, i % kExperts);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < pairs; i += kThreads) {
    const int b = i / kExperts, e = i % kExperts;
    const uint4* row = reinterpret_cast<const uint4*>(s.key[b]);
    const unsigned mine = s.key[b][e];
    int rank = 0;
#pragma unroll 8
    for (int q = 0; q < kExperts / 4; ++q) {
      const uint4 k4 = row[q];
      rank += (k4.x > mine) + (k4.y > mine) + (k4.z > mine) + (k4.w > mine);
    }
    const float v = s.logit[b][e];
    if (rank < kTopK) {
      s.expert[b][rank] = e;
      s.weight[b][rank] = NC_SELECT_SIGMOID ? bf16_round(1.f / (1.f + expf(-v))) : v;
      s.used[e] = 1;
      p.routed[(layer * kMaxBatch + b) * kTopK + rank] = e;
    }
  }
#if !NC_SELECT_SIGMOID || NC_NORM_TOPK
  __syncthreads();
  if (threadIdx.x < p.batch_size) finish_topk_weights(s, threadIdx.x);
#endif
}

// The distinct experts get slots in ascending id order: one thread per expert, a ballot per warp and the
// warps' counts before it give the slot (a serial pass over the experts took ~6 us at B = 1).
__device__ void task_topk(const Params& p, const Task& t, unsigned char* smem) {
  TopkSmem& s = *reinterpret_cast<TopkSmem*>(smem);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, e = threadIdx.x;
  if (e < kExperts) s.used[e] = 0;
  if (p.batch_size * kExperts <= 2 * kThreads) {
    topk_ranks(p, t.layer, s);
  } else {
    __syncthreads();
    if (warp < p.batch_size) topk_row(p, t.layer, warp, s);
    __syncthreads();
    if (e < p.batch_size * kTopK) s.used[s.expert[e / kTopK][e % kTopK]] = 1;
  }
  __syncthreads();
  const bool used = e < kExperts && s.used[e];
  const unsigned ballot = __ballot_sync(0xffffffffu, used);
  if (lane == 0) s.warp_count[warp] = __popc(ballot);
  __syncthreads();
  int slot = __popc(ballot & ((1u << lane) - 1u)), total = 0;
  for (int w = 0; w < kWarps; ++w) {
    slot += w < warp ? s.warp_count[w] : 0;
    total += s.warp_count[w];
  }
  if (used) {
    p.moe_slots[1 + slot] = e;
    for (int b = 0; b < kMaxBatch; ++b) {
      float w = 0.f;
      if (b < p.batch_size)
#pragma unroll
        for (int k = 0; k < kTopK; ++k)
          if (s.expert[b][k] == e) w = s.weight[b][k];
      p.slot_weight[slot * kMaxBatch + b] = w;
    }
  }
  if (threadIdx.x == 0) {
    p.moe_slots[0] = total;
    p.expert_counts[t.layer] = total;
  }
}

__device__ __forceinline__ float silu_bf16(float g) { return bf16_round(g / (1.f + expf(-g))); }

// ====  11. Tasks: MOE_UP and MOE_DOWN (streamed)  =============================================
//   Every SM runs one MOE_UP and one MOE_DOWN per layer. Once TOPK has written the slots, the work is
//   known: up tiles u = (slot, 16 channels) claimed in order from the layer's counter (MOE_UP arg2) a
//   few tiles ahead, so that blocks leaving attention late take fewer and the slots complete in order
//   (MOE_UP's arg0 last blocks take none: they run the combine); down tiles d = (slot, 32 output rows)
//   in contiguous ranges (a block's tiles share a slot, so its activation rows are loaded once per
//   slot). Each lane streams its own pieces of the weights (16 B each, at its warp's k-chunks; kUpRowSeg
//   and kDownRows below say which rows) through a private ring of kMoeStages steps in shared memory by
//   cp.async, kMoeStages x 16 KB in flight per SM across tile boundaries, and multiplies a step once its
//   copy group is complete; the block meets only to reduce a tile's warps. Up: moe_act[slot][b] =
//   bf16(silu(gate) * up), "slot done" += 1 per tile (the slot is done at I/16). Down: waits for its
//   slot, then x[b] += bf16(bf16(down . act) * weight[slot][b]) for the rows routed to that expert.
// kUpRowSeg: an up step reads one matrix's 16 rows x 1 KB (512 columns: chunks 16s + 2w and 16s + 2w + 1 for warp
// w at the matrix's step s) instead of both matrices' 16 rows x 512 B, so that a step's pieces of each row are
// twice as long: with every SM streaming, 1-KB pieces of 32 rows read at 4.5 TB/s, 512-B pieces at 3.5 (DRAM pages
// opened for less); the same four 16-B copies per lane, the same products. Needs H a multiple of 512 (the tiny
// geometry keeps the fragment order).
constexpr bool kUpRowSeg = kHidden % 512 == 0;
// kUpRowSeg: steps per matrix of an up tile (4 at H = 2048; 1 where H < 512 keeps the unused index math defined)
constexpr int kRowSegSteps = kHidden >= 512 ? kHidden / 512 : 1;
// The k-chunk of this warp's j-th activation piece of an up tile.
__device__ __forceinline__ int up_chunk(int j, int warp) {
  return kUpRowSeg ? 16 * (j >> 1) + 2 * warp + (j & 1) : warp + kWarps * j;
}
constexpr int kUpTilesPerSlot = kExpertWidth / 16;
constexpr int kDownTilesPerSlot = kHidden / 32;
constexpr int kUpSteps = (kHidden / 32 + kWarps - 1) / kWarps;         // k-chunks per warp of an up tile
constexpr int kDownSteps = (kExpertWidth / 32 + kWarps - 1) / kWarps;  // ... of a down tile
// kDownRows: a down step is one matrix's 16 whole rows (24 KB contiguous at I = 768: warp w's chunks 3w .. 3w + 2,
// six 16-B copies per lane), two steps a tile, in 24-KB slots (two in the ring's 64 KB), instead of both matrices'
// 16 rows x 512 B. Needs I / 32 a multiple of the warps (the tiny geometry keeps the fragment order).
constexpr bool kDownRows = (kExpertWidth / 32) % kWarps == 0;
constexpr int kDownRowPieces = 2 * kDownSteps;  // kDownRows: 16-B copies per lane a step (rows g, g + 8 x chunks)
constexpr int kDownRowStages = kMoeStages * 4 / kDownRowPieces;  // kDownRows: slots in the ring's memory
static_assert(!kDownRows || kDownRowStages >= 2, "MoE down rows: the ring holds fewer than two down steps");
// The k-chunk of this warp's j-th activation piece of a down tile.
__device__ __forceinline__ int down_chunk(int j, int warp) {
  return kDownRows ? kDownSteps * warp + j : warp + kWarps * j;
}
constexpr size_t kMoeSmemBytes = kRingOffset + kRingBytes;

enum StreamKind : int { STREAM_DOWN = 0, STREAM_UP = 1 };
struct MoeStream {  // one lane's view of a task's weight stream: tile i of the block's list, step j of it
  const int* experts;  // shared memory: the expert of each slot (copied once: no global load per issued step)
  const bf16* base;  // up: the layer's gate_up [E, 2I, H]; down: down [E, H, I]
  int kind;          // StreamKind: which weights, and K (H for up, I for down)
  int first, count, steps;  // down: the block's tiles first + i, i < count; steps per tile (this warp)
  uint4* ring;
  int* claimed;   // up: shared memory, the block's i-th claimed tile at [i & (kClaimRing - 1)]; down: null
  int lookahead;  // claims: tiles claimed ahead of the one being multiplied (the ring reaches that far)
  int total;      // tiles of the layer
};
constexpr int kClaimRing = kMoeStages + 2 <= 8 ? 8 : 16;  // a power of two
static_assert(kExperts + kClaimRing <= 2 * 128, "MoE stream: the slots' experts and the claims share GemmSmem.best");

// The tile index of the block's i-th tile, or -1 past its last.
__device__ __forceinline__ int moe_tile_of(const MoeStream& st, int i) {
  if (st.claimed) return st.claimed[i & (kClaimRing - 1)];
  return i < st.count ? st.first + i : -1;
}

// Rows of the tile's two 16-row matrices (A, B) and K, for tile index `tile` of the stream's kind.
__device__ __forceinline__ void moe_tile_rows(const MoeStream& st, int tile, const bf16*& wa, const bf16*& wb) {
  if (st.kind == STREAM_UP) {
    const int slot = tile / kUpTilesPerSlot, ch = tile % kUpTilesPerSlot;
    const bf16* w = st.base + (size_t)st.experts[slot] * 2 * kExpertWidth * kHidden;
    wa = w + (size_t)ch * 16 * kHidden;                   // gate rows
    wb = w + (size_t)(kExpertWidth + ch * 16) * kHidden;  // up rows
  } else {
    const int slot = tile / kDownTilesPerSlot, row0 = (tile % kDownTilesPerSlot) * 32;
    wa = st.base + (size_t)st.experts[slot] * kHidden * kExpertWidth + (size_t)row0 * kExpertWidth;
    wb = wa + (size_t)16 * kExpertWidth;
  }
}

// Issues step q of the lane's stream into ring slot q % kMoeStages (nothing past the end) and commits a group.
__device__ __forceinline__ void moe_issue(const MoeStream& st, int q) {
  const int tile = st.steps > 0 ? moe_tile_of(st, q / st.steps) : -1;
  if (tile >= 0) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int K = st.kind == STREAM_UP ? kHidden : kExpertWidth;
    const int c = warp + kWarps * (q % st.steps);
    const bf16 *wa, *wb;
    moe_tile_rows(st, tile, wa, wb);
    uint4* slot = st.ring + (size_t)(q % kMoeStages) * 4 * kThreads + threadIdx.x;
    const size_t lo = (size_t)g * K + c * 32 + 8 * t, hi = lo + (size_t)8 * K;
    if (kDownRows && st.kind == STREAM_DOWN) {  // step j: matrix j's 16 rows, chunks down_chunk(0 .. kDownSteps)
      const bf16* w = q % st.steps ? wb : wa;
      uint4* row_slot = st.ring + (size_t)(q % kDownRowStages) * kDownRowPieces * kThreads + threadIdx.x;
#pragma unroll
      for (int u = 0; u < kDownSteps; ++u) {
        const size_t lo_u = (size_t)g * K + down_chunk(u, warp) * 32 + 8 * t;
        cp_async16_evict_first(row_slot + 2 * u * kThreads, w + lo_u);
        cp_async16_evict_first(row_slot + (2 * u + 1) * kThreads, w + lo_u + (size_t)8 * K);
      }
    } else if (kUpRowSeg && st.kind == STREAM_UP) {  // step j: matrix j / S, chunks up_chunk(2 (j % S)) and the next
      const int j = q % st.steps;
      const bf16* w = j < kRowSegSteps ? wa : wb;
      const size_t lo0 = (size_t)g * K + up_chunk(2 * (j % kRowSegSteps), warp) * 32 + 8 * t, hi0 = lo0 + (size_t)8 * K;
      cp_async16_evict_first(slot, w + lo0);
      cp_async16_evict_first(slot + kThreads, w + hi0);
      cp_async16_evict_first(slot + 2 * kThreads, w + lo0 + 32);
      cp_async16_evict_first(slot + 3 * kThreads, w + hi0 + 32);
    } else {
      cp_async16_evict_first(slot, wa + lo);
      cp_async16_evict_first(slot + kThreads, wa + hi);
      cp_async16_evict_first(slot + 2 * kThreads, wb + lo);
      cp_async16_evict_first(slot + 3 * kThreads, wb + hi);
    }
  }
  asm volatile("cp.async.commit_group;");
}

// Multiplies tile i of the stream: acc[0] += A x act, acc[1] += B x act over this warp's chunks (the activation
// fragments in xa), kMoeStages steps in flight: the lane-private ring refills the slot it has just read with the
// step kMoeStages ahead.
template <int kSteps, bool kRowSeg = false>  // kRowSeg: kUpRowSeg's up steps (step j feeds matrix j / S)
__device__ __forceinline__ void moe_tile_product(const MoeStream& st, int i, const uint4 (&xa)[kSteps], float (&acc)[2][4]) {
#pragma unroll
  for (int n = 0; n < 2; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
#pragma unroll
  for (int j = 0; j < kSteps; ++j) {
    if (j < st.steps) {
      const int q = i * st.steps + j;
      asm volatile("cp.async.wait_group %0;" ::"n"(kMoeStages - 1) : "memory");
      const uint4* slot = st.ring + (size_t)(q % kMoeStages) * 4 * kThreads + threadIdx.x;
      const uint4 a_lo = slot[0], a_hi = slot[kThreads], b_lo = slot[2 * kThreads], b_hi = slot[3 * kThreads];
      if constexpr (kRowSeg) {  // rows g, g + 8 of one matrix at two chunks (xa's pieces 2 (j % S), + 1)
        mma_piece(acc[j / kRowSegSteps], a_lo, a_hi, xa[2 * (j % kRowSegSteps)]);
        mma_piece(acc[j / kRowSegSteps], b_lo, b_hi, xa[2 * (j % kRowSegSteps) + 1]);
      } else {
        mma_piece(acc[0], a_lo, a_hi, xa[j]);
        mma_piece(acc[1], b_lo, b_hi, xa[j]);
      }
      moe_issue(st, q + kMoeStages);
    }
  }
}

// kDownRows' tile product: step j (matrix j) from its 24-KB slot, kDownRowStages steps in flight.
__device__ __forceinline__ void moe_down_rows_product(const MoeStream& st, int i, const uint4 (&xa)[kDownSteps],
                                                      float (&acc)[2][4]) {
#pragma unroll
  for (int n = 0; n < 2; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int q = i * 2 + j;
    asm volatile("cp.async.wait_group %0;" ::"n"(kDownRowStages - 1) : "memory");
    const uint4* slot = st.ring + (size_t)(q % kDownRowStages) * kDownRowPieces * kThreads + threadIdx.x;
#pragma unroll
    for (int u = 0; u < kDownSteps; ++u) mma_piece(acc[j], slot[2 * u * kThreads], slot[(2 * u + 1) * kThreads], xa[u]);
    moe_issue(st, q + kDownRowStages);
  }
}

// Issues the stream's first steps, as many as its ring holds (before any wait where the weights are known). Not
// unrolled: unrolled, ptxas 13.0 put the L2-policy descriptor of the tiny build's down-stream copies in an odd
// uniform register, which the GPU refuses (an illegal instruction; the compile test reads every build for it).
__device__ __forceinline__ void stream_prologue(const MoeStream& st) {
  const int stages = kDownRows && st.kind == STREAM_DOWN ? kDownRowStages : kMoeStages;
#pragma unroll 1
  for (int q = 0; q < stages; ++q) moe_issue(st, q);
}

__device__ MoeStream moe_stream(const Params& p, const Task& t, unsigned char* smem, bool up) {
  const int warp = threadIdx.x >> 5, nchunk = (up ? kHidden : kExpertWidth) / 32;
  const int slots = __ldcg(p.moe_slots), blocks = p.num_blocks;
  const int rank = blockIdx.x;
  int* experts = reinterpret_cast<int*>(reinterpret_cast<GemmSmem*>(smem)->best);  // 256 ints >= kExperts
  // up: the block's first `lookahead` tiles claimed from the layer's counter, the atomic in flight with the slots'
  // load; the ring reaches `lookahead` - 1 tiles ahead of the one multiplied
  const bool claimer = up && rank < blocks - t.arg[0];
  const int min_steps = max(1, nchunk / kWarps), lookahead = (kMoeStages + min_steps - 1) / min_steps + 1;
  unsigned claim_base = 0;
  if (claimer && threadIdx.x == 0) claim_base = atomicAdd(p.counters + t.arg[2], (unsigned)lookahead);
  __syncthreads();  // the previous user of this memory is done
  for (int i = threadIdx.x; i < slots; i += kThreads) experts[i] = __ldcg(p.moe_slots + 1 + i);
  if (up && threadIdx.x == 0) {
    const int total = slots * kUpTilesPerSlot, base = claimer ? (int)claim_base : total;
    for (int j = 0; j < lookahead; ++j) experts[kExperts + j] = base + j < total ? base + j : -1;
  }
  __syncthreads();
  MoeStream st{experts, layer_ptr(p, t.layer, up ? LP_EXPERT_GATE_UP : LP_EXPERT_DOWN), up ? STREAM_UP : STREAM_DOWN,
               0, 0,
               warp < nchunk ? (nchunk - warp + kWarps - 1) / kWarps : 0,
               reinterpret_cast<uint4*>(smem + kRingOffset), nullptr, lookahead, slots * kUpTilesPerSlot};
  static_assert(kMoeStages + 2 <= kClaimRing, "claims: tiles i .. i + lookahead (<= kMoeStages + 1) fit the ring");
  if (kDownRows && !up) st.steps = 2;  // one step a matrix (every warp has chunks in both)
  if (up) {
    st.claimed = experts + kExperts;
  } else {  // contiguous
    const int total = slots * kDownTilesPerSlot;
    st.first = (int)((long long)total * rank / blocks);
    st.count = (int)((long long)total * (rank + 1) / blocks) - st.first;
  }
  stream_prologue(st);  // the stream's first steps
  return st;
}

__device__ void task_moe_up(const Params& p, const Task& t, unsigned char* smem) {
  GemmSmem& s = *reinterpret_cast<GemmSmem*>(smem);
  const MoeStream st = moe_stream(p, t, smem, true);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
  uint4 xa[kUpSteps];  // this lane's pieces of h row g at its warp's chunks (the same for every tile)
#pragma unroll
  for (int j = 0; j < kUpSteps; ++j)
    xa[j] = g < p.batch_size && j < st.steps
                ? load_act16(p.h + (size_t)g * kHidden + up_chunk(j, warp) * 32 + 8 * tq)
                : make_uint4(0, 0, 0, 0);
  for (int i = 0;; ++i) {
    const int tile = moe_tile_of(st, i);
    if (tile < 0) break;
    // tile i + lookahead, claimed now and written after the product (the atomic's round trip hides behind it); the
    // ring first needs it during tile i + 1, after the reduction's barrier
    const bool claiming = threadIdx.x == 0;
    unsigned claim = 0;
    if (claiming) claim = atomicAdd(p.counters + t.arg[2], 1u);
    float acc[2][4];
    moe_tile_product<kUpSteps, kUpRowSeg>(st, i, xa, acc);
    if (claiming) st.claimed[(i + st.lookahead) & (kClaimRing - 1)] = (int)claim < st.total ? (int)claim : -1;
    reduce_warps<2>(acc, s.red, s.out);
    const int slot = tile / kUpTilesPerSlot, ch = tile % kUpTilesPerSlot;
    const int r = threadIdx.x >> 3, b = threadIdx.x & 7;
    if (threadIdx.x < 128 && b < p.batch_size) {
      const float act = bf16_round(silu_bf16(bf16_round(s.out[threadIdx.x])) * bf16_round(s.out[128 + threadIdx.x]));
      p.moe_act[((size_t)slot * kMaxBatch + b) * kExpertWidth + ch * 16 + r] = __float2bfloat16_rn(act);
    }
    signal_counter(p, t.arg[1] + slot);
  }
  asm volatile("cp.async.wait_group 0;" ::: "memory");  // no copy outlives the task (the next reuses the memory)
  __syncthreads();
}

__device__ void task_moe_down(const Params& p, const Task& t, unsigned char* smem) {
  GemmSmem& s = *reinterpret_cast<GemmSmem*>(smem);
  const MoeStream st = moe_stream(p, t, smem, false);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
  uint4 xa[kDownSteps];
  float weight = 0.f;
  int loaded = -1;  // the slot whose activation rows xa holds
  for (int i = 0; i < st.count; ++i) {
    const int tile = moe_tile_of(st, i), slot = tile / kDownTilesPerSlot, row0 = (tile % kDownTilesPerSlot) * 32;
    if (slot != loaded) {
      wait_counter(p, t.arg[1] + slot, kUpTilesPerSlot);
      const bf16* act = p.moe_act + (size_t)slot * kMaxBatch * kExpertWidth;
#pragma unroll
      for (int j = 0; j < kDownSteps; ++j)
        xa[j] = g < p.batch_size && (kDownRows || j < st.steps)
                    ? load_act16(act + (size_t)g * kExpertWidth + down_chunk(j, warp) * 32 + 8 * tq)
                    : make_uint4(0, 0, 0, 0);
      weight = (threadIdx.x & 7) < p.batch_size ? __ldcg(p.slot_weight + slot * kMaxBatch + (threadIdx.x & 7)) : 0.f;
      loaded = slot;
    }
    float acc[2][4];
    if constexpr (kDownRows)
      moe_down_rows_product(st, i, xa, acc);
    else
      moe_tile_product<kDownSteps>(st, i, xa, acc);
    reduce_warps<2>(acc, s.red, s.out);
    const int n = threadIdx.x >> 7, r = (threadIdx.x >> 3) & 15, b = threadIdx.x & 7;
    if (weight != 0.f)
      atomicAdd(p.x + (size_t)b * kHidden + row0 + n * 16 + r,
                bf16_round(bf16_round(s.out[threadIdx.x]) * weight));
  }
  asm volatile("cp.async.wait_group 0;" ::: "memory");
  __syncthreads();
}

// ====  12. Tasks: DENSE_UP and DENSE_DOWN  =====================================================
//   The dense layer's SwiGLU: up tiles (16 channels of gate and up, K = H) -> dense_act; down tiles
//   (32 rows of H, K = I_dense) -> x += bf16(result).
__device__ void task_dense_up(const Params& p, const Task& t, unsigned char* smem) {
  GemmSmem& s = *reinterpret_cast<GemmSmem*>(smem);
  for (int tile = t.arg[0]; tile < t.arg[0] + t.arg[1]; ++tile) {
    const bf16* tiles[2] = {layer_ptr(p, t.layer, LP_GATE) + (size_t)tile * 16 * kHidden,
                            layer_ptr(p, t.layer, LP_UP) + (size_t)tile * 16 * kHidden};
    const int valid[2] = {16, 16};
    mma_tiles<2>(tiles, valid, kHidden, p.h, kHidden, p.batch_size, s.red, s.out);
    const int i = threadIdx.x, r = i >> 3, b = i & 7;
    if (i < 128 && b < p.batch_size) {
      const float act = bf16_round(silu_bf16(bf16_round(s.out[i])) * bf16_round(s.out[128 + i]));
      p.dense_act[(size_t)b * kDenseWidth + tile * 16 + r] = __float2bfloat16_rn(act);
    }
  }
}

__device__ void task_dense_down(const Params& p, const Task& t, unsigned char* smem) {
  GemmSmem& s = *reinterpret_cast<GemmSmem*>(smem);
  for (int tile = t.arg[0]; tile < t.arg[0] + t.arg[1]; ++tile) {
    const bf16* w = layer_ptr(p, t.layer, LP_DOWN) + (size_t)tile * 32 * kDenseWidth;
    const bf16* tiles[2] = {w, w + 16 * kDenseWidth};
    const int valid[2] = {16, 16};
    mma_tiles<2>(tiles, valid, kDenseWidth, p.dense_act, kDenseWidth, p.batch_size, s.red, s.out);
    const int i = threadIdx.x, n = i >> 7, r = (i >> 3) & 15, b = i & 7;
    if (b < p.batch_size)
      atomicAdd(p.x + (size_t)b * kHidden + tile * 32 + n * 16 + r, bf16_round(s.out[i]));
  }
}

// ====  13. Task: LM_HEAD  ======================================================================
//   32-row tiles of the (tied) LM head over the final-normed h: logits[b][v] = logit_scale * dot.
//   Also keeps, per row, the task's best logit (greedy) and best logit/T + Gumbel noise (sampling
//   without filters) in lm_partial, so SAMPLE needs no pass over the vocabulary on those paths.
//   A row with a mask slot is masked by SAMPLE, whose mask may still be on its way: its sampled logits/T +
//   Gumbel go to noisy as well, for SAMPLE's masked argmax.
__device__ void task_lm_head(const Params& p, const Task& t, unsigned char* smem) {
  GemmSmem& s = *reinterpret_cast<GemmSmem*>(smem);
  const int i = threadIdx.x, n = i >> 7, r = (i >> 3) & 15, b = i & 7;
  const bool live = b < p.batch_size;
  RowState rs{};
  if (live) rs = p.rows[b];
  float* noisy_row = live && rs.mask && rs.temperature > 0.f ? p.noisy + (size_t)b * kVocab : nullptr;
  ArgMax greedy{-INFINITY, 1 << 30}, noisy{-INFINITY, 1 << 30};
  for (int tile = t.arg[0]; tile < t.arg[0] + t.arg[1]; ++tile) {
    const int row0 = tile * 32;
    const bf16* tiles[2] = {p.lm_head + (size_t)min(row0, kVocab - 1) * kHidden,
                            p.lm_head + (size_t)min(row0 + 16, kVocab - 1) * kHidden};
    const int valid[2] = {max(1, min(16, kVocab - row0)), max(1, min(16, kVocab - row0 - 16))};
    mma_tiles<2>(tiles, valid, kHidden, p.h, kHidden, p.batch_size, s.red, s.out);
    const int v = row0 + n * 16 + r;
    if (live && v < kVocab) {
      const float logit = s.out[i] * p.logit_scale;
      p.logits[(size_t)b * kVocab + v] = logit;
      greedy = better(greedy, ArgMax{logit, v});
      if (rs.temperature > 0.f) {
        const float z = logit / rs.temperature + gumbel_noise(rs.seed, rs.step, v);
        noisy = better(noisy, ArgMax{z, v});
        if (noisy_row) noisy_row[v] = z;
      }
    }
  }
  for (int pass = 0; pass < 2; ++pass) {  // reduce the 32 threads of each row b, greedy then noisy
    if (n == 0) s.best[i] = pass == 0 ? greedy : noisy;
    __syncthreads();
    if (n == 1) s.best[i - 128] = better(s.best[i - 128], pass == 0 ? greedy : noisy);
    __syncthreads();
    if (i < 8 && i < p.batch_size) {
      ArgMax best = s.best[i];
      for (int rr = 1; rr < 16; ++rr) best = better(best, s.best[rr * 8 + i]);
      float* out = p.lm_partial + ((size_t)t.arg[2] * kMaxBatch + i) * 4 + pass * 2;
      out[0] = best.value;
      out[1] = __int_as_float(best.index);
    }
    __syncthreads();
  }
}

// ====  14. Task: SAMPLE  =======================================================================
//   One row's next token. Greedy (temperature <= 0) and plain temperature sampling reduce the LM
//   head's partials. With top-k / top-p / min-p the block finds the smallest kept logit tau by
//   radix selection over the row's logits (top-k: k-th largest; min-p: max + T ln(min_p); top-p:
//   smallest prefix of the sorted kept tokens whose probability reaches p), then draws
//   argmax(logit/T + Gumbel) over the logits >= tau: an exact sample of the filtered softmax.
//   A row with a mask slot first waits for the host to release it for this step (thread 0 spins as
//   wait_counter does: the step's timeout, then status MASK_TIMEOUT) and copies the mask into shared
//   memory. Where it applies (trigger -1, or the token the row fed: tokens[b], written only at this task's
//   end) one pass sets the forbidden logits to -inf (the host and the filters see the masked row) and,
//   unfiltered, takes the argmax of the allowed logits (greedy) or of LM_HEAD's noisy copy (sampled): the
//   token masked partials would give. Where it does not, a row with a dormant rule is masked the same way by
//   the text mask plus its trigger (copied from device memory); elsewhere the row samples unconstrained.
constexpr int kMaskNone = 0, kMaskSlot = 1, kMaskText = 2;  // SampleSmem.mask_on: which mask applies to the row
struct SampleSmem {
  float hist_mass[256];
  unsigned hist_count[256];
  float scratch[kWarps];
  ArgMax best[kWarps];
  unsigned chosen;
  float remaining;
  int mask_on;                   // kMaskNone, kMaskSlot (the slot's words apply) or kMaskText (the dormant rule)
  int mask_trigger;              // kMaskText: the token allowed besides the text tokens
  uint4 mask[kMaskWords / 4];    // the words that apply, copied from the slot or the text mask
};

__device__ __forceinline__ unsigned order_key(float f) {  // monotonic float -> uint32
  const unsigned u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float key_value(unsigned k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// The key kappa where the (count or mass) from the top first reaches `target`, among keys >= floor.
__device__ unsigned radix_select(const float* row, float inv_t, float max_scaled, unsigned floor, float target,
                                 bool by_mass, SampleSmem& s) {
  unsigned prefix = 0, mask = 0;
  float remaining = target;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int d = threadIdx.x; d < 256; d += kThreads) { s.hist_mass[d] = 0.f; s.hist_count[d] = 0; }
    __syncthreads();
    for (int v = threadIdx.x; v < kVocab; v += kThreads) {
      const float sc = __ldcg(row + v) * inv_t;
      const unsigned key = order_key(sc);
      if (key >= floor && (key & mask) == prefix) {
        const int d = (key >> shift) & 255;
        if (by_mass) atomicAdd(&s.hist_mass[d], __expf(sc - max_scaled));
        else atomicAdd(&s.hist_count[d], 1u);
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      float cum = 0.f;
      int chosen = -1, lowest = 0;
      for (int d = 255; d >= 0; --d) {
        const float here = by_mass ? s.hist_mass[d] : (float)s.hist_count[d];
        if (here > 0.f) lowest = d;
        if (here > 0.f && cum + here >= remaining) { chosen = d; break; }
        cum += here;
      }
      if (chosen < 0) { chosen = lowest; cum = 0.f; }  // rounding left the target unreached
      s.chosen = (unsigned)chosen;
      s.remaining = remaining - cum;
    }
    __syncthreads();
    prefix |= s.chosen << shift;
    mask |= 255u << shift;
    remaining = s.remaining;
    __syncthreads();
  }
  return prefix;
}

// Waits until the host released row b's slot for this step (or the step failed), then copies the mask that
// applies into shared memory: the slot's words, or a dormant rule's text mask with its trigger's bit; true when
// one applies. Every thread acquires the slot itself before it reads the words.
__device__ bool fetch_mask(const Params& p, const RowState& rs, int b, SampleSmem& s) {
  if (threadIdx.x == 0) {
    const long long start = global_ns();
    int on = kMaskNone, dormant = -1;
    for (;;) {
      if (load_acquire_sys(&rs.mask->ready) == (unsigned)rs.mask_seq) {
        const int trigger = (int)load_acquire_sys(reinterpret_cast<const unsigned*>(&rs.mask->trigger));
        dormant = (int)load_acquire_sys(reinterpret_cast<const unsigned*>(&rs.mask->dormant));
        if (trigger == -1 || (trigger >= 0 && trigger == p.tokens[b])) on = kMaskSlot;
        else if (dormant >= 0 && dormant < kVocab && p.text_mask != nullptr) on = kMaskText;
        break;
      }
      if (*(volatile int*)p.status != 0) break;
      if (global_ns() - start > p.timeout_ns) { report(p, NC_ERR_MASK_TIMEOUT, b, rs.mask_seq); break; }
      __nanosleep(128);
    }
    s.mask_on = on;
    s.mask_trigger = dormant;
  }
  __syncthreads();
  const int on = s.mask_on;
  if (on == kMaskNone) return false;
  load_acquire_sys(&rs.mask->ready);  // released already: it orders this thread's loads below after the host's writes
  const unsigned* source = on == kMaskSlot ? rs.mask->words : p.text_mask;
  constexpr int kVecs = kMaskWords / 4, kPerThread = (kVecs + kThreads - 1) / kThreads;
  uint4 words[kPerThread];  // every load in flight before the first store: one round trip (to host memory: the slot)
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const int w = threadIdx.x + j * kThreads;
    if (w < kVecs) words[j] = load_relaxed_sys16(source + 4 * w);
  }
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const int w = threadIdx.x + j * kThreads;
    if (w < kVecs) s.mask[w] = words[j];
  }
  __syncthreads();
  if (on == kMaskText) {  // the dormant rule's trigger, besides the text tokens
    if (threadIdx.x == 0) reinterpret_cast<unsigned*>(s.mask)[s.mask_trigger >> 5] |= 1u << (s.mask_trigger & 31);
    __syncthreads();
  }
  return true;
}

// A masked row's pass: forbidden logits to -inf; unfiltered, this thread's best allowed logit (greedy) or noisy.
__device__ ArgMax mask_row(const Params& p, int b, bool greedy, bool filtered, const SampleSmem& s) {
  float* row = p.logits + (size_t)b * kVocab;
  const float* noisy = p.noisy + (size_t)b * kVocab;
  const unsigned* words = reinterpret_cast<const unsigned*>(s.mask);
  ArgMax best{-INFINITY, 1 << 30};
#pragma unroll 8
  for (int v = threadIdx.x; v < kVocab; v += kThreads) {
    const bool allowed = (words[v >> 5] >> (v & 31)) & 1u;
    if (!allowed) row[v] = -INFINITY;
    if (!filtered) best = better(best, ArgMax{allowed ? __ldcg(greedy ? row + v : noisy + v) : -INFINITY, v});
  }
  return best;
}

__device__ void task_sample(const Params& p, const Task& t, unsigned char* smem) {
  SampleSmem& s = *reinterpret_cast<SampleSmem*>(smem);
  const int b = t.arg[0], num_lm = t.arg[1];
  const RowState rs = p.rows[b];
  const bool greedy = rs.temperature <= 0.f;
  const bool filtered = !greedy && (rs.top_k > 0 || rs.top_p < 1.f || rs.min_p > 0.f);
  if (rs.mask != nullptr && fetch_mask(p, rs, b, s)) {
    const ArgMax mine = mask_row(p, b, greedy, filtered, s);
    if (!filtered) {
      const ArgMax best = block_argmax(mine, s.best);
      if (threadIdx.x == 0) p.tokens[b] = best.index;
      return;
    }
    __syncthreads();  // every -inf written before the filters read the row
  } else if (!filtered) {  // reduce the LM head's partials
    ArgMax best{-INFINITY, 1 << 30};
    for (int j = threadIdx.x; j < num_lm; j += kThreads) {
      const float* part = p.lm_partial + ((size_t)j * kMaxBatch + b) * 4 + (greedy ? 0 : 2);
      best = better(best, ArgMax{__ldcg(part), __float_as_int(__ldcg(part + 1))});
    }
    best = block_argmax(best, s.best);
    if (threadIdx.x == 0) p.tokens[b] = best.index;
    return;
  }
  const float* row = p.logits + (size_t)b * kVocab;
  const float inv_t = 1.f / rs.temperature;
  float m = -INFINITY;
  for (int v = threadIdx.x; v < kVocab; v += kThreads) m = fmaxf(m, __ldcg(row + v) * inv_t);
  const float max_scaled = block_max(m, s.scratch);
  unsigned floor = 0;  // the order key of the smallest kept scaled logit; filters apply in vLLM's order
  if (rs.top_k > 0 && rs.top_k < kVocab)
    floor = radix_select(row, inv_t, max_scaled, 0, (float)rs.top_k, false, s);
  if (rs.top_p < 1.f) {  // mass of the top-k survivors (before min-p, as sampling.filter_probs)
    float z = 0.f;
    for (int v = threadIdx.x; v < kVocab; v += kThreads) {
      const float sc = __ldcg(row + v) * inv_t;
      if (order_key(sc) >= floor) z += __expf(sc - max_scaled);
    }
    z = block_sum(z, s.scratch);
    floor = max(floor, radix_select(row, inv_t, max_scaled, floor, rs.top_p * z, true, s));
  }
  if (rs.min_p > 0.f) floor = max(floor, order_key(max_scaled + logf(rs.min_p)));  // p >= min_p * p_max
  ArgMax best{-INFINITY, 1 << 30};
  for (int v = threadIdx.x; v < kVocab; v += kThreads) {
    const float sc = __ldcg(row + v) * inv_t;
    if (order_key(sc) >= floor) best = better(best, ArgMax{sc + gumbel_noise(rs.seed, rs.step, v), v});
  }
  best = block_argmax(best, s.best);
  if (threadIdx.x == 0) p.tokens[b] = best.index;
}

// ====  15. Dispatcher  =========================================================================
//   One block per SM walks tasks[task_start[block] .. task_start[block+1]): start the task's first
//   loads (into L2, or its ring), wait, compute, signal. An aborted step (status != 0) skips the compute.
__device__ void prefetch_task_weights(const Params& p, const Task& t) {
  const bf16* w = nullptr;
  size_t bytes = 0;
  if (t.type == TASK_QKV) {
    const int R = t.arg[0] * 16;
    w = R < kQSize ? layer_ptr(p, t.layer, LP_Q) + (size_t)R * kHidden
      : R < kQSize + kKvSize ? layer_ptr(p, t.layer, LP_K) + (size_t)(R - kQSize) * kHidden
                             : layer_ptr(p, t.layer, LP_V) + (size_t)(R - kQSize - kKvSize) * kHidden;
    bytes = (size_t)16 * kHidden * 2;  // the first tile (a task's tiles can straddle q/k/v)
  } else if (t.type == TASK_DENSE_UP) {
    w = layer_ptr(p, t.layer, LP_GATE) + (size_t)t.arg[0] * 16 * kHidden;
    bytes = (size_t)t.arg[1] * 16 * kHidden * 2;
    const bf16* up = layer_ptr(p, t.layer, LP_UP) + (size_t)t.arg[0] * 16 * kHidden;
    for (size_t off = threadIdx.x * 128; off < bytes; off += kThreads * 128)
      prefetch_l2(reinterpret_cast<const char*>(up) + off);
  } else if (t.type == TASK_LM_HEAD) {
    w = p.lm_head + (size_t)t.arg[0] * 32 * kHidden;
    bytes = (size_t)min(t.arg[1] * 32, kVocab - t.arg[0] * 32) * kHidden * 2;
  } else if (t.type == TASK_DENSE_DOWN) {
    w = layer_ptr(p, t.layer, LP_DOWN) + (size_t)t.arg[0] * 32 * kDenseWidth;
    bytes = (size_t)t.arg[1] * 32 * kDenseWidth * 2;
  }
  if (w == nullptr) return;
  bytes = min(bytes, (size_t)256 * 1024);
  for (size_t off = threadIdx.x * 128; off < bytes; off += kThreads * 128)
    prefetch_l2(reinterpret_cast<const char*>(w) + off);
}

// The next task's record is copied into the other half of a two-record buffer while this task runs (cp.async by 4
// threads; tasks drain their own copies, so the record's group is the only one left at the loop's top) instead
// of being loaded when the task starts (that load was ~0.8 us from one task's end to the next one's start). The
// task then copies it into registers: tasks that read their record from shared memory ran o_proj slower.
__device__ __forceinline__ void copy_task_record(const Params& p, int i, Task* slot) {
  if (threadIdx.x < 4) {
    cp_async16(reinterpret_cast<unsigned char*>(slot) + 16 * threadIdx.x,
               reinterpret_cast<const unsigned char*>(p.tasks + i) + 16 * threadIdx.x);
    asm volatile("cp.async.commit_group;");
  }
}

__global__ void __launch_bounds__(kThreads, 1) nc_decode_kernel(const __grid_constant__ Params p) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ int aborted;  // one thread reads the status, so that the whole block takes the same branch
  __shared__ __align__(16) Task task[2];  // this task's record and the next one's
  if (p.task_start[blockIdx.x] < p.task_start[blockIdx.x + 1])
    copy_task_record(p, p.task_start[blockIdx.x], &task[p.task_start[blockIdx.x] & 1]);
  for (int i = p.task_start[blockIdx.x]; i < p.task_start[blockIdx.x + 1]; ++i) {
    if (threadIdx.x < 4) asm volatile("cp.async.wait_all;" ::: "memory");  // this task's record
    __syncthreads();
    const Task t = task[i & 1];
    if (i + 1 < p.task_start[blockIdx.x + 1]) copy_task_record(p, i + 1, &task[(i + 1) & 1]);  // read above, by all
    if (threadIdx.x == 0 && p.profile) p.profile[3 * i] = global_ns();
    // before the wait: the KV pages that do not depend on this step, o_proj's first ring steps, the router tile's
    // weight; the other tasks' first weights into L2 (the next task's too, queued up to 256 KB of prefetches a
    // block in front of the critical path's loads: 5% slower at B = 1)
    if (t.type == TASK_ATTN) attn_preload(p, t, smem);
    else if (t.type == TASK_OPROJ) oproj_prologue(p, t, smem);
    else if (t.type == TASK_ROUTER) router_prologue(p, t, smem);
    else prefetch_task_weights(p, t);
    // The status load goes out with the wait's first counter load instead of after it (one round trip less per task
    // where the dependency is met, ~0.7 us). A failure that comes during the wait then stops the block's next task,
    // not this one, which runs on whatever its inputs hold (indices stay in range: expert ids and slot counts are
    // the previous step's or the new ones, pages are checked).
    int status = 0;
    if (threadIdx.x == 0) status = *(volatile int*)p.status;
    wait_counter(p, t.wait[0], t.target[0]);
    wait_counter(p, t.wait[1], t.target[1]);
    if (threadIdx.x == 0) aborted = status;
    if (threadIdx.x == 0 && p.profile) p.profile[3 * i + 1] = global_ns();
    __syncthreads();
    if (!aborted) {
      switch (t.type) {
        case TASK_STOP: break;
        case TASK_NORM: task_norm(p, t, smem); break;
        case TASK_QKV: task_qkv(p, t, smem); break;
        case TASK_ATTN: task_attn(p, t, smem); break;
        case TASK_COMBINE: task_combine(p, t, smem); break;
        case TASK_OPROJ: task_oproj(p, t, smem); break;
        case TASK_ROUTER: task_router(p, t, smem); break;
        case TASK_TOPK: task_topk(p, t, smem); break;
        case TASK_MOE_UP: task_moe_up(p, t, smem); break;
        case TASK_MOE_DOWN: task_moe_down(p, t, smem); break;
        case TASK_DENSE_UP: task_dense_up(p, t, smem); break;
        case TASK_DENSE_DOWN: task_dense_down(p, t, smem); break;
        case TASK_LM_HEAD: task_lm_head(p, t, smem); break;
        case TASK_SAMPLE: task_sample(p, t, smem); break;
        default: if (threadIdx.x == 0) report(p, NC_ERR_BAD_TASK, i, t.type);
      }
    } else {
      asm volatile("cp.async.wait_group 0;" ::: "memory");  // copies issued before the wait (a skipped task's)
    }
    signal_counter(p, t.signal);
    if (threadIdx.x == 0 && p.profile) p.profile[3 * i + 2] = global_ns();
  }
}

// Dynamic shared memory of a launch: the largest task layout.
constexpr size_t size_max(size_t a, size_t b) { return a > b ? a : b; }
constexpr size_t kSmemBytes = size_max(size_max(kMoeSmemBytes, sizeof(TopkSmem)),
                                       size_max(sizeof(SampleSmem), sizeof(AttnSmem)));

// ====  16. C ABI  ==============================================================================
static char g_last_error[512] = "";

static int fail(const char* what, cudaError_t err) {
  snprintf(g_last_error, sizeof(g_last_error), "%s: %s (%s)", what, cudaGetErrorString(err), cudaGetErrorName(err));
  return -1;
}

// The ABI version this library was built with (megakernel.py refuses a mismatch).
extern "C" int nc_abi_version(void) { return NC_ABI_VERSION; }
// sizeof(Params), sizeof(Task), sizeof(RowState): megakernel.py checks its ctypes mirrors.
extern "C" int nc_params_size(void) { return (int)sizeof(Params); }
extern "C" int nc_task_size(void) { return (int)sizeof(Task); }
extern "C" int nc_row_size(void) { return (int)sizeof(RowState); }
// sizeof(MaskSlot): megakernel.py lays its slots out with it.
extern "C" int nc_mask_slot_size(void) { return (int)sizeof(MaskSlot); }
// Writes the compile-time geometry into out[0..n) (order: megakernel.py GEOMETRY_FIELDS); returns the count.
extern "C" int nc_geometry(int* out, int n) {
  const int g[] = {kHidden, kHeads, kKvHeads, kHeadDim, kVocab, kExperts, kTopK, kExpertWidth,
                   kDenseWidth, kMaxBatch, kMaxSplits, NC_RMS_NORM, NC_SELECT_SIGMOID, NC_NORM_TOPK};
  const int count = (int)(sizeof(g) / sizeof(g[0]));
  for (int i = 0; i < n && i < count; ++i) out[i] = g[i];
  return count;
}
// The last error's message (static storage; valid until the next failing call).
extern "C" const char* nc_last_error(void) { return g_last_error; }

// Raises one kernel's shared-memory limit and checks it can be resident; 0 ok, -1 error (nc_last_error).
static int init_kernel(const void* kernel, int bytes, const char* name) {
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err != cudaSuccess) return fail("cudaFuncSetAttribute", err);
  int blocks = 0;
  err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kThreads, bytes);
  if (err != cudaSuccess) return fail("cudaOccupancyMaxActiveBlocksPerMultiprocessor", err);
  if (blocks < 1) {
    snprintf(g_last_error, sizeof(g_last_error), "the %s kernel cannot be resident (0 blocks per SM)", name);
    return -1;
  }
  return 0;
}

// The device address of pinned host memory at `host` (what a RowState's mask points to); 0 ok, -1 error (memory
// that is not pinned, or not mapped).
extern "C" int nc_host_device_pointer(void* host, void** device) {
  cudaError_t err = cudaHostGetDevicePointer(device, host, 0);
  return err == cudaSuccess ? 0 : fail("cudaHostGetDevicePointer(mask slots)", err);
}

// Releases a mask slot the host has written: a full fence (the words and the trigger are visible before it),
// then slot->ready = seq, which the step's SAMPLE waits for. Always 0.
extern "C" int nc_release_mask(MaskSlot* slot, unsigned seq) {
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  __atomic_store_n(&slot->ready, seq, __ATOMIC_RELEASE);
  return 0;
}

// Prepares the kernel for its largest launch; 0 ok, -1 error (see nc_last_error).
extern "C" int nc_init(void) {
  return init_kernel((const void*)nc_decode_kernel, (int)kSmemBytes, "decode");
}

// Zeroes the counters and launches one decode step on `stream` (a cudaStream_t); returns at once.
// 0 ok, -1 error. Device-side failures (timeouts, bad pages or tokens) land in p->status.
extern "C" int nc_decode_step(const Params* p, void* stream) {
  if (p == nullptr || p->num_blocks <= 0 || p->batch_size <= 0 || p->batch_size > kMaxBatch) {
    snprintf(g_last_error, sizeof(g_last_error), "nc_decode_step: bad params (num_blocks %d, batch_size %d)",
             p ? p->num_blocks : -1, p ? p->batch_size : -1);
    return -1;
  }
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  cudaError_t err = cudaMemsetAsync(p->counters, 0, sizeof(unsigned) * (size_t)p->num_counters, s);
  if (err != cudaSuccess) return fail("cudaMemsetAsync(counters)", err);
  nc_decode_kernel<<<p->num_blocks, kThreads, (int)kSmemBytes, s>>>(*p);
  err = cudaGetLastError();
  if (err != cudaSuccess) return fail("nc_decode_kernel launch", err);
  return 0;
}
