// The threads that share the CPU kernels' work (packed linear layers, paged attention).
//
// OpenMP's teams (at::parallel_for) end each parallel region at a barrier that every thread of
// the team must reach, including one that has not yet woken up or that the OS has paused to run
// something else. Served, the executor shares its cores with the controller and the HTTP
// clients, and a decode step has ~150 such regions: measured with the SmolLM2-135M decode step
// at batch 64 in bf16 on two cores, the step took 28 ms alone but 48-55 ms served, a third of
// it the calling thread waiting at those barriers for a helper that had nothing left to do.
//
// Here a job is a worker function that claims its work from a shared counter and returns when
// none is left. The calling thread always runs it; each helper runs it too if it wakes while the
// job is open. The caller closes the job when its own worker returns (every piece of work is
// then claimed) and waits only for the helpers that took the job, which are finishing claimed
// work. A helper that wakes after the close sees a newer job number and does not touch the job.
// Between jobs a helper spins for a short while (the next region of a step follows within
// microseconds), then sleeps on a futex so that an idle executor leaves its cores to others.
#include "kernels.h"

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <mutex>
#include <thread>

namespace tandem {
namespace {

class TaskPool {
 public:
  // Helper threads started; jobs offered to helpers; helper runs of those jobs.
  std::array<int64_t, 3> stats() {
    std::lock_guard<std::mutex> held(caller_);
    return {started_, jobs_.load(std::memory_order_relaxed),
            helped_.load(std::memory_order_relaxed)};
  }

  // Runs `worker` on the calling thread and on up to `helpers` pool threads; see the top.
  void run(int64_t helpers, c10::function_ref<void()> worker) {
    std::unique_lock<std::mutex> held(caller_, std::try_to_lock);
    if (helpers <= 0 || in_worker_ || !held.owns_lock()) {  // nested, or another caller's turn
      worker();
      return;
    }
    grow(helpers);
    jobs_.fetch_add(1, std::memory_order_relaxed);
    worker_ = &worker;
    wanted_.store(helpers, std::memory_order_relaxed);
    joined_.store(0, std::memory_order_relaxed);
    const uint32_t open = seq_.load(std::memory_order_relaxed) + 1;  // odd: open
    seq_.store(open, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0)
      syscall(SYS_futex, seq_word(), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
    in_worker_ = true;
    worker();
    in_worker_ = false;
    seq_.store(open + 1, std::memory_order_seq_cst);  // even: closed
    // Helpers inside are finishing work they claimed (or leaving a job with nothing left).
    for (int spins = 0; inside_.load(std::memory_order_seq_cst) > 0; ++spins)
      if (spins < 4096) {
        _mm_pause();
      } else {
        std::this_thread::yield();
      }
  }

 private:
  uint32_t* seq_word() { return reinterpret_cast<uint32_t*>(&seq_); }

  void grow(int64_t helpers) {
    while (started_ < helpers) {
      // Jobs from the next one on are the new helper's (seq_ is even: none is open).
      std::thread(&TaskPool::serve, this, seq_.load(std::memory_order_relaxed) - 1).detach();
      ++started_;
    }
  }

  // A helper: waits for an open job newer than `done`, runs it if still open, forever.
  void serve(uint32_t done) {
    in_worker_ = true;  // kernels called from a worker run inline
    for (;;) {
      const uint32_t seen = wait_for_job(done);
      done = seen;
      inside_.fetch_add(1, std::memory_order_seq_cst);
      const int64_t wanted = wanted_.load(std::memory_order_relaxed);
      if (seq_.load(std::memory_order_seq_cst) == seen &&
          joined_.fetch_add(1, std::memory_order_relaxed) < wanted) {
        (*worker_)();
        helped_.fetch_add(1, std::memory_order_relaxed);
      }
      inside_.fetch_sub(1, std::memory_order_seq_cst);
    }
  }

  // The number of an open job other than `done`: spins for spin_us_, then sleeps on the futex.
  uint32_t wait_for_job(uint32_t done) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us_);
    for (int spins = 0;; ++spins) {
      const uint32_t seen = seq_.load(std::memory_order_acquire);
      if ((seen & 1u) && seen != done) return seen;
      if ((spins & 63) != 63 || std::chrono::steady_clock::now() < until) {
        _mm_pause();
        continue;
      }
      sleepers_.fetch_add(1, std::memory_order_seq_cst);
      const uint32_t now = seq_.load(std::memory_order_seq_cst);
      if (!((now & 1u) && now != done))
        syscall(SYS_futex, seq_word(), FUTEX_WAIT_PRIVATE, now, nullptr, nullptr, 0);
      sleepers_.fetch_sub(1, std::memory_order_seq_cst);
      spins = 0;
    }
  }

  static int64_t spin_us_from_env() {
    const char* text = std::getenv("TANDEM_CPU_SPIN_US");
    return text ? std::max<int64_t>(0, std::atoll(text)) : 50;
  }

  std::mutex caller_;                       // one caller at a time (others run alone)
  int64_t started_ = 0;                     // helper threads started (never stopped)
  const int64_t spin_us_ = spin_us_from_env();  // a helper's spin before it sleeps
  std::atomic<uint32_t> seq_{0};            // job number: odd while open, even once closed
  std::atomic<int64_t> sleepers_{0};        // helpers asleep on seq_ (or about to be)
  std::atomic<int64_t> inside_{0};          // helpers between taking and leaving a job
  std::atomic<int64_t> joined_{0};          // helpers that took the open job
  std::atomic<int64_t> wanted_{0};          // how many helpers the open job may take
  std::atomic<int64_t> jobs_{0};            // jobs offered to helpers (stats)
  std::atomic<int64_t> helped_{0};          // helper runs of a job's worker (stats)
  c10::function_ref<void()>* worker_ = nullptr;  // the open job's worker (the caller's)
  static thread_local bool in_worker_;      // this thread is running a worker
};

thread_local bool TaskPool::in_worker_ = false;

TaskPool& pool() {
  static TaskPool* pool = new TaskPool();  // never destroyed: helpers outlive static teardown
  return *pool;
}

}  // namespace

void run_workers(int64_t workers, c10::function_ref<void()> worker) {
  pool().run(std::min<int64_t>(workers, at::get_num_threads()) - 1, worker);
}

std::vector<int64_t> task_pool_stats() {
  const auto s = pool().stats();
  return {s.begin(), s.end()};
}

}  // namespace tandem
