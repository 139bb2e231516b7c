// ====  0. Header  ==============================================================================
//   A timing prototype of the v2 decode step (issue 20): does a producer warp that streams every
//   weight tile and KV page with TMA into a deep shared-memory ring, ahead of the dependency waits,
//   keep HBM busy through a whole North Mini Code step? The real dependency graph of a layer is
//   here (norm -> QKV, router -> top-k -> expert up -> down; QKV -> attention -> split merge ->
//   o_proj; x_{l+1} = x_l + attention + MoE), with real bytes and real products, but the math is
//   only as faithful as timing needs: no RoPE, no K/V append, sigmoid routing without its tests.
//   Standalone: `nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -o stream_step stream_step.cu -lcuda`,
//   then `./stream_step [B] [context] [steps]`. It prints ms per step, bytes per step, the read
//   bandwidth of a plain copy measured in the same process, and a check of the product core.
//
//   Block = 1 producer warp (lane 0 issues TMA) + 8 consumer warps. Every SM walks its own task list
//   (host-built in dependency waves, round-robin with the cursor carried across waves). Stages are
//   16 KB; the producer waits only for a free stage, and for top-k before an expert tile (which
//   expert is known on the device only), so weights of later tasks land while consumers wait.
//   Products: mma.sync m16n8k16 with the batch as A (rows 0-7, 8-15 zero) and 8 weight rows as B,
//   read by ldmatrix from 128-byte-swizzled TMA boxes of 8 rows x 1024 (or 768) columns.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#define CK(x)                                                                                   \
  do {                                                                                          \
    cudaError_t e_ = (x);                                                                       \
    if (e_ != cudaSuccess) {                                                                    \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));        \
      exit(1);                                                                                  \
    }                                                                                           \
  } while (0)

typedef __nv_bfloat16 bf16;

// ====  1. Geometry and task types  =============================================================
constexpr int H = 2048, HEADS = 32, KVH = 4, HD = 128, QSIZE = HEADS * HD, QKV_ROWS = QSIZE + 2 * KVH * HD;
constexpr int E = 128, TOPK = 8, I = 768, DENSE_I = 3072, VOCAB = 262144, LAYERS = 49, PAGE = 64;
constexpr int WINDOW = 4096, GROUP = HEADS / KVH, MAXB = 8, MAX_SLOTS = 64, MAX_SPLITS = 64;
// RG groups share one reduce: each warp keeps RG groups' partials in registers and the block meets once per RG
// groups, not once per group (its warps then run up to 2 * RG * NK stages apart).
#ifndef RG
#define RG 4
#endif
// ATTN3: the producer reads 8 block-table entries at once.
#ifndef ATTN3
#define ATTN3 1
#endif
// SIGNALLER=1 adds a warp (warp 1) that posts the consumers' completion signals: the consumers hand it the counter
// through a shared-memory queue and go on, and it pays the gpu-scope fence and the atomic.
#ifndef SIGNALLER
#define SIGNALLER 1
#endif
// Warps: 0 the producer, 1 the signaller, 2-3 idle, 4-11 the consumers. The first warpgroup gives registers to the
// consumers' two through setmaxnreg (a block of 9 or 10 warps is allocated as 12 warps: 168 registers a thread).
constexpr int kLowRegs = 40, kHighRegs = 232;  // 4 x 32 x 40 + 8 x 32 x 232 <= 64K
constexpr int kConsumers = 8, kCB = 128, kThreads = kCB + 32 * kConsumers;  // kCB: consumer 0
constexpr int kSig = 8;  // the signal queue's slots
constexpr int kStageBytes = 16384, kMaxStages = 14;
constexpr int kHStride = H + 8;          // bf16, padded: conflict-free A loads
constexpr int kActStride = QSIZE + 8;    // bf16
constexpr int kQStride = HD + 8;

enum TaskType : int { T_END = 0, T_QKV, T_ROUTER, T_TOPK, T_UP, T_DOWN, T_ATTN, T_OPROJ, T_LM, T_DRAIN };
enum MapId : int { M_QKV = 0, M_O, M_ROUTER, M_GATEUP, M_DOWN, M_DGATEUP, M_DDOWN, M_LM, M_K, M_V, NUM_MAPS };

struct Task {  // 16 int32
  int type, layer;
  int a[6];    // per type, below
  int wait, target, signal;
  int pad[5];
};
// T_QKV / T_ROUTER / T_OPROJ / T_LM: a0 first 8-row group, a1 groups
// T_UP / T_DOWN: a0 slot (-1: the dense layer), a1 first group, a2 groups
// T_ATTN: a0 row, a1 kv head, a2 split, a3 splits, a4 sliding
// T_DRAIN: one per SM and layer; claims expert up, expert down and o_proj tiles until none is left

struct Maps { CUtensorMap m[NUM_MAPS]; };

struct Params {
  const Task* tasks; const int* task_start;
  unsigned* counters;      // zeroed per step
  int batch, context;
  const bf16* embed; const bf16* norms;          // [V, H], [L + 1, H]
  const int* tokens; const int* block_tables;    // [B], [L, B, max_pages]
  int max_pages;
  float* x;                // [L + 1, B, H] residuals; x[l + 1] zeroed per step
  bf16* qkv;               // [B, QKV_ROWS]
  float* router;           // [B, E]
  int* slots;              // [L, 1 + MAX_SLOTS]: count, then expert per slot
  float* slot_w;           // [L, MAX_SLOTS, B]
  bf16* moe_act;           // [MAX_SLOTS + 1, B, DENSE_I]  (slot MAX_SLOTS: the dense layer)
  float* part;             // [B, KVH, MAX_SPLITS, GROUP, HD + 2]
  bf16* attn_out;          // [B, QSIZE]
  float* lm_best;          // [num lm tasks, B, 2]
  int* out_tokens;
  int lm_tasks;
  int layers;              // layers run (the timing variants leave some out)
  int no_wait;             // 1: no dependency waits (wrong results; times the streams alone); 2: nor loads (the
                           // producer marks each stage full at once: times the consumers alone)
  long long* profile;      // null, or [tasks][3] ns: consumers' start, dependency met, end
  long long* marks;        // null, or [tasks][kMarks] ns: points inside a task (mark()), 0 where not reached
  long long* clocks;       // block 0's consumer thread 32: clock64 and globaltimer at its start and end
  int up_pairs, down_groups, o_groups;  // the drain's tile sizes
};

// counters: per layer block of kCtrPerLayer
constexpr int C_X = 0, C_QKV = 1, C_ROUTER = 2, C_TOPK = 3, C_ATTN = 4, C_UP = 5;  // C_UP + slot (65 slots)
constexpr int C_SPLIT = C_UP + MAX_SLOTS + 1;                                        // + b * KVH + kvh
constexpr int C_CLAIM = C_SPLIT + MAXB * KVH;                                        // the drain's next tile
constexpr int kCtrPerLayer = C_CLAIM + 1;
constexpr int C_LM = (LAYERS + 1) * kCtrPerLayer;
__host__ __device__ constexpr int ctr(int layer, int which) { return layer * kCtrPerLayer + which; }

// ====  2. Device helpers: mbarriers, TMA, waits, mma  ==========================================
// Watchdog: a wait longer than 2 s writes where it hung into mapped host memory and traps.
struct HangRecord { int flag, block, role, task, type, layer, what, a, b, c; };
__device__ HangRecord* g_hang;
__device__ int g_where[2 * 1024];  // [block][role]: the task index each role is at
// Stall accounting (profile steps only): ns each role spent in a slow wait, by the task type it was in.
// [type][kind]: 0 producer on an empty stage, 1 producer on a counter, 2 consumers on a full stage, 3 consumers on a
// counter, 4 consumers at a group's reduce barrier, 5 producer claiming a drain tile (thread 32 of the consumers
// measures for them).
__device__ int g_type[2 * 1024];   // [block][role]: the type of the task each role is in
// Only a -DSTALLS=1 build keeps the clocks: reading the switch in every wait slows the step by ~5%.
#ifndef STALLS
#define STALLS 0
#endif
__device__ int g_stall_on;
__device__ unsigned long long g_stall[16][6];
__device__ __forceinline__ bool stall_timing() { return STALLS && g_stall_on; }
__device__ __forceinline__ void stall_add(int role, int kind, long long ns) {
  if (stall_timing() && (role == 0 ? threadIdx.x == 0 : threadIdx.x == kCB))
    atomicAdd(&g_stall[g_type[2 * blockIdx.x + role]][kind], (unsigned long long)ns);
}

__device__ __forceinline__ long long global_ns() {
  long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __noinline__ void hang(int role, int what, int a, int b, int c) {
  if (atomicCAS(&g_hang->flag, 0, 1) == 0) {
    const int task = g_where[2 * blockIdx.x + role];
    g_hang->block = blockIdx.x; g_hang->role = role; g_hang->task = task; g_hang->what = what;
    g_hang->a = a; g_hang->b = b; g_hang->c = c;
    __threadfence_system();
  }
  asm volatile("trap;");
}

__device__ __forceinline__ unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(uint64_t* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count));
}
__device__ __forceinline__ void mbar_expect(uint64_t* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ bool mbar_try(uint64_t* bar, unsigned parity) {
  unsigned ok;
  asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
               : "=r"(ok) : "r"(smem_u32(bar)), "r"(parity) : "memory");
  return ok;
}
// what: 1 a full stage (consumers), 2 an empty stage (producer)
// try_wait may suspend the thread for a while before it answers, so the stall clock starts before the first try.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, unsigned parity, int what = 1, int it = 0) {
  const bool timed = stall_timing();
  const long long t0 = timed ? global_ns() : 0;
  if (mbar_try(bar, parity)) {
    if (timed) stall_add(what == 2 ? 0 : 1, what == 2 ? 0 : 2, global_ns() - t0);
    return;
  }
  const long long t1 = global_ns();
  while (!mbar_try(bar, parity))
    if (global_ns() - t1 > 2000000000ll) hang(what == 2 ? 0 : 1, what, it, parity, 0);
  stall_add(what == 2 ? 0 : 1, what == 2 ? 0 : 2, global_ns() - (timed ? t0 : t1));
}
__device__ __forceinline__ void tma_3d(void* dst, const CUtensorMap* map, int c0, int c1, int c2, uint64_t* bar,
                                       uint64_t policy) {
  asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint"
               " [%0], [%1, {%2, %3, %4}], [%5], %6;"
               ::"r"(smem_u32(dst)), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(smem_u32(bar)), "l"(policy) : "memory");
}
__device__ __forceinline__ void tma_4d(void* dst, const CUtensorMap* map, int c0, int c1, int c2, int c3, uint64_t* bar,
                                       uint64_t policy) {
  asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint"
               " [%0], [%1, {%2, %3, %4, %5}], [%6], %7;"
               ::"r"(smem_u32(dst)), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_u32(bar)), "l"(policy)
               : "memory");
}
__device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t p;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
  return p;
}
__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void spin_until(const unsigned* p, unsigned target, int role = 1, int counter = -1) {
  const bool timed = stall_timing();
  const long long tw = timed ? global_ns() : 0;
  if (ld_acquire(p) >= target) {
    if (timed) stall_add(role, role == 0 ? 1 : 3, global_ns() - tw);
    return;
  }
  const long long t0 = global_ns();
  while (ld_acquire(p) < target) {
    __nanosleep(20);
    if (global_ns() - t0 > 2000000000ll) hang(role, 3, counter, target, ld_acquire(p));
  }
  stall_add(role, role == 0 ? 1 : 3, global_ns() - (timed ? tw : t0));
}
// NO_FENCE=1 (timing only: results may be wrong) drops every gpu-scope fence, to bound what moving the fences off
// the consumers could save.
#ifndef NO_FENCE
#define NO_FENCE 0
#endif
__device__ __forceinline__ void fence_gpu() {
  if (!NO_FENCE) __threadfence();
}
__device__ __forceinline__ void consumer_sync() { asm volatile("bar.sync 1, %0;" ::"n"(kConsumers * 32) : "memory"); }
__device__ __forceinline__ void signal(unsigned* c) {  // after consumer_sync: every consumer's stores are done
  fence_gpu();
  atomicAdd(c, 1u);
}
__device__ __forceinline__ void ldsm_x4(unsigned (&r)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x2(unsigned (&r)[2], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];" : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(unsigned (&r)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void mma(float (&c)[4], unsigned a0, unsigned a2, unsigned b0, unsigned b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1));
}
__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<unsigned*>(&v);
}
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// ====  3. Shared memory and the stage stream  ==================================================
// Dynamic shared memory: the fixed part, then h and act sized for the batch, then as many 16 KB ring stages as fit.
struct Smem {
  float red[2][kConsumers][64 * RG];  // per-group partials of the 8 warps, RG groups at a time
  uint64_t full[kMaxStages], empty[kMaxStages];
  uint64_t sig_full[kSig], sig_empty[kSig];
  int sig_ctr[kSig], sig_k, sig_phase;  // the queue's counters, and the consumers' position in it
  int stage_tile[kMaxStages];    // the drain's claimed tile, beside the tile's first stage (-1: no more)
  int h_layer, flag, stages, no_load;
  int act_off, ring_off;         // byte offsets from the Smem of act and the ring (sm_act, sm_ring)
};

