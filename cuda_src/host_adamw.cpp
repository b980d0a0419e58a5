// The offloaded optimizer's host pass (zerompi/optim/host_pass.py): one pass over the
// rank's host shard that unscales and clips the gradient, applies AdamW to the fp32
// master and moments, and writes the low-precision copy for the device, with the
// element arithmetic of the CUDA kernels (adamw_elem in adamw.cuh, compiled here as
// host code), so the result equals the numpy reference bit for bit.
//
// Built by g++ at first use (-O3 -march=native -ffp-contract=off -fno-math-errno: the
// compiler vectorises the element loop, contracts no multiply-add into an FMA, and
// sqrt/div stay correctly rounded). Work is a list of units (shard offset, length,
// segment or -1 for padding, upload tile), claimed in order by `threads` std::threads
// (no OpenMP: no spinning pool competing with the training thread once a pass is done);
// the caller waits for each upload tile as it completes (hp_wait) while the pass goes on.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

// The vector types common.cuh's 4-wide loads use (CUDA's, here plain structs).
struct float4 { float x, y, z, w; };
struct uint2 { unsigned int x, y; };
static inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
static inline uint2 make_uint2(unsigned int x, unsigned int y) { return {x, y}; }
#include "adamw.cuh"

#define HP_UNIT_COLS 4  // shard offset, length, segment (-1: padding), tile
#define HP_ROW_COLS 9   // as adamw_table.cu: 8 AdamWArgs scalars, then 1 = update / 0 = skip

namespace {

struct Job {
  float* master;
  float* exp_avg;
  float* exp_avg_sq;
  const void* grad;
  void* out;
  int gtag, otag;  // 0 f32, 1 bf16, 2 f16; out also 3 = none
  const int64_t* units;
  int64_t nunits;
  const float* rows;
  int64_t ntiles;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> tiles_left{0};
  std::chrono::steady_clock::time_point t0;
  double seconds = 0.0;                    // launch to the last tile written, under mu
  std::vector<std::atomic<int64_t>> left;  // per tile: units not finished
  std::vector<char> done;                  // per tile, under mu
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::thread> threads;
  explicit Job(int64_t nt) : left(nt), done(nt, 0) {}
};

// One unit. Segments skipped this step (no gradient anywhere) and padding only refresh
// the low-precision copy from the master, so the whole staging is valid every step.
template <typename G, typename O>
void unit(Job& j, const int64_t* u) {
  const usize lo = (usize)u[0], n = (usize)u[1];
  float* __restrict p = j.master + lo;
  typename O::storage* __restrict o = static_cast<typename O::storage*>(j.out) + lo;
  const float* r = u[2] >= 0 ? j.rows + HP_ROW_COLS * u[2] : nullptr;
  if (r == nullptr || r[8] == 0.0f) {
    if (O::present)
      for (usize i = 0; i < n; ++i) o[i] = O::store(p[i]);
    return;
  }
  const AdamWArgs a = {r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7]};
  float* __restrict m = j.exp_avg + lo;
  float* __restrict v = j.exp_avg_sq + lo;
  const typename G::storage* __restrict g = static_cast<const typename G::storage*>(j.grad) + lo;
  for (usize i = 0; i < n; ++i) {
    float pi = p[i], mi = m[i], vi = v[i];
    adamw_elem(pi, mi, vi, G::load(g[i]), a);
    p[i] = pi; m[i] = mi; v[i] = vi;
    if (O::present) o[i] = O::store(pi);
  }
}

template <typename G, typename O>
void work(Job* j) {
  for (;;) {
    const int64_t k = j->next.fetch_add(1);
    if (k >= j->nunits) return;
    const int64_t* u = j->units + HP_UNIT_COLS * k;
    unit<G, O>(*j, u);
    if (j->left[u[3]].fetch_sub(1) == 1) {
      std::lock_guard<std::mutex> lk(j->mu);
      j->done[u[3]] = 1;
      if (--j->tiles_left == 0)
        j->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - j->t0).count();
      j->cv.notify_all();
    }
  }
}

typedef void (*WorkFn)(Job*);

template <typename G>
WorkFn pick_out(int otag) {
  switch (otag) {
    case 0: return work<G, F32>;
    case 1: return work<G, BF16>;
    case 2: return work<G, F16>;
    case 3: return work<G, NoOut>;
  }
  return nullptr;
}

WorkFn pick(int gtag, int otag) {
  switch (gtag) {
    case 0: return pick_out<F32>(otag);
    case 1: return pick_out<BF16>(otag);
    case 2: return pick_out<F16>(otag);
  }
  return nullptr;
}

}  // namespace

extern "C" {

// Starts the pass on `threads` threads and returns at once (nullptr on bad tags).
// The buffers, units and rows must stay alive and untouched until hp_join.
void* hp_launch(float* master, float* exp_avg, float* exp_avg_sq, const void* grad, void* out,
                int gtag, int otag, const int64_t* units, int64_t nunits, const float* rows,
                int64_t ntiles, int threads) {
  WorkFn fn = pick(gtag, otag);
  if (fn == nullptr || threads < 1 || ntiles < 0) return nullptr;
  Job* j = new Job(ntiles);
  j->master = master; j->exp_avg = exp_avg; j->exp_avg_sq = exp_avg_sq;
  j->grad = grad; j->out = out; j->gtag = gtag; j->otag = otag;
  j->units = units; j->nunits = nunits; j->rows = rows; j->ntiles = ntiles;
  for (int64_t k = 0; k < nunits; ++k) j->left[units[HP_UNIT_COLS * k + 3]].fetch_add(1);
  j->t0 = std::chrono::steady_clock::now();
  for (int64_t t = 0; t < ntiles; ++t) {
    if (j->left[t].load() == 0) j->done[t] = 1;  // a tile of no units is done already
    else ++j->tiles_left;
  }
  for (int t = 0; t < threads; ++t) j->threads.emplace_back(fn, j);
  return j;
}

// Blocks until every unit of upload tile `tile` is written.
void hp_wait(void* h, int64_t tile) {
  Job* j = static_cast<Job*>(h);
  std::unique_lock<std::mutex> lk(j->mu);
  j->cv.wait(lk, [&] { return j->done[tile] != 0; });
}

// Blocks until the pass is over, then frees it; returns its seconds (launch to the last
// tile written).
double hp_join(void* h) {
  Job* j = static_cast<Job*>(h);
  for (auto& t : j->threads) t.join();
  const double s = j->seconds;
  delete j;
  return s;
}

}  // extern "C"
