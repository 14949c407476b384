// A vector of trivially copyable items whose first N live inside it: a plan of many small
// tensors has hundreds of thousands of copies, each with a few axes and cast steps, and a
// heap allocation apiece cost a third of reading the table (an arena was slower still: its
// fresh pages fault where malloc reuses warm ones). Past N it moves to the heap.
#pragma once

#include <cstddef>
#include <cstring>
#include <memory>
#include <type_traits>

namespace aoa {

template <class T, size_t N>
class SmallVector {
  static_assert(std::is_trivially_copyable_v<T> && std::is_trivially_default_constructible_v<T>);

 public:
  SmallVector() = default;
  SmallVector(const SmallVector& other) { *this = other; }
  SmallVector& operator=(const SmallVector& other) {
    if (this == &other) return *this;
    size_ = 0;
    reserve(other.size_);
    std::memcpy(data(), other.data(), other.size_ * sizeof(T));
    size_ = other.size_;
    return *this;
  }
  SmallVector(SmallVector&& other) noexcept { *this = std::move(other); }
  SmallVector& operator=(SmallVector&& other) noexcept {
    if (this == &other) return *this;
    heap_ = std::move(other.heap_);
    capacity_ = other.capacity_;
    size_ = other.size_;
    if (!heap_) std::memcpy(inline_, other.inline_, size_ * sizeof(T));
    other.capacity_ = N;
    other.size_ = 0;
    return *this;
  }

  T* data() { return heap_ ? heap_.get() : inline_; }
  const T* data() const { return heap_ ? heap_.get() : inline_; }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  T* begin() { return data(); }
  T* end() { return data() + size_; }
  const T* begin() const { return data(); }
  const T* end() const { return data() + size_; }
  T& operator[](size_t i) { return data()[i]; }
  const T& operator[](size_t i) const { return data()[i]; }
  T& front() { return data()[0]; }
  T& back() { return data()[size_ - 1]; }
  const T& back() const { return data()[size_ - 1]; }

  void reserve(size_t capacity) {
    if (capacity <= capacity_) return;
    std::unique_ptr<T[]> grown(new T[capacity]);
    std::memcpy(grown.get(), data(), size_ * sizeof(T));
    heap_ = std::move(grown);
    capacity_ = capacity;
  }
  void push_back(const T& item) {
    const T copy = item;  // `item` may lie in the storage that growing frees
    if (size_ == capacity_) reserve(2 * capacity_);
    data()[size_++] = copy;
  }
  // Drops the items from `size` on (never grows).
  void shrink_to(size_t size) {
    if (size < size_) size_ = size;
  }

 private:
  T inline_[N];
  std::unique_ptr<T[]> heap_;
  size_t capacity_ = N;
  size_t size_ = 0;
};

}  // namespace aoa