__host__ __device__ constexpr size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }
__host__ __device__ inline size_t h_bytes(int batch) { return round_up((size_t)batch * kHStride * 2, 1024); }
__host__ __device__ inline size_t act_bytes(int batch) {
  const size_t q = (size_t)GROUP * kQStride * 2, rows = (size_t)batch * kActStride * 2;
  return round_up(rows > q ? rows : q, 1024);
}
constexpr size_t kSmemLimit = 232448;  // bytes a block may have on sm_90
__host__ __device__ inline int ring_stages(int batch) {
  const size_t fixed = round_up(sizeof(Smem), 1024) + 1024 + h_bytes(batch) + act_bytes(batch);
  const size_t fit = (kSmemLimit - fixed) / kStageBytes;
  return fit < (size_t)kMaxStages ? (int)fit : kMaxStages;
}
__host__ __device__ inline size_t smem_bytes(int batch) {
  return round_up(sizeof(Smem), 1024) + 1024 + h_bytes(batch) + act_bytes(batch) + (size_t)ring_stages(batch) * kStageBytes;
}

// h, act and the ring, as pointers derived from the Smem itself (which the kernel derives from the shared array), so
// that the compiler keeps them in the shared space (LDS, STS, ATOMS): a pointer stored in shared memory and read back
// is generic, and every access through it is a generic LD.E / ST.E, and each atomic a space query and two paths.
__device__ __forceinline__ unsigned char* sm_base(Smem& s) { return reinterpret_cast<unsigned char*>(&s); }
__device__ __forceinline__ bf16* sm_h(Smem& s) {  // [B, kHStride] norm of x_l for layer h_layer
  return reinterpret_cast<bf16*>(sm_base(s) + round_up(sizeof(Smem), 1024));
}
__device__ __forceinline__ bf16* sm_act(Smem& s) {  // [B, kActStride] o_proj / down input, or attention's q
  return reinterpret_cast<bf16*>(sm_base(s) + s.act_off);
}
__device__ __forceinline__ unsigned char* sm_ring(Smem& s) { return sm_base(s) + s.ring_off; }  // [stages][16 KB]

struct Stream {  // one role's position in the stage sequence (producer and consumers keep their own)
  int k = 0;
  unsigned phase = 0;
  __device__ void advance(int stages) {
    if (++k == stages) { k = 0; phase ^= 1; }
  }
};

__device__ __forceinline__ int up_count(const Params& p, int layer) { return __ldcg(&p.slots[layer * (1 + MAX_SLOTS)]); }
__device__ __forceinline__ int expert_of(const Params& p, int layer, int slot) {
  return __ldcg(&p.slots[layer * (1 + MAX_SLOTS) + 1 + slot]);
}

// Pages of a split: [first, last) of the row's logical pages (sliding layers: the window's).
__device__ __forceinline__ void split_pages(const Params& p, const Task& t, int& first, int& last) {
  const int len = p.context + 1;
  const int lo_tok = t.a[4] ? max(0, len - WINDOW) : 0;
  const int lo = lo_tok / PAGE, hi = (len + PAGE - 1) / PAGE;
  const int n = hi - lo, per = (n + t.a[3] - 1) / t.a[3];
  first = min(hi, lo + t.a[2] * per);
  last = min(hi, first + per);
}

// The drain's tiles of a layer, in claim order: every slot's up tiles, every slot's down tiles, then o_proj. A down
// tile waits only for its slot's up tiles, all claimed before it, so the claims cannot deadlock.
// Tile sizes (Params): up pairs, down groups and o_proj groups a claim takes. Each size divides its total.
struct DrainTile { int kind, slot, g0, groups; };  // kind 0 up, 1 down, 2 o_proj, -1 none left
__device__ __forceinline__ int up_tiles_per_slot(const Params& p, bool dense) {
  return (dense ? DENSE_I : I) / 8 / p.up_pairs;
}
__device__ DrainTile drain_tile(const Params& p, int idx, int n, bool dense) {
  const int up_per = up_tiles_per_slot(p, dense), down_per = H / 8 / p.down_groups;
  if (idx < n * up_per) return {0, idx / up_per, (idx % up_per) * p.up_pairs, p.up_pairs};
  idx -= n * up_per;
  if (idx < n * down_per) return {1, idx / down_per, (idx % down_per) * p.down_groups, p.down_groups};
  idx -= n * down_per;
  if (idx < H / 8 / p.o_groups) return {2, 0, idx * p.o_groups, p.o_groups};
  return {-1, 0, 0, 0};
}

// ====  4. Producer: every stage of every task, in list order  ==================================
__device__ void produce_box(const Maps& maps, Smem& s, Stream& st, int map, int c0, int c1, int c2, unsigned bytes,
                            uint64_t pol, bool wait_empty = true) {
  const int k = st.k;
  if (wait_empty) mbar_wait(&s.empty[k], st.phase ^ 1, 2, k);
  if (s.no_load) mbar_arrive(&s.full[k]);
  else {
    mbar_expect(&s.full[k], bytes);
    tma_3d(sm_ring(s) + (size_t)k * kStageBytes, &maps.m[map], c0, c1, c2, &s.full[k], pol);
  }
  st.advance(s.stages);
}

__device__ void produce_rows(const Maps& maps, Smem& s, Stream& st, int map, int row0, int groups, int kboxes,
                             unsigned bytes, uint64_t pol) {
  for (int g = 0; g < groups; ++g)
    for (int kb = 0; kb < kboxes; ++kb) produce_box(maps, s, st, map, 0, row0 + 8 * g, kb * (bytes / 1024), bytes, pol);
}

// Claims tiles while the ring has a free stage: the claim waits for the stage, so a tile is claimed only by a block
// that can start streaming it.
__device__ void produce_drain(const Params& p, const Maps& maps, Smem& s, Stream& st, int l, uint64_t pol) {
  const bool dense = l == 0;
  if (!dense && !p.no_wait) spin_until(&p.counters[ctr(l, C_TOPK)], 1, 0, ctr(l, C_TOPK));
  const int n = dense ? 1 : up_count(p, l);
  for (;;) {
    const int k = st.k;
    mbar_wait(&s.empty[k], st.phase ^ 1, 2, k);
    const long long t0 = stall_timing() ? global_ns() : 0;
    const int idx = (int)atomicAdd(&p.counters[ctr(l, C_CLAIM)], 1u);
    const DrainTile d = drain_tile(p, idx, n, dense);
    s.stage_tile[k] = d.kind < 0 ? -1 : idx;
    if (d.kind < 0) {
      mbar_expect(&s.full[k], 0);
      st.advance(s.stages);
      return;
    }
    bool first = true;
    auto box = [&](int map, int row, int kb, unsigned bytes) {
      produce_box(maps, s, st, map, 0, row, kb, bytes, pol, !first);
      first = false;
    };
    const int e = dense ? 0 : expert_of(p, l, d.slot);
    if (stall_timing()) stall_add(0, 5, global_ns() - t0);
    if (d.kind == 0) {
      const int base = dense ? 0 : ((l - 1) * E + e) * 2 * I, width = dense ? DENSE_I : I;
      for (int g = d.g0; g < d.g0 + d.groups; ++g)
        for (int half = 0; half < 2; ++half)
          for (int kb = 0; kb < 2; ++kb) box(dense ? M_DGATEUP : M_GATEUP, base + half * width + 8 * g, kb * 16, 16384);
    } else if (d.kind == 1) {
      for (int g = d.g0; g < d.g0 + d.groups; ++g) {
        if (dense)
          for (int kb = 0; kb < 3; ++kb) box(M_DDOWN, 8 * g, kb * 16, 16384);
        else
          box(M_DOWN, ((l - 1) * E + e) * H + 8 * g, 0, 12288);
      }
    } else {
      for (int g = d.g0; g < d.g0 + d.groups; ++g)
        for (int kb = 0; kb < 4; ++kb) box(M_O, l * H + 8 * g, kb * 16, 16384);
    }
  }
}

__device__ void produce(const Params& p, const Maps& maps, Smem& s, const Task* list, int n) {
  Stream st;
  const uint64_t pol = evict_first_policy();
  for (int i = 0; i < n; ++i) {
    g_where[2 * blockIdx.x] = i;
    const Task t = list[i];
    g_type[2 * blockIdx.x] = t.type;
    const int l = t.layer;
    switch (t.type) {
      case T_QKV: produce_rows(maps, s, st, M_QKV, l * QKV_ROWS + 8 * t.a[0], t.a[1], 2, 16384, pol); break;
      case T_ROUTER: produce_rows(maps, s, st, M_ROUTER, (l - 1) * E + 8 * t.a[0], t.a[1], 2, 16384, pol); break;
      case T_OPROJ: produce_rows(maps, s, st, M_O, l * H + 8 * t.a[0], t.a[1], 4, 16384, pol); break;
      case T_LM: produce_rows(maps, s, st, M_LM, 8 * t.a[0], t.a[1], 2, 16384, pol); break;
      case T_DRAIN: produce_drain(p, maps, s, st, l, pol); break;
      case T_UP: {
        int base, width, map;
        if (t.a[0] < 0) { base = 0; width = DENSE_I; map = M_DGATEUP; }
        else {
          if (!p.no_wait) spin_until(&p.counters[ctr(l, C_TOPK)], 1, 0, ctr(l, C_TOPK));
          if (t.a[0] >= up_count(p, l)) break;
          base = ((l - 1) * E + expert_of(p, l, t.a[0])) * 2 * I; width = I; map = M_GATEUP;
        }
        for (int g = t.a[1]; g < t.a[1] + t.a[2]; ++g)
          for (int half = 0; half < 2; ++half)
            for (int kb = 0; kb < 2; ++kb) produce_box(maps, s, st, map, 0, base + half * width + 8 * g, kb * 16, 16384, pol);
        break;
      }
      case T_DOWN: {
        if (t.a[0] < 0) { produce_rows(maps, s, st, M_DDOWN, 8 * t.a[1], t.a[2], 3, 16384, pol); break; }
        if (!p.no_wait) spin_until(&p.counters[ctr(l, C_TOPK)], 1, 0, ctr(l, C_TOPK));
        if (t.a[0] >= up_count(p, l)) break;
        const int base = ((l - 1) * E + expert_of(p, l, t.a[0])) * H;
        produce_rows(maps, s, st, M_DOWN, base + 8 * t.a[1], t.a[2], 1, 12288, pol);
        break;
      }
      case T_ATTN: {
        int first, last;
        split_pages(p, t, first, last);
        const int* table = p.block_tables + ((size_t)l * p.batch + t.a[0]) * p.max_pages;
        int phys_at[8];  // ATTN3: the next 8 pages' table entries, read at once (one L2 latency, not 8)
        for (int pg = first; pg < last; ++pg) {
          if (ATTN3 && (pg - first) % 8 == 0)
#pragma unroll
            for (int j = 0; j < 8; ++j) phys_at[j] = pg + j < last ? __ldg(&table[pg + j]) : 0;
          const int phys = ATTN3 ? phys_at[(pg - first) % 8] : table[pg];
          for (int kv = 0; kv < 2; ++kv) {
            const int k = st.k;
            mbar_wait(&s.empty[k], st.phase ^ 1, 2, k);
            if (s.no_load) { mbar_arrive(&s.full[k]); st.advance(s.stages); continue; }
            mbar_expect(&s.full[k], 16384);
            tma_4d(sm_ring(s) + (size_t)k * kStageBytes, &maps.m[kv ? M_V : M_K], 0, 0, t.a[1], phys * PAGE, &s.full[k], pol);
            st.advance(s.stages);
          }
        }
        break;
      }
      default: break;
    }
  }
}

// ====  5. Consumers: inputs, the product core, epilogues  ======================================
// h = rmsnorm(x_l) * norm weight, rows < B, into sm_h(s) (kept while the block stays on layer l). Every thread takes 8
// columns of every row: one round of loads for the sums of squares, then the same lines again (L1 hits) for h.
__device__ __forceinline__ void x_cols(const Params& p, int l, int b, int c, float (&v)[8]) {
  if (l == 0) {
    const uint4 e = *reinterpret_cast<const uint4*>(&p.embed[(size_t)p.tokens[b] * H + c]);
    const bf16* eb = reinterpret_cast<const bf16*>(&e);
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = __bfloat162float(eb[j]);
    return;
  }
  const float4* x = reinterpret_cast<const float4*>(&p.x[((size_t)l * p.batch + b) * H + c]);
  const float4 u = __ldca(x), w = __ldca(x + 1);
  v[0] = u.x; v[1] = u.y; v[2] = u.z; v[3] = u.w; v[4] = w.x; v[5] = w.y; v[6] = w.z; v[7] = w.w;
}

