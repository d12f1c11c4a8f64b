// The CPU allocator zerocompile.heap installs: tensors of kMinBlock bytes and more live in blocks
// mapped straight from the kernel and, once freed, are kept for the next request of the same
// size, so a training step's buffers never pass through glibc's heap (whose holes are what made
// a rank's RSS creep). Smaller tensors go to c10's own alloc_cpu/free_cpu as before.
//
// How much stays cached is bounded: at most `cap` bytes, the most a step between two optimizer
// steps has needed beyond its least bytes in use (peak bytes mapped minus least bytes in use:
// blocks of one size may sit cached while another size is mapped), over the last two epochs; past the cap the least recently freed block is unmapped. Before the first optimizer
// step the cap is 0 (building, initialising and loading a model map and unmap as they go), and a
// block nobody took during a whole epoch is unmapped when the epoch ends. Python drives the
// steps and epochs (zerocompile/heap.py); the functions at the end are its ctypes interface.

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/Exception.h>
#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <deque>
#include <list>
#include <mutex>
#include <unordered_map>

namespace {

constexpr size_t kMinBlock = 128 * 1024;  // glibc's own mmap threshold before it starts rising
constexpr uint8_t kPriority = 1;          // above c10's default CPU allocator (0)

struct FreeBlock {
  void* ptr;
  size_t size;
  uint64_t epoch;
};

class BlockCache final : public c10::Allocator {
 public:
  static BlockCache& get() {
    static BlockCache* cache = new BlockCache();  // never destroyed: tensors may outlive exit
    return *cache;
  }

  c10::DataPtr allocate(size_t nbytes) override {
    void* ptr = nullptr;
    c10::DeleterFnPtr deleter = &free_small;
    if (nbytes < kMinBlock) {
      ptr = c10::alloc_cpu(nbytes);
    } else {
      size_t size = (nbytes + page_ - 1) / page_ * page_;
      ptr = take_cached(size);
      if (ptr == nullptr) {
        ptr = map(size);
      }
      deleter = &free_any;
    }
    c10::profiledCPUMemoryReporter().New(ptr, nbytes);
    return {ptr, ptr, deleter, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return &free_any;
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  bool install() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      installed_ = true;
    }
    c10::SetCPUAllocator(this, kPriority);
    return c10::GetCPUAllocator() == this;
  }

  void uninstall() {
    c10::SetCPUAllocator(c10::GetDefaultCPUAllocator(), kPriority);
    std::lock_guard<std::mutex> lock(mutex_);
    installed_ = false;
    while (!lru_.empty()) {
      unmap_oldest();
    }
    cap_ = epoch_window_ = last_epoch_window_ = 0;
  }

  bool installed() const {
    return c10::GetCPUAllocator() == this;
  }

  void after_optimizer_step() {
    std::lock_guard<std::mutex> lock(mutex_);
    epoch_window_ = std::max(epoch_window_, peak_mapped_ - least_in_use_);
    cap_ = std::max(epoch_window_, last_epoch_window_);
    peak_mapped_ = mapped_;
    least_in_use_ = in_use_;
    shrink_to_cap();
  }

  void end_epoch() {
    std::lock_guard<std::mutex> lock(mutex_);
    while (!lru_.empty() && lru_.front().epoch < epoch_) {
      unmap_oldest();
    }
    ++epoch_;
    last_epoch_window_ = epoch_window_;
    epoch_window_ = 0;
  }

  void stats(int64_t* out) {
    std::lock_guard<std::mutex> lock(mutex_);
    out[0] = static_cast<int64_t>(mapped_);
    out[1] = static_cast<int64_t>(cached_);
    out[2] = static_cast<int64_t>(in_use_);
    out[3] = static_cast<int64_t>(cap_);
    out[4] = static_cast<int64_t>(maps_);
    out[5] = static_cast<int64_t>(reuses_);
  }

 private:
  BlockCache() : page_(static_cast<size_t>(sysconf(_SC_PAGESIZE))) {
    // A fork (a DataLoader worker) while another thread holds the lock must not hand the child
    // a lock nobody will release.
    pthread_atfork(
        [] { get().mutex_.lock(); },
        [] { get().mutex_.unlock(); },
        [] { get().mutex_.unlock(); });
  }

  static void free_small(void* ptr) {
    if (ptr == nullptr) {
      return;
    }
    c10::profiledCPUMemoryReporter().Delete(ptr);
    c10::free_cpu(ptr);
  }

