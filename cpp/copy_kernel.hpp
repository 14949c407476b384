// The kernel: many N-d strided byte-region copies, each with an optional fused cast,
// spread over threads (thread_pool.hpp); SIMD transposes in transpose_blocks.hpp. Plain
// C++; the Python binding is cpp/bindings.cpp, its types in python/aoa/_core.pyi.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "casts.hpp"

namespace aoa {

struct SourceBuffer {
  const uint8_t* data;
  int64_t size;
};

struct DestinationBuffer {
  uint8_t* data;
  int64_t size;
};

// A table the kernel refuses; the message names the copy. Nothing has been written.
class CopyError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// A read or write of memory that vanished under the kernel (a mapped file truncated while
// the copies ran) at `address`: the copies stopped there.
class BusError : public std::runtime_error {
 public:
  explicit BusError(const void* address)
      : std::runtime_error("bus error at address " +
                           std::to_string(reinterpret_cast<uintptr_t>(address))),
        address(address) {}
  const void* address;
};

// Int64 fields of one copy in the table, in this order, records back to back:
//   source, source_offset, destination, destination_offset,
//   source_dtype, destination_dtype, via_count, via[via_count],
//   ndim, shape[ndim], source_strides[ndim], destination_strides[ndim],
//   has_scale, and when it is 1 (a dequantizing copy, aoa.runtime.copies.BlockScale):
//   scale_source, scale_dtype, scale_offset, blocks[ndim], phases[ndim], scale_strides[ndim]
// Strides are in bytes, one per destination axis. Every record is checked (buffer indices,
// dtype codes, casts, all regions within their buffers) before any byte moves.
// Sources must not overlap destinations, nor destinations each other. A read of memory that
// vanished (a mapped file truncated meanwhile) stops the copies and throws BusError
// (bus_guard.hpp) with the address; what was written so far stays.
void execute_copies(const int64_t* table, int64_t table_length,
                    const std::vector<SourceBuffer>& sources,
                    const std::vector<DestinationBuffer>& destinations, int64_t threads);

}  // namespace aoa