// LOADS2: load_h's first pass issues every row's loads before the first sum (a row at a time, behind `break`, it
// waits for each row's L2 round trip: 5.3 us at B=8 against 1.3 at B=1; the second pass reads L1); load_act's copy
// loop is unrolled so that its loads go out together.
#ifndef LOADS2
#define LOADS2 0
#endif
__device__ void load_h(const Params& p, Smem& s, int l) {
  static_assert(H == 8 * 32 * kConsumers, "load_h: 8 columns a thread");
  if (s.h_layer == l) return;
  const int tid = threadIdx.x - kCB, warp = tid / 32, lane = tid % 32, c = 8 * tid;
  float* sums = s.red[1][0];  // [B][warps]
#if LOADS2
  {
    float v[MAXB][8];
#pragma unroll
    for (int b = 0; b < MAXB; ++b)
      if (b < p.batch) x_cols(p, l, b, c, v[b]);
      else for (int j = 0; j < 8; ++j) v[b][j] = 0.f;
#pragma unroll
    for (int b = 0; b < MAXB; ++b) {
      if (b >= p.batch) continue;
      float ss = 0.f;
#pragma unroll
      for (int j = 0; j < 8; ++j) ss += v[b][j] * v[b][j];
      ss = warp_sum(ss);
      if (lane == 0) sums[b * kConsumers + warp] = ss;
    }
  }
#else
#pragma unroll
  for (int b = 0; b < MAXB; ++b) {
    if (b >= p.batch) break;
    float v[8];
    x_cols(p, l, b, c, v);
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) ss += v[j] * v[j];
    ss = warp_sum(ss);
    if (lane == 0) sums[b * kConsumers + warp] = ss;
  }
#endif
  consumer_sync();
  const uint4 gw = *reinterpret_cast<const uint4*>(&p.norms[(size_t)l * H + c]);
  const bf16* gamma = reinterpret_cast<const bf16*>(&gw);
  for (int b = 0; b < p.batch; ++b) {
    float ss = 0.f;
    for (int w = 0; w < kConsumers; ++w) ss += sums[b * kConsumers + w];
    const float rstd = rsqrtf(ss / H + 1e-6f);
    float v[8];
    x_cols(p, l, b, c, v);
    uint4 o;
    unsigned* ow = reinterpret_cast<unsigned*>(&o);
#pragma unroll
    for (int j = 0; j < 4; ++j)
      ow[j] = pack_bf16(v[2 * j] * rstd * __bfloat162float(gamma[2 * j]), v[2 * j + 1] * rstd * __bfloat162float(gamma[2 * j + 1]));
    *reinterpret_cast<uint4*>(&sm_h(s)[b * kHStride + c]) = o;
  }
  consumer_sync();
  if (threadIdx.x == kCB) s.h_layer = l;
}

// A fragments of the warp's KS k16 steps in box kb (k offset kb * box_k): [step][2 regs], rows >= batch zero.
template <int KS>
__device__ __forceinline__ void load_a(unsigned (&a)[KS][2], const bf16* act, int stride, int batch, int k_base) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32 - kCB / 32, g = lane / 4, c = lane % 4;
  const bool ok = g < batch;
#pragma unroll
  for (int j = 0; j < KS; ++j) {
    const int k0 = k_base + (warp * KS + j) * 16 + 2 * c;
    a[j][0] = ok ? *reinterpret_cast<const unsigned*>(act + g * stride + k0) : 0u;
    a[j][1] = ok ? *reinterpret_cast<const unsigned*>(act + g * stride + k0 + 8) : 0u;
  }
}

// ACC independent accumulators per warp (1: one dependent mma chain; 2 or 4 shorten it), summed before the reduce.
#ifndef ACC
#define ACC 2
#endif
// One box: 8 weight rows x (KS * 8 * 16) columns; the warp multiplies its KS k16 steps.
template <int KS>
__device__ __forceinline__ void box_product(float (&acc)[ACC][4], const unsigned char* box, const unsigned (&a)[KS][2]) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32 - kCB / 32, r = lane % 8, m = lane / 8;
#pragma unroll
  for (int j = 0; j < KS; j += 2) {
    const int k0 = (warp * KS + j) * 16;
    const int chunk = (k0 % 64) / 8 + m;
    unsigned b[4];
    ldsm_x4(b, smem_u32(box + (k0 / 64) * 1024 + r * 128 + ((chunk ^ r) << 4)));
    mma(acc[j % ACC], a[j][0], a[j][1], b[0], b[1]);
    mma(acc[(j + 1) % ACC], a[j + 1][0], a[j + 1][1], b[2], b[3]);
  }
}


// The product of `groups` 8-row groups of a matrix with `act`; epi(group, b, r, value) for b < B (thread < 64,
// groups in order: an epilogue may carry a value from one group to the next).
template <int NK, int KS, class Epi>
__device__ void consume_rows(const Params& p, Smem& s, Stream& st, int groups, const bf16* act, int stride, Epi epi) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32 - kCB / 32, tid = threadIdx.x - kCB, gq = lane / 4, c = lane % 4;
  constexpr bool kKeepA = NK * KS <= 16;  // the A fragments of every box stay in registers for the whole call
  unsigned a_all[kKeepA ? NK : 1][KS][2];
  if (kKeepA) {
#pragma unroll
    for (int kb = 0; kb < (kKeepA ? NK : 1); ++kb) load_a<KS>(a_all[kb], act, stride, p.batch, kb * KS * 8 * 16);
  }
  int parity = 0;
  for (int g0 = 0; g0 < groups; g0 += RG, parity ^= 1) {
    const int n = min(RG, groups - g0);
    float accs[RG][ACC][4] = {};
#pragma unroll
    for (int gi = 0; gi < RG; ++gi) {
      if (gi >= n) break;
#pragma unroll
      for (int kb = 0; kb < NK; ++kb) {
        unsigned a[KS][2];
        if (!kKeepA) load_a<KS>(a, act, stride, p.batch, kb * KS * 8 * 16);
        const int k = st.k;
        mbar_wait(&s.full[k], st.phase);
        box_product<KS>(accs[gi], sm_ring(s) + (size_t)k * kStageBytes, kKeepA ? a_all[kKeepA ? kb : 0] : a);
        __syncwarp();
        if (lane == 0) mbar_arrive(&s.empty[k]);
        st.advance(s.stages);
      }
    }
#pragma unroll
    for (int gi = 0; gi < RG; ++gi) {
      float v0 = accs[gi][0][0], v1 = accs[gi][0][1];
#pragma unroll
      for (int j = 1; j < ACC; ++j) { v0 += accs[gi][j][0]; v1 += accs[gi][j][1]; }
      s.red[parity][warp][gi * 64 + gq * 8 + 2 * c] = v0;
      s.red[parity][warp][gi * 64 + gq * 8 + 2 * c + 1] = v1;
    }
    const long long t0 = stall_timing() ? global_ns() : 0;
    consumer_sync();
    if (stall_timing()) stall_add(1, 4, global_ns() - t0);
    if (tid < 64)
      for (int gi = 0; gi < n; ++gi) {
        float v = 0.f;
#pragma unroll
        for (int w = 0; w < kConsumers; ++w) v += s.red[parity][w][gi * 64 + tid];
        if (tid / 8 < p.batch) epi(g0 + gi, tid / 8, tid % 8, v);
      }
  }
}

// Consumer thread 0 (after a consumer_sync, so that every consumer's stores are done): count +1 on the counter,
// through the signaller where there is one.
__device__ void post_signal(const Params& p, Smem& s, int counter) {
#if SIGNALLER
  const int k = s.sig_k;
  mbar_wait(&s.sig_empty[k], s.sig_phase ^ 1, 1, k);
  s.sig_ctr[k] = counter;
  mbar_arrive(&s.sig_full[k]);
  if (++s.sig_k == kSig) { s.sig_k = 0; s.sig_phase ^= 1; }
#else
  signal(&p.counters[counter]);
#endif
}

__device__ void run_signaller(const Params& p, Smem& s) {
  int k = 0;
  unsigned phase = 0;
  for (;;) {
    mbar_wait(&s.sig_full[k], phase, 1, k);
    const int counter = s.sig_ctr[k];
    if (counter < 0) return;
    fence_gpu();
    atomicAdd(&p.counters[counter], 1u);
    mbar_arrive(&s.sig_empty[k]);
    if (++k == kSig) { k = 0; phase ^= 1; }
  }
}

// Profile steps: consumer thread 0 stamps point i of its current task.
constexpr int kMarks = 6;
__device__ __forceinline__ void mark(const Params& p, int i) {
  if (p.marks && threadIdx.x == kCB) p.marks[kMarks * (p.task_start[blockIdx.x] + g_where[2 * blockIdx.x + 1]) + i] = global_ns();
}

__device__ void wait_for(const Params& p, int counter, int target) {
  if (counter >= 0 && threadIdx.x == kCB && !p.no_wait) spin_until(&p.counters[counter], target, 1, counter);
  if (p.profile && threadIdx.x == kCB) p.profile[3 * (p.task_start[blockIdx.x] + g_where[2 * blockIdx.x + 1]) + 1] = global_ns();
  consumer_sync();
}

__device__ void finish(const Params& p, Smem& s, const Task& t) {
  consumer_sync();
  if (threadIdx.x == kCB && t.signal >= 0) post_signal(p, s, t.signal);
}

// x_{l+1} += x_l, float4s [lo, hi): each QKV task adds its slice (the tasks tile the QKV groups in order, so their
// slices tile x), off top-k's path: every reader of x_{l+1} waits for it through o_proj, which waits for attention,
// which waits for every QKV task. A thread's loads go out 8 float4s at a time before their atomics (the compiler
// would otherwise wait for each load in turn, as the atomics may alias them).
__device__ void add_residual(const Params& p, const Task& t, int lo, int hi) {  // float4s [lo, hi) of x
  constexpr int kBatch = 8;  // float4s a thread has in flight
  const int l = t.layer, tid = threadIdx.x - kCB, n4 = hi;
  float4* next = reinterpret_cast<float4*>(&p.x[(size_t)(l + 1) * p.batch * H]);
  for (int i0 = lo + tid; i0 < n4; i0 += kBatch * kConsumers * 32) {
    float4 v[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int i = i0 + j * kConsumers * 32;  // float4 index: row i / (H / 4), columns 4 * (i % (H / 4)) + 0..3
      if (i >= n4) break;
      if (l == 0) {
        const bf16* e = &p.embed[(size_t)p.tokens[i / (H / 4)] * H + 4 * (i % (H / 4))];
        v[j] = make_float4(__bfloat162float(e[0]), __bfloat162float(e[1]), __bfloat162float(e[2]), __bfloat162float(e[3]));
      } else {
        v[j] = __ldcg(reinterpret_cast<const float4*>(&p.x[(size_t)l * p.batch * H]) + i);
      }
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int i = i0 + j * kConsumers * 32;
      if (i >= n4) break;
      atomicAdd(&next[i], v[j]);
    }
  }
}

__device__ void consume_qkv(const Params& p, Smem& s, Stream& st, const Task& t) {
  wait_for(p, t.wait, t.target);
  load_h(p, s, t.layer);
  mark(p, 0);  // h ready
  const int row0 = 8 * t.a[0];
  consume_rows<2, 8>(p, s, st, t.a[1], sm_h(s), kHStride, [&](int g, int b, int r, float v) {
    p.qkv[b * QKV_ROWS + row0 + 8 * g + r] = __float2bfloat16(v);
  });
  mark(p, 1);  // the product
  const int n4 = p.batch * H / 4;
  add_residual(p, t, (int)((long long)t.a[0] * n4 / (QKV_ROWS / 8)),
               (int)((long long)(t.a[0] + t.a[1]) * n4 / (QKV_ROWS / 8)));
  finish(p, s, t);
}

__device__ void topk(const Params& p, Smem& s, const Task& t);