  // The deleter of every block, and raw_deleter() for all: a pointer this cache did not map
  // came from alloc_cpu.
  static void free_any(void* ptr) {
    if (ptr == nullptr) {
      return;
    }
    c10::profiledCPUMemoryReporter().Delete(ptr);
    if (!get().give_back(ptr)) {
      c10::free_cpu(ptr);
    }
  }

  void* take_cached(size_t size) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto found = free_by_size_.find(size);
    if (found == free_by_size_.end() || found->second.empty()) {
      return nullptr;
    }
    auto block = found->second.back();  // the most recently freed: its pages are the warmest
    found->second.pop_back();
    void* ptr = block->ptr;
    lru_.erase(block);
    cached_ -= size;
    ++reuses_;
    mark_in_use(ptr, size);
    return ptr;
  }

  void* map(size_t size) {
    void* ptr = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    std::lock_guard<std::mutex> lock(mutex_);
    if (ptr == MAP_FAILED) {
      while (!lru_.empty()) {
        unmap_oldest();
      }
      ptr = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (ptr == MAP_FAILED) {
        c10::profiledCPUMemoryReporter().OutOfMemory(size);
        TORCH_CHECK_WITH(OutOfMemoryError, false,
            "zerocompile's CPU block cache: not enough memory to allocate ", size, " bytes");
      }
    }
    mapped_ += size;
    peak_mapped_ = std::max(peak_mapped_, mapped_);
    ++maps_;
    mark_in_use(ptr, size);
    return ptr;
  }

  void mark_in_use(void* ptr, size_t size) {
    blocks_in_use_.emplace(ptr, size);
    in_use_ += size;
  }

  bool give_back(void* ptr) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto found = blocks_in_use_.find(ptr);
    if (found == blocks_in_use_.end()) {
      return false;
    }
    size_t size = found->second;
    blocks_in_use_.erase(found);
    in_use_ -= size;
    least_in_use_ = std::min(least_in_use_, in_use_);
    if (!installed_ || size > cap_) {
      munmap(ptr, size);
      mapped_ -= size;
      return true;
    }
    lru_.push_back({ptr, size, epoch_});
    free_by_size_[size].push_back(std::prev(lru_.end()));
    cached_ += size;
    shrink_to_cap();
    return true;
  }

  void shrink_to_cap() {
    while (cached_ > cap_) {
      unmap_oldest();
    }
  }

  // Blocks of one size sit in their deque in the order they were freed, as in lru_, so the
  // oldest block overall is the first of its size.
  void unmap_oldest() {
    FreeBlock oldest = lru_.front();
    auto& same_size = free_by_size_[oldest.size];
    same_size.pop_front();
    if (same_size.empty()) {
      free_by_size_.erase(oldest.size);
    }
    lru_.pop_front();
    munmap(oldest.ptr, oldest.size);
    cached_ -= oldest.size;
    mapped_ -= oldest.size;
  }

  const size_t page_;
  std::mutex mutex_;
  bool installed_ = false;
  std::list<FreeBlock> lru_;  // cached blocks, least recently freed first
  std::unordered_map<size_t, std::deque<std::list<FreeBlock>::iterator>> free_by_size_;
  std::unordered_map<void*, size_t> blocks_in_use_;
  size_t mapped_ = 0, cached_ = 0, in_use_ = 0, peak_mapped_ = 0, least_in_use_ = 0;
  size_t cap_ = 0, epoch_window_ = 0, last_epoch_window_ = 0;
  uint64_t epoch_ = 0;
  uint64_t maps_ = 0, reuses_ = 0;
};

}  // namespace

extern "C" {
int zc_block_cache_install() {
  return BlockCache::get().install() ? 1 : 0;
}
void zc_block_cache_uninstall() {
  BlockCache::get().uninstall();
}
int zc_block_cache_installed() {
  return BlockCache::get().installed() ? 1 : 0;
}
void zc_block_cache_after_optimizer_step() {
  BlockCache::get().after_optimizer_step();
}
void zc_block_cache_end_epoch() {
  BlockCache::get().end_epoch();
}
// mapped, cached, in use and cap bytes; blocks mapped and blocks reused, since the process began.
void zc_block_cache_stats(int64_t* out) {
  BlockCache::get().stats(out);
}
}