// Router logits of 8-row groups; the last router task of the layer (a ticket) then runs top-k.
__device__ void consume_router(const Params& p, Smem& s, Stream& st, const Task& t) {
  wait_for(p, t.wait, t.target);
  load_h(p, s, t.layer);
  const int row0 = 8 * t.a[0];
  mark(p, 0);  // h ready
  consume_rows<2, 8>(p, s, st, t.a[1], sm_h(s), kHStride,
                     [&](int g, int b, int r, float v) { p.router[b * E + row0 + 8 * g + r] = v; });
  mark(p, 1);  // the logits
  fence_gpu();
  consumer_sync();
  if (threadIdx.x == kCB) {
    s.flag = atomicAdd(&p.counters[ctr(t.layer, C_ROUTER)], 1u) == (unsigned)t.a[2] - 1;
    fence_gpu();
  }
  consumer_sync();
  if (!s.flag) return;
  mark(p, 2);  // the last router task
  if (!p.no_wait) topk(p, s, t);  // no-wait: keep the previous step's slots, so every reader sees the same ones
  mark(p, 3);  // top-k
  finish(p, s, t);
}

__device__ void consume_oproj(const Params& p, Smem& s, Stream& st, const Task& t) {
  wait_for(p, t.wait, t.target);
  const int tid = threadIdx.x - kCB;
  for (int i = tid; i < p.batch * QSIZE / 8; i += kConsumers * 32) {
    const int b = i / (QSIZE / 8), c = i % (QSIZE / 8);
    *reinterpret_cast<uint4*>(&sm_act(s)[b * kActStride + 8 * c]) = __ldcg(reinterpret_cast<const uint4*>(&p.attn_out[b * QSIZE + 8 * c]));
  }
  consumer_sync();
  float* x_next = p.x + (size_t)(t.layer + 1) * p.batch * H;
  const int row0 = 8 * t.a[0];
  consume_rows<4, 8>(p, s, st, t.a[1], sm_act(s), kActStride,
                     [&](int g, int b, int r, float v) { atomicAdd(&x_next[b * H + row0 + 8 * g + r], v); });
  finish(p, s, t);
}

// Top-k of every row's router logits, the distinct experts as slots (ascending), and each (slot, row) weight.
// Up to 2 rows, in one pass: thread e of each half ranks expert e's logit in its row (ties to the lower index)
// against the row in shared memory, and keeps its weight where the rank is below TOPK (-1 elsewhere). From 3 rows,
// TOPK rounds of warp argmax, a warp a row (the rank pass would take a half 2-4 rows in turn: slower at B=8).
__device__ void topk(const Params& p, Smem& s, const Task& t) {
  static_assert(kConsumers * 32 == 2 * E && MAXB * E <= kConsumers * 64 * RG, "top-k: two halves of E threads");
  const int l = t.layer, tid = threadIdx.x - kCB, warp = tid / 32, lane = tid % 32;
  float* pick = s.red[1][0];  // [B][E]: the weight of (row, expert), -1 where not chosen
  if (p.batch <= 2) {
    float* logit = s.red[0][0];  // [B][E]
    for (int i = tid; i < p.batch * E; i += kConsumers * 32) logit[i] = __ldcg(&p.router[i]);
    consumer_sync();
    const int e = tid % E, b = tid / E;
    if (b < p.batch) {
      const float* row = logit + b * E;
      const float v = row[e];
      int rank = 0;
#pragma unroll 16
      for (int j = 0; j < E; ++j) {
        const float u = row[j];
        rank += (u > v) | ((u == v) & (j < e));
      }
      pick[b * E + e] = rank < TOPK ? 1.f / (1.f + __expf(-v)) : -1.f;
    }
  } else {
    for (int i = tid; i < p.batch * E; i += kConsumers * 32) pick[i] = -1.f;
    consumer_sync();
    for (int b = warp; b < p.batch; b += kConsumers) {
      float v[E / 32];
#pragma unroll
      for (int j = 0; j < E / 32; ++j) v[j] = __ldcg(&p.router[b * E + lane + 32 * j]);
      for (int k = 0; k < TOPK; ++k) {
        float best = -INFINITY;
        int arg = 0;
#pragma unroll
        for (int j = 0; j < E / 32; ++j)
          if (v[j] > best) { best = v[j]; arg = lane + 32 * j; }
        for (int o = 16; o; o >>= 1) {
          const float ob = __shfl_xor_sync(0xffffffffu, best, o);
          const int oa = __shfl_xor_sync(0xffffffffu, arg, o);
          if (ob > best || (ob == best && oa < arg)) { best = ob; arg = oa; }
        }
#pragma unroll
        for (int j = 0; j < E / 32; ++j)
          if (lane + 32 * j == arg) v[j] = -INFINITY;
        if (lane == 0) pick[b * E + arg] = 1.f / (1.f + __expf(-best));
      }
    }
  }
  consumer_sync();
  // the distinct experts, ascending: expert e (thread e < E) ranks itself among the used ones
  bool used = false;
  if (tid < E)
    for (int b = 0; b < p.batch; ++b) used |= pick[b * E + tid] >= 0.f;
  const unsigned ballot = __ballot_sync(0xffffffffu, used);
  int* warp_count = reinterpret_cast<int*>(s.red[1][0]) + MAXB * E;
  if (lane == 0 && warp < E / 32) warp_count[warp] = __popc(ballot);
  consumer_sync();
  int* slots = p.slots + l * (1 + MAX_SLOTS);
  float* w = p.slot_w + (size_t)l * MAX_SLOTS * p.batch;
  if (used) {
    int rank = __popc(ballot & ((1u << lane) - 1));
    for (int k = 0; k < warp; ++k) rank += warp_count[k];
    slots[1 + rank] = tid;
    for (int b = 0; b < p.batch; ++b) w[rank * p.batch + b] = fmaxf(pick[b * E + tid], 0.f);
  }
  if (tid == 0) {
    int n = 0;
    for (int k = 0; k < E / 32; ++k) n += warp_count[k];
    slots[0] = n;
  }
}

__device__ __forceinline__ float silu(float g) { return g / (1.f + __expf(-g)); }

__device__ void consume_up(const Params& p, Smem& s, Stream& st, const Task& t) {
  const int l = t.layer, slot = t.a[0];
  wait_for(p, t.wait, t.target);
  if (slot >= 0 && slot >= up_count(p, l)) { finish(p, s, t); return; }
  load_h(p, s, l);
  bf16* out = p.moe_act + (size_t)(slot < 0 ? MAX_SLOTS : slot) * p.batch * DENSE_I;
  const int width = slot < 0 ? DENSE_I : I;
  float gate = 0.f;
  consume_rows<2, 8>(p, s, st, 2 * t.a[2], sm_h(s), kHStride, [&](int g, int b, int r, float v) {
    if (g % 2 == 0) { gate = v; return; }
    out[b * width + 8 * (t.a[1] + g / 2) + r] = __float2bfloat16(silu(gate) * v);
  });
  finish(p, s, t);
}

__device__ void consume_down(const Params& p, Smem& s, Stream& st, const Task& t) {
  const int l = t.layer, slot = t.a[0], tid = threadIdx.x - kCB;
  wait_for(p, t.wait, t.target);
  if (slot >= 0 && slot >= up_count(p, l)) { finish(p, s, t); return; }
  const int width = slot < 0 ? DENSE_I : I;
  const bf16* in = p.moe_act + (size_t)(slot < 0 ? MAX_SLOTS : slot) * p.batch * DENSE_I;
  for (int i = tid; i < p.batch * width / 8; i += kConsumers * 32) {
    const int b = i / (width / 8), c = i % (width / 8);
    *reinterpret_cast<uint4*>(&sm_act(s)[b * kActStride + 8 * c]) = __ldcg(reinterpret_cast<const uint4*>(&in[b * width + 8 * c]));
  }
  consumer_sync();
  float* x_next = p.x + (size_t)(l + 1) * p.batch * H;
  const float* w = p.slot_w + ((size_t)l * MAX_SLOTS + max(slot, 0)) * p.batch;
  const int row0 = 8 * t.a[1];
  auto epi = [&](int g, int b, int r, float v) {
    const float wb = slot < 0 ? 1.f : __ldcg(&w[b]);
    if (wb != 0.f) atomicAdd(&x_next[b * H + row0 + 8 * g + r], wb * v);
  };
  if (slot < 0) consume_rows<3, 8>(p, s, st, t.a[2], sm_act(s), kActStride, epi);
  else consume_rows<1, 6>(p, s, st, t.a[2], sm_act(s), kActStride, epi);
  finish(p, s, t);
}

__device__ void spin_consumers(const Params& p, int counter, int target) {  // thread 32 spins, the consumers sync
  if (threadIdx.x == kCB && !p.no_wait) spin_until(&p.counters[counter], target, 1, counter);
  consumer_sync();
}

__device__ void load_act(Smem& s, const bf16* in, int batch, int width) {  // in [B, width] -> sm_act(s)
  const int tid = threadIdx.x - kCB;
#if LOADS2
#pragma unroll 8
#endif
  for (int i = tid; i < batch * width / 8; i += kConsumers * 32) {
    const int b = i / (width / 8), c = i % (width / 8);
    *reinterpret_cast<uint4*>(&sm_act(s)[b * kActStride + 8 * c]) = __ldcg(reinterpret_cast<const uint4*>(&in[b * width + 8 * c]));
  }
  consumer_sync();
}

// The drain's consumers: the tile id sits beside its first stage (peeked here, released by the product).
__device__ void consume_drain(const Params& p, Smem& s, Stream& st, const Task& t) {
  const int l = t.layer, lane = threadIdx.x % 32;
  const bool dense = l == 0;
  if (!dense) spin_consumers(p, ctr(l, C_TOPK), 1);
  const int n = dense ? 1 : up_count(p, l);
  float* x_next = p.x + (size_t)(l + 1) * p.batch * H;
  for (;;) {
    const int k = st.k;
    mbar_wait(&s.full[k], st.phase);
    const int idx = s.stage_tile[k];
    if (idx < 0) {
      __syncwarp();
      if (lane == 0) mbar_arrive(&s.empty[k]);
      st.advance(s.stages);
      break;
    }
    const DrainTile d = drain_tile(p, idx, n, dense);
    const int slot_buf = dense ? MAX_SLOTS : d.slot, width = dense ? DENSE_I : I;
    if (d.kind == 0) {
      load_h(p, s, l);
      bf16* out = p.moe_act + (size_t)slot_buf * p.batch * DENSE_I;
      float gate = 0.f;
      consume_rows<2, 8>(p, s, st, 2 * d.groups, sm_h(s), kHStride, [&](int g, int b, int r, float v) {
        if (g % 2 == 0) { gate = v; return; }
        out[b * width + 8 * (d.g0 + g / 2) + r] = __float2bfloat16(silu(gate) * v);
      });
      if (!SIGNALLER) fence_gpu();
      consumer_sync();
      if (threadIdx.x == kCB) post_signal(p, s, ctr(l, C_UP + d.slot));
    } else if (d.kind == 1) {
      spin_consumers(p, ctr(l, C_UP + d.slot), up_tiles_per_slot(p, dense));
      load_act(s, p.moe_act + (size_t)slot_buf * p.batch * DENSE_I, p.batch, width);
      const float* w = p.slot_w + ((size_t)l * MAX_SLOTS + d.slot) * p.batch;
      const int row0 = 8 * d.g0;
      auto epi = [&](int g, int b, int r, float v) {
        const float wb = dense ? 1.f : __ldcg(&w[b]);
        if (wb != 0.f) atomicAdd(&x_next[b * H + row0 + 8 * g + r], wb * v);
      };
      if (dense) consume_rows<3, 8>(p, s, st, d.groups, sm_act(s), kActStride, epi);
      else consume_rows<1, 6>(p, s, st, d.groups, sm_act(s), kActStride, epi);
    } else {
      spin_consumers(p, ctr(l, C_ATTN), p.batch * KVH);
      load_act(s, p.attn_out, p.batch, QSIZE);
      const int row0 = 8 * d.g0;
      consume_rows<4, 8>(p, s, st, d.groups, sm_act(s), kActStride,
                         [&](int g, int b, int r, float v) { atomicAdd(&x_next[b * H + row0 + 8 * g + r], v); });
    }
  }
  if (!SIGNALLER) fence_gpu();
  finish(p, s, t);
}

// ====  6. Attention: one (row, kv head, split); the last split to finish merges them  ==========
// Page smem (a TMA box of 64 d x 2 halves x 1 head x 64 tokens, 128-byte swizzled): token t, half hf, chunk c at
// t * 256 + hf * 128 + ((c ^ ((2t + hf) % 8)) << 4).
__device__ __forceinline__ unsigned kv_addr(const unsigned char* page, int tok, int d) {
  const int hf = d / 64, c = (d % 64) / 8;
  return smem_u32(page + tok * 256 + hf * 128 + ((c ^ ((2 * tok + hf) % 8)) << 4));
}

// The splits' (O, m, l) -> attn_out in one pass: warp w merges head w, each lane 4 consecutive dims; a chunk's loads
// (every split's m, l and 4 values) are issued together, then combined online (the running sums rescaled when the
// max grows).
__device__ void merge_splits(const Params& p, Smem& s, const Task& t) {
  const int b = t.a[0], kvh = t.a[1], tid = threadIdx.x - kCB, warp = tid / 32, lane = tid % 32, splits = t.a[3];
  const float* part = p.part + ((size_t)(b * KVH + kvh) * MAX_SPLITS) * GROUP * (HD + 2);
  static_assert(kConsumers == GROUP && HD == 4 * 32, "merge: a warp a head, 4 dims a lane");
  constexpr int kChunk = 8;
  const int hq = warp, d0 = 4 * lane;
  float run_m = -INFINITY, den = 0.f, acc[4] = {0.f, 0.f, 0.f, 0.f};
  for (int sp0 = 0; sp0 < splits; sp0 += kChunk) {
    float m[kChunk], l[kChunk], v[kChunk][4];
#pragma unroll
    for (int j = 0; j < kChunk; ++j) {
      const bool ok = sp0 + j < splits;
      const float* row = &part[((sp0 + j) * GROUP + hq) * (HD + 2)];
      m[j] = ok ? __ldcg(&row[HD]) : -INFINITY;
      l[j] = ok ? __ldcg(&row[HD + 1]) : 0.f;
#pragma unroll
      for (int e = 0; e < 4; ++e) v[j][e] = ok ? __ldcg(&row[d0 + e]) : 0.f;
    }
    float cm = run_m;
#pragma unroll
    for (int j = 0; j < kChunk; ++j) cm = fmaxf(cm, m[j]);
    if (cm == -INFINITY) continue;
    const float scale = run_m == -INFINITY ? 0.f : exp2f(run_m - cm);
    den *= scale;
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[e] *= scale;
#pragma unroll
    for (int j = 0; j < kChunk; ++j) {
      const float w = m[j] == -INFINITY ? 0.f : exp2f(m[j] - cm);
      den += w * l[j];
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[e] += w * v[j][e];
    }
    run_m = cm;
  }
  const float inv = den > 0.f ? 1.f / den : 0.f;
  uint2 out;
  out.x = pack_bf16(acc[0] * inv, acc[1] * inv);
  out.y = pack_bf16(acc[2] * inv, acc[3] * inv);
  *reinterpret_cast<uint2*>(&p.attn_out[b * QSIZE + (kvh * GROUP + hq) * HD + d0]) = out;
}

// After the split's partial is in p.part (and a consumer_sync): its ticket; the last split merges and signals.
__device__ void finish_split(const Params& p, Smem& s, const Task& t) {
  const int b = t.a[0], kvh = t.a[1], tid = threadIdx.x - kCB;
  if (tid == 0) {
    fence_gpu();
    s.flag = atomicAdd(&p.counters[ctr(t.layer, C_SPLIT) + b * KVH + kvh], 1u) == (unsigned)t.a[3] - 1;
    fence_gpu();
  }
  consumer_sync();
  mark(p, 3);  // the split written and its ticket taken
  if (s.flag) {
    merge_splits(p, s, t);
    mark(p, 4);  // merged
    finish(p, s, t);
  }
}

// q of the task's (row, KV head) into shared memory, then every warp's A fragments of it.
__device__ void load_q(const Params& p, Smem& s, const Task& t, unsigned (&qa)[HD / 16][2]) {
  const int b = t.a[0], kvh = t.a[1], tid = threadIdx.x - kCB, lane = tid % 32, g = lane / 4, c = lane % 4;
  for (int i = tid; i < GROUP * HD; i += kConsumers * 32)
    sm_act(s)[(i / HD) * kQStride + i % HD] = __ldcg(&p.qkv[b * QKV_ROWS + kvh * GROUP * HD + i]);
  consumer_sync();
  mark(p, 0);  // q in shared memory
#pragma unroll
  for (int j = 0; j < HD / 16; ++j) {
    qa[j][0] = *reinterpret_cast<const unsigned*>(&sm_act(s)[g * kQStride + 16 * j + 2 * c]);
    qa[j][1] = *reinterpret_cast<const unsigned*>(&sm_act(s)[g * kQStride + 16 * j + 8 + 2 * c]);
  }
}

// Page pg's K stage: S = q K^T for the warp's 8 tokens (in two mma chains), the stage released, and the lane's two
// scores (log2 domain, scaled; -inf outside [lo_tok, len)).
__device__ __forceinline__ void page_scores(Smem& s, Stream& st, const unsigned (&qa)[HD / 16][2], int pg, int len,
                                            int lo_tok, float& s0, float& s1) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32 - kCB / 32, c = lane % 4;
  const float scale = 1.4426950408889634f * rsqrtf((float)HD);
  const int k = st.k;
  mbar_wait(&s.full[k], st.phase);
  const unsigned char* kpage = sm_ring(s) + (size_t)k * kStageBytes;
  float sc[4] = {0.f, 0.f, 0.f, 0.f}, sc2[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int j = 0; j < HD / 16; j += 2) {
    unsigned kb[4];
    ldsm_x4(kb, kv_addr(kpage, 8 * warp + lane % 8, 16 * j + 8 * (lane / 8)));
    mma(sc, qa[j][0], qa[j][1], kb[0], kb[1]);
    mma(sc2, qa[j + 1][0], qa[j + 1][1], kb[2], kb[3]);
  }
  __syncwarp();
  if (lane == 0) mbar_arrive(&s.empty[k]);
  st.advance(s.stages);
  const int tok = pg * PAGE + 8 * warp + 2 * c;
  s0 = (tok < len && tok >= lo_tok) ? (sc[0] + sc2[0]) * scale : -INFINITY;
  s1 = (tok + 1 < len && tok + 1 >= lo_tok) ? (sc[1] + sc2[1]) * scale : -INFINITY;
}

// Attention of one split: the warps split the head dimension for P V, not the tokens. Each warp computes S for its 8 tokens of a
// page; the page's maxima and P (bf16) go through shared memory (s.red, free during attention); then each warp
// accumulates O for its 16 of the 128 dims over all 64 tokens. Every warp keeps the same running max, so the
// split's partial needs no sum over warps: each warp writes its own dims.
__device__ void consume_attn(const Params& p, Smem& s, Stream& st, const Task& t) {
  const int b = t.a[0], kvh = t.a[1], tid = threadIdx.x - kCB, warp = tid / 32, lane = tid % 32, g = lane / 4, c = lane % 4;
  constexpr int kPS = PAGE + 8;  // P's row stride in bf16: 144 bytes, so ldmatrix's 8 rows fall on different banks
  static_assert(kConsumers * 16 == HD && kConsumers * 8 == PAGE, "attention: 8 warps, 16 dims and 8 tokens each");
  static_assert(sizeof(s.red) >= 2 * (GROUP * kPS * 2 + GROUP * kConsumers * 4) + GROUP * kConsumers * 4, "attention: scratch");
  unsigned char* scratch = reinterpret_cast<unsigned char*>(&s.red[0][0][0]);
  float* lsum = reinterpret_cast<float*>(scratch + 2 * (GROUP * kPS * 2 + GROUP * kConsumers * 4));  // [warp][head]
  wait_for(p, t.wait, t.target);
  unsigned qa[HD / 16][2];
  load_q(p, s, t, qa);
  int first, last;
  split_pages(p, t, first, last);
  const int len = p.context + 1, lo_tok = t.a[4] ? max(0, len - WINDOW) : 0;
  float m = -INFINITY, l = 0.f, o[2][4] = {};
  for (int pg = first; pg < last; ++pg) {
    unsigned char* buf = scratch + ((pg - first) & 1) * (GROUP * kPS * 2 + GROUP * kConsumers * 4);
    bf16* P = reinterpret_cast<bf16*>(buf);                         // [head][kPS]
    float* pmax = reinterpret_cast<float*>(buf + GROUP * kPS * 2);   // [warp][head]
    float s0, s1;
    page_scores(s, st, qa, pg, len, lo_tok, s0, s1);
    float mx = fmaxf(s0, s1);
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    if (c == 0) pmax[warp * GROUP + g] = mx;
    consumer_sync();  // the page's maxima
    float page_max = -INFINITY;
#pragma unroll
    for (int w = 0; w < kConsumers; ++w) page_max = fmaxf(page_max, pmax[w * GROUP + g]);
    const float m_new = fmaxf(m, page_max);
    const float corr = m_new == -INFINITY ? 1.f : exp2f(m - m_new);
    const float p0 = m_new == -INFINITY ? 0.f : exp2f(s0 - m_new), p1 = m_new == -INFINITY ? 0.f : exp2f(s1 - m_new);
    l = l * corr + p0 + p1;
    m = m_new;
    *reinterpret_cast<unsigned*>(&P[g * kPS + 8 * warp + 2 * c]) = pack_bf16(p0, p1);
    consumer_sync();  // the page's P
#pragma unroll
    for (int nb = 0; nb < 2; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[nb][e] *= corr;
    const int k = st.k;
    mbar_wait(&s.full[k], st.phase);
    const unsigned char* vpage = sm_ring(s) + (size_t)k * kStageBytes;
#pragma unroll
    for (int j = 0; j < PAGE / 16; ++j) {  // O[:, the warp's 16 dims] += P[:, 16 tokens] V[16 tokens, 16 dims]
      unsigned pa[2], vb[4];
      ldsm_x2(pa, smem_u32(&P[(lane % 8) * kPS + 16 * j + 8 * ((lane / 8) % 2)]));
      const int mi = lane / 8;
      ldsm_x4_t(vb, kv_addr(vpage, 16 * j + (mi % 2) * 8 + lane % 8, 16 * warp + (mi / 2) * 8));
      mma(o[0], pa[0], pa[1], vb[0], vb[1]);
      mma(o[1], pa[0], pa[1], vb[2], vb[3]);
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(&s.empty[k]);
    st.advance(s.stages);
  }
  mark(p, 1);  // the pages done
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  if (c == 0) lsum[warp * GROUP + g] = l;
  consumer_sync();
  float* part = p.part + (((size_t)(b * KVH + kvh) * MAX_SPLITS + t.a[2]) * GROUP) * (HD + 2);
#pragma unroll
  for (int nb = 0; nb < 2; ++nb) {
    part[g * (HD + 2) + 16 * warp + 8 * nb + 2 * c] = o[nb][0];
    part[g * (HD + 2) + 16 * warp + 8 * nb + 2 * c + 1] = o[nb][1];
  }
  if (warp == 0 && c == 0) {
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < kConsumers; ++w) total += lsum[w * GROUP + g];
    part[g * (HD + 2) + HD] = m;
    part[g * (HD + 2) + HD + 1] = total;
  }
  consumer_sync();
  mark(p, 2);  // the split's partial written
  finish_split(p, s, t);
}

// ====  7. LM head: logits of 8-row groups, greedy pick per row; the last task picks the winner  ====
__device__ void consume_lm(const Params& p, Smem& s, Stream& st, const Task& t, int task_index) {
  wait_for(p, t.wait, t.target);
  load_h(p, s, p.layers);
  const int tid = threadIdx.x - kCB;
  float best = -INFINITY;
  int arg = 0;
  const int row0 = 8 * t.a[0];
  consume_rows<2, 8>(p, s, st, t.a[1], sm_h(s), kHStride, [&](int g, int b, int r, float v) {
    if (v > best) { best = v; arg = row0 + 8 * g + r; }
  });
  // thread tid < 64 holds row b = tid / 8's best over r = tid % 8
  for (int o = 1; o < 8; o <<= 1) {
    const float ob = __shfl_xor_sync(0xffffffffu, best, o);
    const int oa = __shfl_xor_sync(0xffffffffu, arg, o);
    if (ob > best || (ob == best && oa < arg)) { best = ob; arg = oa; }
  }
  if (tid < 64 && tid % 8 == 0 && tid / 8 < p.batch) {
    p.lm_best[(task_index * MAXB + tid / 8) * 2] = best;
    p.lm_best[(task_index * MAXB + tid / 8) * 2 + 1] = __int_as_float(arg);
  }
  consumer_sync();
  if (tid == 0) {
    fence_gpu();
    s.flag = atomicAdd(&p.counters[C_LM], 1u) == (unsigned)p.lm_tasks - 1;
    fence_gpu();
  }
  consumer_sync();
  if (s.flag && tid < p.batch) {
    float bb = -INFINITY;
    int ba = 0;
    for (int i = 0; i < p.lm_tasks; ++i) {
      const float v = __ldcg(&p.lm_best[(i * MAXB + tid) * 2]);
      if (v > bb) { bb = v; ba = __float_as_int(__ldcg(&p.lm_best[(i * MAXB + tid) * 2 + 1])); }
    }
    p.out_tokens[tid] = ba;
  }
}

// ====  8. The kernel  ==========================================================================
__global__ void __launch_bounds__(kThreads, 1) step_kernel(const Params p, const __grid_constant__ Maps maps) {
  extern __shared__ unsigned char raw[];
  unsigned char* base = raw + ((1024u - (smem_u32(raw) & 1023u)) & 1023u);  // pointer arithmetic: stays shared
  Smem& s = *reinterpret_cast<Smem*>(base);
  if (threadIdx.x == 0) {
    s.stages = ring_stages(p.batch);
    s.act_off = (int)(round_up(sizeof(Smem), 1024) + h_bytes(p.batch));
    s.ring_off = s.act_off + (int)act_bytes(p.batch);
    for (int k = 0; k < s.stages; ++k) { mbar_init(&s.full[k], 1); mbar_init(&s.empty[k], kConsumers); }
    for (int k = 0; k < kSig; ++k) { mbar_init(&s.sig_full[k], 1); mbar_init(&s.sig_empty[k], 1); }
    s.sig_k = 0;
    s.sig_phase = 0;
    s.h_layer = -1;
    s.no_load = p.no_wait == 2;
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const Task* list = p.tasks + p.task_start[blockIdx.x];
  const int n = p.task_start[blockIdx.x + 1] - p.task_start[blockIdx.x];
  if (threadIdx.x < kCB) {  // the producer's and the signaller's warpgroup: never rejoins the consumers' code
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kLowRegs));
    if (threadIdx.x == 0) produce(p, maps, s, list, n);
    else if (threadIdx.x == 32) run_signaller(p, s);
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kHighRegs));
  if (threadIdx.x == kCB && blockIdx.x == 0) { p.clocks[0] = clock64(); p.clocks[1] = global_ns(); }
  Stream st;
  for (int i = 0; i < n; ++i) {
    const Task t = list[i];
    if (threadIdx.x == kCB) { g_where[2 * blockIdx.x + 1] = i; g_type[2 * blockIdx.x + 1] = t.type; }
    if (p.profile && threadIdx.x == kCB) p.profile[3 * (p.task_start[blockIdx.x] + i)] = global_ns();
    switch (t.type) {
      case T_QKV: consume_qkv(p, s, st, t); break;
      case T_ROUTER: consume_router(p, s, st, t); break;
      case T_UP: consume_up(p, s, st, t); break;
      case T_DOWN: consume_down(p, s, st, t); break;
      case T_ATTN: consume_attn(p, s, st, t); break;
      case T_OPROJ: consume_oproj(p, s, st, t); break;
      case T_DRAIN: consume_drain(p, s, st, t); break;
      case T_LM: consume_lm(p, s, st, t, t.a[2]); break;
      default: break;
    }
    if (p.profile && threadIdx.x == kCB) p.profile[3 * (p.task_start[blockIdx.x] + i) + 2] = global_ns();
  }
  if (threadIdx.x == kCB && blockIdx.x == 0) { p.clocks[2] = clock64(); p.clocks[3] = global_ns(); }
  if (SIGNALLER && threadIdx.x == kCB) post_signal(p, s, -1);
}

__global__ void fill_random(bf16* w, size_t n, unsigned seed, float scale) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    unsigned z = (unsigned)(i * 2654435761u) ^ seed;
    z ^= z >> 15; z *= 2246822519u; z ^= z >> 13; z *= 3266489917u; z ^= z >> 16;
    w[i] = __float2bfloat16(((z & 0xffff) / 65536.f - 0.5f) * 2.f * scale);
  }
}

__global__ void copy_kernel(const uint4* src, uint4* dst, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) dst[i] = src[i];
}

// ====  9. Host: tensors, maps, the schedule, timing  ============================================
typedef CUresult (*EncodeTiled)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
static EncodeTiled encode_fn() {  // through the runtime: no -lcuda needed
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q;
  CK(cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &fn, cudaEnableDefault, &q));
  return reinterpret_cast<EncodeTiled>(fn);
}

// A row-major [rows, cols] bf16 matrix as (64 cols, rows, cols / 64) boxes of 64 x 8 x box_k/64.
static CUtensorMap matrix_map(const bf16* base, size_t rows, int cols, int box_k) {
  CUtensorMap m;
  cuuint64_t dims[3] = {64, rows, (cuuint64_t)cols / 64};
  cuuint64_t strides[2] = {(cuuint64_t)cols * 2, 128};
  cuuint32_t box[3] = {64, 8, (cuuint32_t)box_k / 64};
  cuuint32_t estr[3] = {1, 1, 1};
  CUresult r = encode_fn()(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, (void*)base, dims, strides, box, estr,
                           CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                           CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) { fprintf(stderr, "tensor map (matrix %zu x %d): %d\n", rows, cols, (int)r); exit(1); }
  return m;
}

// The pool [tokens, KVH, HD] as (64 d, 2 halves, KVH, tokens): one box = one head's page.
static CUtensorMap kv_map(const bf16* base, size_t tokens) {
  CUtensorMap m;
  cuuint64_t dims[4] = {64, 2, KVH, tokens};
  cuuint64_t strides[3] = {128, HD * 2, KVH * HD * 2};
  cuuint32_t box[4] = {64, 2, 1, PAGE};
  cuuint32_t estr[4] = {1, 1, 1, 1};
  CUresult r = encode_fn()(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, (void*)base, dims, strides, box, estr,
                           CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                           CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) { fprintf(stderr, "tensor map (kv): %d\n", (int)r); exit(1); }
  return m;
}

// Tasks go, in wave order, to the SM with the fewest bytes so far in this layer (ties: the next after the last
// pick), so that every SM streams about the same share of each layer.
struct Schedule {
  std::vector<std::vector<Task>> per_sm;
  std::vector<double> load;
  int cursor = 0;
  bool balanced = true;  // false: round-robin, the cursor carried across waves
  explicit Schedule(int sms) : per_sm(sms), load(sms, 0.0) {}
  void new_layer() { std::fill(load.begin(), load.end(), 0.0); }
  void add(const Task& t, double bytes = 0) {
    const int n = (int)per_sm.size();
    int best = cursor;
    for (int i = 1; i < n && balanced; ++i) {
      const int sm = (cursor + i) % n;
      if (load[sm] < load[best]) best = sm;
    }
    per_sm[best].push_back(t);
    load[best] += bytes + 8192;  // a task's fixed cost, in bytes of streaming
    cursor = (best + 1) % n;
  }
};

static Task task(int type, int layer, std::initializer_list<int> args, int wait, int target, int signal) {
  Task t{};
  t.type = type; t.layer = layer;
  int i = 0;
  for (int a : args) t.a[i++] = a;
  t.wait = wait; t.target = target; t.signal = signal;
  return t;
}

// `total` 8-row groups in tasks of `per` groups (the last one shorter), each group `group_bytes` streamed;
// returns the task count.
template <class Make>
static int split_groups(Schedule& s, int total, int per, double group_bytes, Make make) {
  int n = 0;
  for (int g = 0; g < total; g += per, ++n) s.add(make(g, std::min(per, total - g)), std::min(per, total - g) * group_bytes);
  return n;
}

static int attn_splits(int pages, int batch, int min_pages) {  // at most about one (row, head, split) per SM
  const int s = std::max(1, 132 / (batch * KVH));
  return std::max(1, std::min({s, MAX_SPLITS, pages / min_pages}));
}

static Schedule build(int sms, int batch, int context, int layers, bool balanced, int min_pages, bool router_first,
                      bool drain, int router_groups, int& lm_tasks) {
  Schedule s(sms);
  s.balanced = balanced;
  const int len = context + 1, full_pages = (len + PAGE - 1) / PAGE;
  for (int l = 0; l < layers; ++l) {
    s.new_layer();
    const int wait_x = l == 0 ? -1 : ctr(l, C_X);
    const bool dense = l == 0, sliding = l % 4 != 0;
    // router tiles (first in their SMs' lists: top-k heads the MoE chain); the last to finish picks the experts and
    // signals top-k
    const int n_router = (E / 8 + router_groups - 1) / router_groups;
    if (!dense && router_first)
      split_groups(s, E / 8, router_groups, 2 * 16384, [&](int g, int n) {
        return task(T_ROUTER, l, {g, n, n_router}, wait_x, l, ctr(l, C_TOPK));
      });
    const int per_qkv = (QKV_ROWS / 8 + sms - 1) / sms;
    const int nq = split_groups(s, QKV_ROWS / 8, per_qkv, 2 * 16384, [&](int g, int n) {
      return task(T_QKV, l, {g, n}, wait_x, l, ctr(l, C_QKV));
    });
    if (!dense && !router_first)  // round-robin: right after QKV's 128 tasks, the 4 SMs without a QKV task
      split_groups(s, E / 8, router_groups, 2 * 16384, [&](int g, int n) {
        return task(T_ROUTER, l, {g, n, n_router}, wait_x, l, ctr(l, C_TOPK));
      });
    // attention: pages known on the host, streamed before top-k so HBM has work at the layer's start
    const int pages = sliding ? std::min(full_pages, (std::min(len, WINDOW) + PAGE - 1) / PAGE + 1) : full_pages;
    const int splits = attn_splits(pages, batch, min_pages), per_split = (pages + splits - 1) / splits;
    for (int b = 0; b < batch; ++b)
      for (int h = 0; h < KVH; ++h)
        for (int sp = 0; sp < splits; ++sp)
          s.add(task(T_ATTN, l, {b, h, sp, splits, sliding ? 1 : 0}, ctr(l, C_QKV), nq, ctr(l, C_ATTN)),
                std::max(0, std::min(per_split, pages - sp * per_split)) * 32768.0);
    if (drain) {  // every SM claims the layer's expert and o_proj tiles; x_{l+1} is done when every drain is
      for (int sm = 0; sm < sms; ++sm) s.per_sm[sm].push_back(task(T_DRAIN, l, {}, -1, 0, ctr(l + 1, C_X)));
      continue;
    }
    // experts: one task list per slot; up = gate + up group pairs, down = 8-row groups of H. A slot past the
    // batch's distinct experts is skipped on the device: weigh it by how likely it is used (uniform routing)
    const int slots = dense ? 1 : std::min(MAX_SLOTS, batch * TOPK);
    const double expected = dense ? 1 : E * (1 - std::pow(1 - (double)TOPK / E, batch));
    auto used = [&](int sl) { return dense ? 1.0 : 0.5 * std::erfc((sl + 0.5 - expected) / (std::sqrt(2.0) * 3.5)); };
    const int width = dense ? DENSE_I : I;
    const int up_pairs = width / 8, per_up = std::max(1, (int)((expected * up_pairs + sms - 1) / sms));
    std::vector<int> ups(slots);
    for (int sl = 0; sl < slots; ++sl) {
      const int slot = dense ? -1 : sl;
      ups[sl] = split_groups(s, up_pairs, per_up, 4 * 16384 * used(sl), [&](int g, int n) {
        return task(T_UP, l, {slot, g, n}, dense ? wait_x : ctr(l, C_TOPK), dense ? l : 1, ctr(l, C_UP + sl));
      });
    }
    const int per_down = std::max(1, (int)((expected * (H / 8) + sms - 1) / sms));
    for (int sl = 0; sl < slots; ++sl) {
      const int slot = dense ? -1 : sl;
      split_groups(s, H / 8, per_down, (dense ? 3 * 16384 : 12288) * used(sl), [&](int g, int n) {
        return task(T_DOWN, l, {slot, g, n}, ctr(l, C_UP + sl), ups[sl], ctr(l + 1, C_X));
      });
    }
    split_groups(s, H / 8, (H / 8 + sms - 1) / sms, 4 * 16384, [&](int g, int n) {
      return task(T_OPROJ, l, {g, n}, ctr(l, C_ATTN), batch * KVH, ctr(l + 1, C_X));
    });
  }
  s.new_layer();
  lm_tasks = 0;
  const int per_lm = (VOCAB / 8 + sms - 1) / sms;
  for (int g = 0; g < VOCAB / 8; g += per_lm, ++lm_tasks)
    s.add(task(T_LM, layers, {g, std::min(per_lm, VOCAB / 8 - g), lm_tasks}, layers ? ctr(layers, C_X) : -1, 0, -1),
          std::min(per_lm, VOCAB / 8 - g) * 32768.0);
  return s;
}

// x_{l+1}'s target: every task whose signal is C_X of layer l + 1. The x_l copy (the QKV tasks' slices) needs no
// count: o_proj, among those tasks, waits for attention, which waits for every QKV task.
static void set_x_targets(Schedule& s) {
  std::vector<int> parts(LAYERS + 1, 0);
  for (auto& list : s.per_sm)
    for (auto& t : list) {
      if (t.signal >= 0 && t.signal % kCtrPerLayer == C_X) parts[t.signal / kCtrPerLayer]++;
    }
  for (auto& list : s.per_sm)
    for (auto& t : list)
      if (t.wait >= 0 && t.wait % kCtrPerLayer == C_X) t.target = parts[t.wait / kCtrPerLayer];
}

static HangRecord* g_hang_host;

struct Weights {
  bf16 *qkv, *o, *router, *gate_up, *down, *dense_gate_up, *dense_down, *lm, *norms;
  size_t n_qkv, n_o, n_router, n_gate_up, n_down, n_dgu, n_dd, n_lm;
};

static Weights make_weights() {
  Weights w;
  w.n_qkv = (size_t)LAYERS * QKV_ROWS * H; w.n_o = (size_t)LAYERS * H * QSIZE; w.n_router = (size_t)(LAYERS - 1) * E * H;
  w.n_gate_up = (size_t)(LAYERS - 1) * E * 2 * I * H; w.n_down = (size_t)(LAYERS - 1) * E * H * I;
  w.n_dgu = (size_t)2 * DENSE_I * H; w.n_dd = (size_t)H * DENSE_I; w.n_lm = (size_t)VOCAB * H;
  struct { bf16** ptr; size_t n; float scale; } all[] = {
      {&w.qkv, w.n_qkv, 0.03f}, {&w.o, w.n_o, 0.03f}, {&w.router, w.n_router, 0.05f}, {&w.gate_up, w.n_gate_up, 0.03f},
      {&w.down, w.n_down, 0.03f}, {&w.dense_gate_up, w.n_dgu, 0.03f}, {&w.dense_down, w.n_dd, 0.03f},
      {&w.lm, w.n_lm, 0.03f}, {&w.norms, (size_t)(LAYERS + 1) * H, 1.f}};
  unsigned seed = 1;
  for (auto& t : all) {
    CK(cudaMalloc(t.ptr, t.n * 2));
    fill_random<<<4096, 256>>>(*t.ptr, t.n, seed++, t.scale);
  }
  CK(cudaGetLastError());
  return w;
}

static double measure_copy(int sms, void* a, void* b) {  // read + written bytes per second
  const size_t bytes = (size_t)4 << 30;
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  copy_kernel<<<sms * 8, 512>>>((const uint4*)a, (uint4*)b, bytes / 16);
  CK(cudaEventRecord(e0));
  copy_kernel<<<sms * 8, 512>>>((const uint4*)a, (uint4*)b, bytes / 16);
  CK(cudaEventRecord(e1));
  CK(cudaEventSynchronize(e1));
  float ms;
  CK(cudaEventElapsedTime(&ms, e0, e1));
  return 2.0 * bytes / (ms * 1e-3);
}

// One (batch, context): its KV pool and tables, schedule and buffers; prints a check and the step's time.
struct Config {
  int batch = 1, context = 8192, layers = LAYERS, no_wait = 0, round_robin = 0, min_pages = 8, profile = 0, router_first = 0;
  int drain = 0, router_groups = 1, up_pairs = 2, down_groups = 4, o_groups = 1;
};

// One profiled step: per task type, the mean wait (start -> met) and work (met -> end) over layers 2..47, the SMs'
// idle time between tasks, and layer 25's timeline (each type's first met and last end, from the layer's first start).
template <class Launch>
static void profile_report(const Schedule& sched, Params& p, Launch launch, size_t ntasks) {
  long long* prof;
  CK(cudaMalloc(&prof, ntasks * 3 * 8));
  long long* marks;
  CK(cudaMalloc(&marks, ntasks * kMarks * 8));
  CK(cudaMemset(marks, 0, ntasks * kMarks * 8));
  p.marks = marks;
  p.profile = prof;
  unsigned long long zero[16][6] = {};
  const int on = 1, off = 0;
  CK(cudaMemcpyToSymbol(g_stall, zero, sizeof zero));
  CK(cudaMemcpyToSymbol(g_stall_on, &on, sizeof on));
  launch();
  CK(cudaDeviceSynchronize());
  CK(cudaMemcpyToSymbol(g_stall_on, &off, sizeof off));
  unsigned long long stall[16][6];
  CK(cudaMemcpyFromSymbol(stall, g_stall, sizeof stall));
  p.profile = nullptr;
  p.marks = nullptr;
  std::vector<long long> h(ntasks * 3), hm(ntasks * kMarks);
  CK(cudaMemcpy(h.data(), prof, h.size() * 8, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(hm.data(), marks, hm.size() * 8, cudaMemcpyDeviceToHost));
  CK(cudaFree(marks));
  CK(cudaFree(prof));
  const char* names[] = {"end", "qkv", "router", "topk", "up", "down", "attn", "oproj", "lm", "drain"};
  double wait[10] = {}, work[10] = {}, count[10] = {}, gap = 0, busy = 0, msum[10][kMarks] = {}, mcount[10][kMarks] = {};
  long long first[10], last[10], t0 = -1;
  for (int k = 0; k < 10; ++k) { first[k] = LLONG_MAX; last[k] = 0; }
  size_t idx = 0;
  for (auto& list : sched.per_sm) {
    for (size_t i = 0; i < list.size(); ++i, ++idx) {
      const Task& t = list[i];
      const long long a = h[3 * idx], m = h[3 * idx + 1] ? h[3 * idx + 1] : a, e = h[3 * idx + 2];
      if (i > 0 && t.layer >= 2 && t.layer < 48) gap += a - h[3 * (idx - 1) + 2];
      if (t.layer >= 2 && t.layer < 48) {
        wait[t.type] += m - a; work[t.type] += e - m; count[t.type] += 1; busy += e - m;
        for (int j = 0; j < kMarks; ++j)
          if (hm[kMarks * idx + j]) { msum[t.type][j] += hm[kMarks * idx + j] - m; mcount[t.type][j] += 1; }
      }
      if (t.layer == 25) {
        if (t0 < 0 || a < t0) t0 = a;
        first[t.type] = std::min(first[t.type], m);
        last[t.type] = std::max(last[t.type], e);
      }
    }
  }
  printf("  profile (layers 2-47, per task, us): ");
  for (int k = 1; k < 10; ++k)
    if (count[k]) printf("%s wait %.2f work %.2f (%.0f); ", names[k], wait[k] / count[k] / 1e3, work[k] / count[k] / 1e3, count[k]);
  printf("\n  stalls per SM per step (us; producer empty/counter/claim, consumers full/counter/reduce): ");
  const double n_sm = (double)sched.per_sm.size();
  for (int k = 1; k < 10; ++k) {
    const unsigned long long* st = stall[k];
    if (st[0] + st[1] + st[2] + st[3] + st[4] + st[5])
      printf("%s %.0f/%.0f/%.0f %.0f/%.0f/%.0f; ", names[k], st[0] / n_sm / 1e3, st[1] / n_sm / 1e3, st[5] / n_sm / 1e3,
             st[2] / n_sm / 1e3, st[3] / n_sm / 1e3, st[4] / n_sm / 1e3);
  }
  printf("\n  marks (us after the task's dependency was met; tasks that reached them):");
  for (int k = 1; k < 10; ++k)
    for (int j = 0; j < kMarks; ++j)
      if (mcount[k][j]) printf(" %s.%d %.2f (%.0f)", names[k], j, msum[k][j] / mcount[k][j] / 1e3, mcount[k][j]);
  printf("\n  per layer per SM: busy %.1f us, gaps %.1f us\n  layer 25 from its first start (us): ",
         busy / 46 / sched.per_sm.size() / 1e3, gap / 46 / sched.per_sm.size() / 1e3);
  for (int k = 1; k < 10; ++k)
    if (last[k]) printf("%s met %.1f end %.1f; ", names[k], (first[k] - t0) / 1e3, (last[k] - t0) / 1e3);
  printf("\n");
}

static void run_config(int sms, const Weights& w, const Config& cfg, int steps, double copy_bw) {
  const int batch = cfg.batch, context = cfg.context, layers = cfg.layers, no_wait = cfg.no_wait;
  const int len = context + 1, full_pages = (len + PAGE - 1) / PAGE, window_pages = WINDOW / PAGE + 2;
  size_t pool_pages = 0;
  for (int l = 0; l < LAYERS; ++l) pool_pages += (size_t)batch * (l % 4 ? std::min(full_pages, window_pages) : full_pages);
  bf16 *kpool, *vpool;
  CK(cudaMalloc(&kpool, pool_pages * PAGE * KVH * HD * 2)); CK(cudaMalloc(&vpool, pool_pages * PAGE * KVH * HD * 2));
  fill_random<<<4096, 256>>>(kpool, pool_pages * PAGE * KVH * HD, 10, 1.f);
  fill_random<<<4096, 256>>>(vpool, pool_pages * PAGE * KVH * HD, 11, 1.f);
  Maps maps;
  maps.m[M_QKV] = matrix_map(w.qkv, (size_t)LAYERS * QKV_ROWS, H, 1024);
  maps.m[M_O] = matrix_map(w.o, (size_t)LAYERS * H, QSIZE, 1024);
  maps.m[M_ROUTER] = matrix_map(w.router, (size_t)(LAYERS - 1) * E, H, 1024);
  maps.m[M_GATEUP] = matrix_map(w.gate_up, (size_t)(LAYERS - 1) * E * 2 * I, H, 1024);
  maps.m[M_DOWN] = matrix_map(w.down, (size_t)(LAYERS - 1) * E * H, I, 768);
  maps.m[M_DGATEUP] = matrix_map(w.dense_gate_up, (size_t)2 * DENSE_I, H, 1024);
  maps.m[M_DDOWN] = matrix_map(w.dense_down, (size_t)H, DENSE_I, 1024);
  maps.m[M_LM] = matrix_map(w.lm, (size_t)VOCAB, H, 1024);
  maps.m[M_K] = kv_map(kpool, pool_pages * PAGE);
  maps.m[M_V] = kv_map(vpool, pool_pages * PAGE);

  // block tables: a shuffled pool; sliding layers map only their window's pages
  std::vector<int> perm(pool_pages);
  for (size_t i = 0; i < perm.size(); ++i) perm[i] = (int)i;
  std::shuffle(perm.begin(), perm.end(), std::mt19937(7));
  std::vector<int> tables((size_t)LAYERS * batch * full_pages, -1);
  size_t next = 0;
  for (int l = 0; l < LAYERS; ++l)
    for (int b = 0; b < batch; ++b) {
      const int mapped = l % 4 ? std::min(full_pages, window_pages) : full_pages;
      for (int pg = full_pages - mapped; pg < full_pages; ++pg) tables[((size_t)l * batch + b) * full_pages + pg] = perm[next++];
    }

  int lm_tasks = 0;
  Schedule sched = build(sms, batch, context, layers, !cfg.round_robin, cfg.min_pages, cfg.router_first, cfg.drain,
                         cfg.router_groups, lm_tasks);
  set_x_targets(sched);
  std::vector<Task> flat;
  std::vector<int> start{0};
  for (auto& list : sched.per_sm) {
    flat.insert(flat.end(), list.begin(), list.end());
    start.push_back((int)flat.size());
  }
  Params p{};
  Task* d_tasks; int* d_start; int* d_tables; int* d_tokens;
  CK(cudaMalloc(&d_tasks, flat.size() * sizeof(Task))); CK(cudaMemcpy(d_tasks, flat.data(), flat.size() * sizeof(Task), cudaMemcpyHostToDevice));
  CK(cudaMalloc(&d_start, start.size() * 4)); CK(cudaMemcpy(d_start, start.data(), start.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMalloc(&d_tables, tables.size() * 4)); CK(cudaMemcpy(d_tables, tables.data(), tables.size() * 4, cudaMemcpyHostToDevice));
  std::vector<int> toks(MAXB);
  for (int b = 0; b < MAXB; ++b) toks[b] = 1000 + 7919 * b;
  CK(cudaMalloc(&d_tokens, MAXB * 4)); CK(cudaMemcpy(d_tokens, toks.data(), MAXB * 4, cudaMemcpyHostToDevice));
  const size_t n_ctr = C_LM + 1;
  const size_t x_bytes = (size_t)(LAYERS + 1) * batch * H * 4;
  p.tasks = d_tasks; p.task_start = d_start; p.batch = batch; p.context = context; p.embed = w.lm; p.norms = w.norms;
  p.tokens = d_tokens; p.block_tables = d_tables; p.max_pages = full_pages; p.lm_tasks = lm_tasks;
  p.layers = layers;
  p.up_pairs = cfg.up_pairs; p.down_groups = cfg.down_groups; p.o_groups = cfg.o_groups;
  CK(cudaMalloc(&p.counters, n_ctr * 4)); CK(cudaMalloc(&p.x, x_bytes)); CK(cudaMalloc(&p.qkv, batch * QKV_ROWS * 2));
  CK(cudaMalloc(&p.router, batch * E * 4)); CK(cudaMalloc(&p.slots, LAYERS * (1 + MAX_SLOTS) * 4));
  CK(cudaMalloc(&p.slot_w, (size_t)LAYERS * MAX_SLOTS * batch * 4));
  CK(cudaMalloc(&p.moe_act, (size_t)(MAX_SLOTS + 1) * batch * DENSE_I * 2));
  CK(cudaMalloc(&p.part, (size_t)batch * KVH * MAX_SPLITS * GROUP * (HD + 2) * 4));
  CK(cudaMalloc(&p.attn_out, batch * QSIZE * 2)); CK(cudaMalloc(&p.lm_best, (size_t)lm_tasks * MAXB * 2 * 4));
  CK(cudaMalloc(&p.out_tokens, MAXB * 4));
  CK(cudaMalloc(&p.clocks, 4 * 8));

  const size_t smem = smem_bytes(batch);
  CK(cudaFuncSetAttribute(step_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  auto launch = [&]() {
    CK(cudaMemsetAsync(p.counters, 0, n_ctr * 4));
    CK(cudaMemsetAsync(p.x + (size_t)batch * H, 0, x_bytes - (size_t)batch * H * 4));
    step_kernel<<<sms, kThreads, smem>>>(p, maps);
    CK(cudaGetLastError());
  };
  launch();
  const cudaError_t first = cudaDeviceSynchronize();
  if (first != cudaSuccess) {
    fprintf(stderr, "first step failed: %s\n", cudaGetErrorString(first));
    if (g_hang_host->flag) {
      const HangRecord& h = *g_hang_host;
      const Task& t = h.task < (int)sched.per_sm[h.block].size() ? sched.per_sm[h.block][h.task] : Task{};
      fprintf(stderr, "hang: block %d %s at task %d (type %d layer %d args %d %d %d %d %d wait %d target %d) "
              "what %d: %d %d %d\n", h.block, h.role ? "consumers" : "producer", h.task, t.type, t.layer, t.a[0],
              t.a[1], t.a[2], t.a[3], t.a[4], t.wait, t.target, h.what, h.a, h.b, h.c);
    }
    exit(1);
  }

  // the product core against the host: layer 48's q rows 0-63 from x_48 (norm, then q_proj), as the step computed them
  std::vector<bf16> q(batch * QKV_ROWS), wq((size_t)64 * H), g(H);
  std::vector<float> x48(H);
  CK(cudaMemcpy(q.data(), p.qkv, q.size() * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(x48.data(), p.x + (size_t)48 * batch * H, H * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(wq.data(), w.qkv + (size_t)48 * QKV_ROWS * H, wq.size() * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(g.data(), w.norms + (size_t)48 * H, H * 2, cudaMemcpyDeviceToHost));
  double ss = 0, err = 0, ref2 = 0;
  for (int c = 0; c < H; ++c) ss += (double)x48[c] * x48[c];
  const double rstd = 1.0 / sqrt(ss / H + 1e-6);
  for (int r = 0; r < 64; ++r) {
    double acc = 0;
    for (int c = 0; c < H; ++c)
      acc += (double)__bfloat162float(__float2bfloat16((float)(x48[c] * rstd) * __bfloat162float(g[c]))) *
             __bfloat162float(wq[(size_t)r * H + c]);
    const double got = __bfloat162float(q[r]);
    err += (got - acc) * (got - acc);
    ref2 += acc * acc;
  }
  int out[MAXB];
  CK(cudaMemcpy(out, p.out_tokens, MAXB * 4, cudaMemcpyDeviceToHost));
  std::vector<int> slots(LAYERS * (1 + MAX_SLOTS));
  CK(cudaMemcpy(slots.data(), p.slots, slots.size() * 4, cudaMemcpyDeviceToHost));
  double experts = 0;
  for (int l = 1; l < layers; ++l) experts += slots[l * (1 + MAX_SLOTS)];

  // top-k against the host: layer 48's slots and weights from the router logits the step left (layer 48's)
  int topk_bad = 0;
  if (layers == LAYERS) {
    std::vector<float> logits((size_t)batch * E), sw((size_t)MAX_SLOTS * batch);
    CK(cudaMemcpy(logits.data(), p.router, logits.size() * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(sw.data(), p.slot_w + (size_t)48 * MAX_SLOTS * batch, sw.size() * 4, cudaMemcpyDeviceToHost));
    std::vector<float> want((size_t)E * batch, 0.f);  // [expert][row]
    for (int b = 0; b < batch; ++b)
      for (int e = 0; e < E; ++e) {
        int rank = 0;
        for (int j = 0; j < E; ++j) {
          const float u = logits[b * E + j], v = logits[b * E + e];
          rank += u > v || (u == v && j < e);
        }
        if (rank < TOPK) want[(size_t)e * batch + b] = 1.f / (1.f + expf(-logits[b * E + e]));
      }
    const int* ls = &slots[48 * (1 + MAX_SLOTS)];
    std::vector<float> got((size_t)E * batch, 0.f);
    for (int k = 0; k < ls[0]; ++k)
      for (int b = 0; b < batch; ++b) got[(size_t)ls[1 + k] * batch + b] = sw[(size_t)k * batch + b];
    for (size_t i = 0; i < got.size(); ++i) topk_bad += fabsf(got[i] - want[i]) > 1e-5f;
  }

  // attention against the host: layer 48 (a full layer, the last to write q and attn_out) for row 0, every head,
  // from the device's q and the pool's pages; up to 32K (the pages are copied one by one)
  double attn_err = -1;
  if (layers == LAYERS && context <= 32768) {
    std::vector<bf16> out(QSIZE), kp((size_t)PAGE * KVH * HD), vp((size_t)PAGE * KVH * HD);
    CK(cudaMemcpy(out.data(), p.attn_out, QSIZE * 2, cudaMemcpyDeviceToHost));
    const int l = LAYERS - 1;
    std::vector<double> sc((size_t)HEADS * full_pages * PAGE, -INFINITY), acc((size_t)HEADS * HD, 0.0);
    std::vector<float> kf((size_t)full_pages * PAGE * KVH * HD), vf(kf.size());
    for (int pg = 0; pg < full_pages; ++pg) {
      const int phys = tables[((size_t)l * batch) * full_pages + pg];
      CK(cudaMemcpy(kp.data(), kpool + (size_t)phys * PAGE * KVH * HD, kp.size() * 2, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(vp.data(), vpool + (size_t)phys * PAGE * KVH * HD, vp.size() * 2, cudaMemcpyDeviceToHost));
      for (size_t i = 0; i < kp.size(); ++i) {
        kf[(size_t)pg * PAGE * KVH * HD + i] = __bfloat162float(kp[i]);
        vf[(size_t)pg * PAGE * KVH * HD + i] = __bfloat162float(vp[i]);
      }
    }
    double e2 = 0, r2 = 0;
    for (int h = 0; h < HEADS; ++h) {
      const int kvh = h / GROUP;
      double mx = -INFINITY;
      for (int tok = 0; tok < len; ++tok) {
        double dot = 0;
        for (int d = 0; d < HD; ++d)
          dot += (double)__bfloat162float(q[h * HD + d]) * kf[((size_t)tok * KVH + kvh) * HD + d];
        sc[(size_t)h * full_pages * PAGE + tok] = dot / sqrt((double)HD);
        mx = std::max(mx, dot / sqrt((double)HD));
      }
      double den = 0;
      for (int tok = 0; tok < len; ++tok) {
        const double w = exp(sc[(size_t)h * full_pages * PAGE + tok] - mx);
        den += w;
        for (int d = 0; d < HD; ++d) acc[(size_t)h * HD + d] += w * vf[((size_t)tok * KVH + kvh) * HD + d];
      }
      for (int d = 0; d < HD; ++d) {
        const double ref = acc[(size_t)h * HD + d] / den, got = __bfloat162float(out[h * HD + d]);
        e2 += (got - ref) * (got - ref);
        r2 += ref * ref;
      }
    }
    attn_err = sqrt(e2 / r2);
  }

  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  p.no_wait = no_wait;
  for (int i = 0; i < 3; ++i) launch();
  CK(cudaEventRecord(e0));
  for (int i = 0; i < steps; ++i) launch();
  CK(cudaEventRecord(e1));
  CK(cudaEventSynchronize(e1));
  float ms;
  CK(cudaEventElapsedTime(&ms, e0, e1));
  ms /= steps;
  long long clk[4];
  CK(cudaMemcpy(clk, p.clocks, sizeof clk, cudaMemcpyDeviceToHost));
  const double ghz = (double)(clk[2] - clk[0]) / (double)(clk[3] - clk[1]);
  if (cfg.profile) profile_report(sched, p, launch, flat.size());
  const int full_layers = (layers + 3) / 4, sliding = layers - full_layers;
  const double kv_tok = (double)full_layers * len + (double)sliding * std::min(len, WINDOW);
  const double frac = (double)layers / LAYERS;
  const double bytes = 2.0 * (frac * (w.n_qkv + w.n_o) + (layers > 1 ? (layers - 1) * (double)E * H : 0) +
                              (layers ? w.n_dgu + w.n_dd : 0) + w.n_lm) +
                       experts * 3.0 * I * H * 2 + batch * kv_tok * KVH * HD * 2 * 2;
  char lay[64] = "";
  snprintf(lay, sizeof lay, "%s%s%s%s p%d r%d", layers != LAYERS ? " L" : "", cfg.round_robin ? " rr" : "",
           cfg.router_first ? " rf" : "", cfg.drain ? " drain" : "", cfg.min_pages, cfg.router_groups);
  if (cfg.drain)
    snprintf(lay + strlen(lay), sizeof lay - strlen(lay), " t%d/%d/%d", cfg.up_pairs, cfg.down_groups, cfg.o_groups);
  if (layers != LAYERS) snprintf(lay + strlen(lay), sizeof lay - strlen(lay), "=%d", layers);
  printf("| %d%s%s | %6d | %7.3f | %7.1f | %5.2f | %4.2f | %5.1f%% | %5.1f%% | %5.1f | %.1e | %.1e | %d | %d | %.2f |\n", batch, lay,
         no_wait == 2 ? " no-load" : no_wait ? " no-wait" : "", context, ms,
         batch * 1000.0 / ms, bytes / 1e9, bytes / (ms * 1e-3) / 1e12, 100.0 * bytes / 4.8e12 / (ms * 1e-3),
         100.0 * bytes / copy_bw / (ms * 1e-3), layers > 1 ? experts / (layers - 1) : 0.0, sqrt(err / ref2), attn_err, topk_bad, out[0], ghz);
  fflush(stdout);
  for (void* ptr : {(void*)kpool, (void*)vpool, (void*)d_tasks, (void*)d_start, (void*)d_tables, (void*)d_tokens,
                    (void*)p.counters, (void*)p.x, (void*)p.qkv, (void*)p.router, (void*)p.slots, (void*)p.slot_w,
                    (void*)p.moe_act, (void*)p.part, (void*)p.attn_out, (void*)p.lm_best, (void*)p.out_tokens, (void*)p.clocks})
    CK(cudaFree(ptr));
}

// ./stream_step STEPS B:CONTEXT[:LAYERS[:NO_WAIT[:ROUND_ROBIN[:MIN_PAGES[:PROFILE[:ROUTER_FIRST[:DRAIN[:ROUTER_GROUPS
//                  [:UP_PAIRS[:DOWN_GROUPS[:O_GROUPS]]]]]]]]]]]] ...
int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IOLBF, 0);
  CK(cudaHostAlloc(&g_hang_host, sizeof(HangRecord), cudaHostAllocMapped));
  memset(g_hang_host, 0, sizeof(HangRecord));
  HangRecord* dev_record;
  CK(cudaHostGetDevicePointer(&dev_record, g_hang_host, 0));
  CK(cudaMemcpyToSymbol(g_hang, &dev_record, sizeof(dev_record)));
  const int steps = argc > 1 ? atoi(argv[1]) : 30;
  int sms;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  Weights w = make_weights();
  const double bw = measure_copy(sms, w.gate_up, w.gate_up + ((size_t)8 << 30));
  printf("copy bandwidth %.2f TB/s (read + written), %d SMs; ring stages B=1 %d, B=8 %d\n", bw / 1e12, sms, ring_stages(1),
         ring_stages(8));
  printf("| B | context | ms/step | tok/s | GB/step | TB/s | SoL 4.8 | SoL copy | experts/layer | q rel err | attn rel err | top-k bad | token | SM GHz |\n");
  printf("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
  for (int i = 2; i < argc; ++i) {
    Config c;
    sscanf(argv[i], "%d:%d:%d:%d:%d:%d:%d:%d:%d:%d:%d:%d:%d", &c.batch, &c.context, &c.layers, &c.no_wait,
           &c.round_robin, &c.min_pages, &c.profile, &c.router_first, &c.drain, &c.router_groups, &c.up_pairs,
           &c.down_groups, &c.o_groups);
    run_config(sms, w, c, steps, bw);
  }
  return 0;
}
