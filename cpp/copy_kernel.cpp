#include "copy_kernel.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <utility>

#include "bus_guard.hpp"
#include "small_vector.hpp"
#include "thread_pool.hpp"
#include "transpose_blocks.hpp"

namespace aoa {
namespace {

using namespace blocks;  // NOLINT: the block functions, by name, in plan_tiles

// ---------------------------------------------------------------------------------------
// Rows: `count` elements, strided on both sides. Every loop below ends in one of these.

using RowFn = void (*)(const uint8_t* source, int64_t source_stride, uint8_t* destination,
                       int64_t destination_stride, int64_t count);

template <int64_t Size>
void copy_row(const uint8_t* source, int64_t source_stride, uint8_t* destination,
              int64_t destination_stride, int64_t count) {
  if (source_stride == Size && destination_stride == Size) {
    std::memcpy(destination, source, static_cast<size_t>(count * Size));
    return;
  }
  for (int64_t i = 0; i < count; ++i)
    std::memcpy(destination + i * destination_stride, source + i * source_stride, Size);
}

template <Dtype S, Dtype D>
inline void cast_one(const uint8_t* source, uint8_t* destination) {
  StorageT<S> value;
  std::memcpy(&value, source, sizeof value);
  const StorageT<D> result = cast_element<S, D>(value);
  std::memcpy(destination, &result, sizeof result);
}

template <Dtype S, Dtype D>
void cast_row(const uint8_t* source, int64_t source_stride, uint8_t* destination,
              int64_t destination_stride, int64_t count) {
  constexpr int64_t kIn = sizeof(StorageT<S>), kOut = sizeof(StorageT<D>);
  if (source_stride == kIn && destination_stride == kOut) {  // constant strides vectorize
    for (int64_t i = 0; i < count; ++i) cast_one<S, D>(source + i * kIn, destination + i * kOut);
    return;
  }
  for (int64_t i = 0; i < count; ++i)
    cast_one<S, D>(source + i * source_stride, destination + i * destination_stride);
}

template <Dtype S, Dtype D> constexpr RowFn cast_row_or_null() {
  if constexpr (is_value_cast(S, D)) return &cast_row<S, D>;
  return nullptr;
}

template <size_t... I>
constexpr std::array<RowFn, sizeof...(I)> make_cast_rows(std::index_sequence<I...>) {
  return {cast_row_or_null<static_cast<Dtype>(I / kDtypeCount),
                           static_cast<Dtype>(I % kDtypeCount)>()...};
}

constexpr auto kCastRows =
    make_cast_rows(std::make_index_sequence<static_cast<size_t>(kDtypeCount * kDtypeCount)>{});

RowFn cast_row_for(Dtype source, Dtype destination) {
  return kCastRows[static_cast<size_t>(static_cast<int64_t>(source) * kDtypeCount +
                                       static_cast<int64_t>(destination))];
}

RowFn copy_row_for(int64_t itemsize) {
  switch (itemsize) {
    case 8: return &copy_row<8>;
    case 4: return &copy_row<4>;
    case 2: return &copy_row<2>;
    default: return &copy_row<1>;
  }
}

// `count` rows of `Bytes` contiguous bytes each, strided on both sides: the memcpy of a
// known size becomes a few moves.
template <int64_t Bytes>
void copy_rows_of(const uint8_t* source, int64_t source_stride, uint8_t* destination,
                  int64_t destination_stride, int64_t count) {
  for (int64_t i = 0; i < count; ++i)
    std::memcpy(destination + i * destination_stride, source + i * source_stride, Bytes);
}

// Rows of `bytes` contiguous bytes (a plain copy's last axis): a tensor of many short rows
// (the experts of a large MoE: rows of 16 or 32 bytes) costs a call per row otherwise.
void copy_rows(int64_t bytes, const uint8_t* source, int64_t source_stride,
               uint8_t* destination, int64_t destination_stride, int64_t count) {
  switch (bytes) {
    case 8: return copy_rows_of<8>(source, source_stride, destination, destination_stride, count);
    case 16: return copy_rows_of<16>(source, source_stride, destination, destination_stride, count);
    case 32: return copy_rows_of<32>(source, source_stride, destination, destination_stride, count);
    case 64: return copy_rows_of<64>(source, source_stride, destination, destination_stride, count);
    default:
      for (int64_t i = 0; i < count; ++i)
        std::memcpy(destination + i * destination_stride, source + i * source_stride,
                    static_cast<size_t>(bytes));
  }
}

// ---------------------------------------------------------------------------------------
// A validated copy, its axes simplified into loop order.

struct Axis {
  int64_t extent;
  int64_t source_stride;
  int64_t destination_stride;
};

struct CastStep {
  RowFn row;
  int64_t output_itemsize;
};

// Per axis of a dequantizing copy: `block` elements share a scale, the copy starts `phase`
// elements into its block, and `stride` bytes lie between neighbouring blocks' scales.
struct ScaleAxis {
  int64_t block;
  int64_t phase;
  int64_t stride;
};

// A dequantizing copy's scales: value = float32(stored) * float32(scale), then the steps.
struct BlockScales {
  const uint8_t* data = nullptr;  // the scale of the first element's block; null: none
  RowFn widen = nullptr;          // stored values -> float32
  const float* table = nullptr;   // fp8 values: the 256 bytes as float32, instead of `widen`
  RowFn widen_scale = nullptr;    // one scale -> float32
  std::vector<ScaleAxis> axes;    // one per axis of the copy, as `PreparedCopy::axes`
};

struct PreparedCopy;

// Axes and cast steps a copy holds without a heap allocation (tables have few of either).
constexpr size_t kInlineAxes = 4;
constexpr size_t kInlineSteps = 2;
using DtypeChain = SmallVector<Dtype, kInlineSteps + 2>;
using CastSteps = SmallVector<CastStep, kInlineSteps>;

// Columns [column0, column0 + width) of rows [row0, row_end) of a copy's last two axes.
using TileFn = void (*)(const PreparedCopy& copy, const uint8_t* source, uint8_t* destination,
                        int64_t row0, int64_t row_end, int64_t column0, int64_t width);

// One row of the copy table as the kernel runs it: buffers resolved, axes simplified, tiles
// planned. (Named apart from Python's aoa.PlannedCopy, the plan's row it is prepared from.)
struct PreparedCopy {
  const uint8_t* source;  // at the offset
  uint8_t* destination;
  int64_t source_itemsize;
  int64_t destination_itemsize;
  SmallVector<Axis, kInlineAxes> axes;       // outermost first; empty for a single element
  SmallVector<CastStep, kInlineSteps> steps;  // one row per rounding step; one plain copy
                                              // when none
  bool tiled;                   // the last two axes are walked in tiles
  TileFn tile;                  // how a tile is walked, when `tiled`
  int64_t tile_rows;            // the tile's shape, when `tiled`
  int64_t tile_columns;
  int64_t first_column;         // where the first full-width tile starts, when `tiled`
  int64_t row_bytes;            // > 0: a plain copy whose last axis is contiguous on both
                                // sides, that many bytes (walked as rows, `copy_rows`)
  int64_t bytes;                // read plus written: the weight for splitting work
  BlockScales scales;           // when `scales.data`: the steps start from float32
};

// Items per tile side. 128 x 128 measured best on 8192 x 8192 transposes of float32 and
// bfloat16 (64 and 256 were 20-50% slower): a tile's source lines stay in L2.
constexpr int64_t kTile = 128;
// Streamed transposes go in tiles of 1024 rows by 128 destination bytes: each source line
// is read in one long run (the hardware prefetcher follows it) and each destination row
// gets two whole lines. Measured on 8192 x 8192 float32 and bfloat16: 1.5-2x faster than
// 128 x 128; 512 rows, or 64 and 256 bytes, were 10-40% slower. Without streaming such
// narrow tiles are 2x slower than square ones.
constexpr int64_t kStreamTileRows = 1024;
constexpr int64_t kStreamTileBytes = 128;
// Destinations of at least this many bytes (twice L2) are written with non-temporal stores
// in the streamed tiles: a destination that leaves L2 is not read back from cache (a
// staging buffer goes to the disk, or to tmpfs through the kernel's own copy). Measured on
// float32 transposes of the benchmark model's shapes, one thread, in turn with 16 MiB (the
// value before): 1024 x 2048 (8 MiB) 1.6-1.7 ms against 2.5-2.6 ms, 1024 x 1024 0.74-0.78
// against 0.90-1.5 ms; 512 x 512 (1 MiB) and below stay in square tiles.
constexpr int64_t kStreamBytes = int64_t{1} << 20;
// Elements a cast chain converts at a time through its scratch rows.
constexpr int64_t kChainBlock = 512;

std::string tuple_text(const int64_t* values, int64_t count) {
  std::ostringstream text;
  text << '(';
  for (int64_t i = 0; i < count; ++i) text << (i ? ", " : "") << values[i];
  text << (count == 1 ? ",)" : ")");
  return text.str();
}

[[noreturn]] void refuse(size_t copy, const std::string& why) {
  throw CopyError("copy " + std::to_string(copy) + ": " + why);
}

// Whether the bytes the region reaches lie within [0, size); the region has no zero extent.
bool region_fits(int64_t offset, const int64_t* shape, const int64_t* strides, int64_t ndim,
                 int64_t itemsize, int64_t size) {
  int64_t low = offset, high = offset;  // first and last element's first byte
  for (int64_t k = 0; k < ndim; ++k) {
    int64_t span;
    if (__builtin_mul_overflow(shape[k] - 1, strides[k], &span)) return false;
    if (__builtin_add_overflow(span < 0 ? low : high, span, span < 0 ? &low : &high))
      return false;
  }
  return low >= 0 && high <= size - itemsize;
}

// The value casts of the chain source -> via... -> destination, as rows (none when the
// bytes stay as they are); refuses an unsupported step.
CastSteps cast_steps(size_t copy, const DtypeChain& chain) {
  CastSteps steps;
  for (size_t k = 1; k < chain.size(); ++k) {
    const Dtype from = chain[k - 1], to = chain[k];
    if (is_bytes_cast(from, to)) continue;  // the bytes already are the value of `to`
    if (!is_value_cast(from, to))
      refuse(copy, std::string("cannot cast ") + dtype_name(from) + " to " + dtype_name(to) +
                       ": only casts to floating types, and between integers of one size, "
                       "are supported");
    steps.push_back({cast_row_for(from, to), itemsize(to)});
  }
  return steps;
}

// Drop unit axes, order by destination stride, merge axes that are contiguous on both
// sides (a contiguous tensor becomes one row, one memcpy), and tile a transpose.
// (In place, with no allocation: a plan of many small tensors has hundreds of thousands of
// copies, and a heap allocation per step of this cost as much as copying their bytes.)
void simplify(PreparedCopy& copy) {
  SmallVector<Axis, kInlineAxes>& axes = copy.axes;
  axes.shrink_to(static_cast<size_t>(
      std::remove_if(axes.begin(), axes.end(), [](const Axis& a) { return a.extent == 1; }) -
      axes.begin()));
  // A stable insertion sort: a copy has a few axes (std::stable_sort allocates a buffer).
  for (size_t i = 1; i < axes.size(); ++i)
    for (size_t j = i; j > 0 && std::llabs(axes[j - 1].destination_stride) <
                                    std::llabs(axes[j].destination_stride);
         --j)
      std::swap(axes[j - 1], axes[j]);
  size_t kept = 0;
  for (const Axis& axis : axes) {
    if (kept > 0) {
      Axis& outer = axes[kept - 1];
      if (outer.source_stride == axis.source_stride * axis.extent &&
          outer.destination_stride == axis.destination_stride * axis.extent) {
        outer = {outer.extent * axis.extent, axis.source_stride, axis.destination_stride};
        continue;
      }
    }
    axes[kept++] = axis;
  }
  axes.shrink_to(kept);

  copy.tiled = false;
  if (axes.size() < 2) return;
  const int64_t inner_stride = std::llabs(axes.back().source_stride);
  if (inner_stride == copy.source_itemsize) return;
  // The axis along which the source is most contiguous becomes the other tile axis.
  auto most_contiguous =
      std::min_element(axes.begin(), axes.end() - 1, [](const Axis& a, const Axis& b) {
        return std::llabs(a.source_stride) < std::llabs(b.source_stride);
      });
  if (std::llabs(most_contiguous->source_stride) >= inner_stride) return;
  std::rotate(most_contiguous, most_contiguous + 1, axes.end() - 1);
  copy.tiled = true;
}

void plan_tiles(PreparedCopy& copy, bool moves_bytes);

class TableReader {
 public:
  TableReader(const int64_t* table, int64_t length) : table_(table), length_(length) {}
  bool done() const { return position_ == length_; }
  // The rest of the table from the next field, and how many fields that is.
  const int64_t* rest() const { return table_ + position_; }
  int64_t left() const { return length_ - position_; }
  // The next `count` fields of `copy`'s record.
  const int64_t* take(size_t copy, int64_t count) {
    if (count < 0 || count > length_ - position_)
      refuse(copy, "the table ends inside this copy's record");
    const int64_t* fields = table_ + position_;
    position_ += count;
    return fields;
  }

 private:
  const int64_t* table_;
  int64_t length_;
  int64_t position_ = 0;
};

Dtype dtype_from_code(size_t copy, int64_t code) {
  if (code < 0 || code >= kDtypeCount) refuse(copy, "unknown dtype code " + std::to_string(code));
  return static_cast<Dtype>(code);
}

// ---------------------------------------------------------------------------------------
// Dequantizing copies: the scale fields of a record, checked as the numpy reference checks
// them (aoa/runtime/numpy_backend.py), in the same order.

struct ScaleFields {
  bool present = false;
  int64_t source = 0;
  Dtype dtype = Dtype::float32;
  int64_t offset = 0;
  const int64_t* blocks = nullptr;
  const int64_t* phases = nullptr;
  const int64_t* strides = nullptr;
};

bool is_dequantized_source(Dtype d) {
  return d == Dtype::float8_e4m3fn || d == Dtype::float8_e5m2 || d == Dtype::bfloat16 ||
         d == Dtype::float16 || d == Dtype::float32;
}

bool is_scale_dtype(Dtype d) {
  return d == Dtype::float32 || d == Dtype::bfloat16 || d == Dtype::float16;
}

ScaleFields read_scale(size_t index, TableReader& reader, int64_t ndim, size_t sources,
                       Dtype source_dtype) {
  ScaleFields scale;
  const int64_t has_scale = *reader.take(index, 1);
  if (has_scale == 0) return scale;
  if (has_scale != 1) refuse(index, "has_scale is " + std::to_string(has_scale) + ", not 0 or 1");
  const int64_t* head = reader.take(index, 3);
  scale.present = true;
  scale.source = head[0];
  scale.dtype = dtype_from_code(index, head[1]);
  scale.offset = head[2];
  scale.blocks = reader.take(index, ndim);
  scale.phases = reader.take(index, ndim);
  scale.strides = reader.take(index, ndim);
  if (scale.source < 0 || scale.source >= static_cast<int64_t>(sources))
    refuse(index, "scale source " + std::to_string(scale.source) + " does not exist (" +
                      std::to_string(sources) + " sources)");
  if (!is_dequantized_source(source_dtype))
    refuse(index, std::string("cannot dequantize ") + dtype_name(source_dtype) +
                      ": the source must be one of float8_e4m3fn, float8_e5m2, bfloat16, "
                      "float16, float32");
  if (!is_scale_dtype(scale.dtype))
    refuse(index, std::string("scales of ") + dtype_name(scale.dtype) +
                      ": they must be one of float32, bfloat16, float16");
  for (int64_t k = 0; k < ndim; ++k)
    if (scale.blocks[k] < 1 || scale.phases[k] < 0 || scale.phases[k] >= scale.blocks[k])
      refuse(index, "scale blocks " + tuple_text(scale.blocks, ndim) + " and phases " +
                        tuple_text(scale.phases, ndim) +
                        ": every block has an element, every phase lies within its block");
  return scale;
}

// The row that widens one element of `d` to float32.
RowFn widen_row(Dtype d) {
  return d == Dtype::float32 ? &copy_row<4> : cast_row_for(d, Dtype::float32);
}

// Every byte of an fp8 format as float32, made by the cast itself (so a lookup gives the
// same bits, NaN included): decoding an fp8 value bit by bit costs several times more.
template <Dtype S> const float* fp8_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> values{};
    for (int byte = 0; byte < 256; ++byte) {
      const uint8_t stored = static_cast<uint8_t>(byte);
      cast_one<S, Dtype::float32>(&stored, reinterpret_cast<uint8_t*>(&values[byte]));
    }
    return values;
  }();
  return table.data();
}

const float* widen_table(Dtype d) {
  if (d == Dtype::float8_e4m3fn) return fp8_table<Dtype::float8_e4m3fn>();
  if (d == Dtype::float8_e5m2) return fp8_table<Dtype::float8_e5m2>();
  return nullptr;
}

// Checks the scales' region and keeps the copy's axes as they are (without unit ones): a
// block's scale is found per axis, so axes are neither merged nor reordered.
void prepare_scales(size_t index, PreparedCopy& copy, const ScaleFields& scale,
                    const int64_t* shape, const int64_t* source_strides,
                    const int64_t* destination_strides, int64_t ndim, const SourceBuffer& from,
                    Dtype source_dtype) {
  std::vector<int64_t> extents(static_cast<size_t>(ndim));
  for (int64_t k = 0; k < ndim; ++k) {  // (phase + shape - 1) / block + 1, without overflow
    const uint64_t last = static_cast<uint64_t>(shape[k] - 1);
    const uint64_t block = static_cast<uint64_t>(scale.blocks[k]);
    const uint64_t carry = (static_cast<uint64_t>(scale.phases[k]) + last % block) / block;
    extents[static_cast<size_t>(k)] = static_cast<int64_t>(last / block + carry + 1);
  }
  const int64_t scale_itemsize = itemsize(scale.dtype);
  if (!region_fits(scale.offset, extents.data(), scale.strides, ndim, scale_itemsize, from.size))
    refuse(index, "scale region (offset " + std::to_string(scale.offset) + ", blocks " +
                      tuple_text(extents.data(), ndim) + ", strides " +
                      tuple_text(scale.strides, ndim) + ") does not fit in source " +
                      std::to_string(scale.source) + " of " + std::to_string(from.size) +
                      " bytes");
  copy.scales.data = from.data + scale.offset;
  copy.scales.widen = widen_row(source_dtype);
  copy.scales.table = widen_table(source_dtype);
  copy.scales.widen_scale = widen_row(scale.dtype);
  for (int64_t k = 0; k < ndim; ++k) {
    if (shape[k] == 1) continue;  // its one element is in the first element's block
    copy.axes.push_back({shape[k], source_strides[k], destination_strides[k]});
    copy.scales.axes.push_back({scale.blocks[k], scale.phases[k], scale.strides[k]});
  }
  copy.tiled = false;
}

// Reads and checks one record into `copy` (value-initialized, made in place: moving a
// prepared copy costs about as much as checking it); an empty region copies no bytes.
void read_copy(size_t index, TableReader& reader, const std::vector<SourceBuffer>& sources,
               const std::vector<DestinationBuffer>& destinations, PreparedCopy& copy) {
  const int64_t* head = reader.take(index, 7);
  const int64_t source = head[0], source_offset = head[1];
  const int64_t destination = head[2], destination_offset = head[3];
  if (source < 0 || source >= static_cast<int64_t>(sources.size()))
    refuse(index, "source " + std::to_string(source) + " does not exist (" +
                      std::to_string(sources.size()) + " sources)");
  if (destination < 0 || destination >= static_cast<int64_t>(destinations.size()))
    refuse(index, "destination " + std::to_string(destination) + " does not exist (" +
                      std::to_string(destinations.size()) + " destinations)");
  const Dtype first_dtype = dtype_from_code(index, head[4]);
  const Dtype destination_dtype = dtype_from_code(index, head[5]);
  const int64_t* via = reader.take(index, head[6]);
  DtypeChain chain;
  chain.reserve(static_cast<size_t>(head[6]) + 2);
  chain.push_back(first_dtype);
  for (int64_t k = 0; k < head[6]; ++k) chain.push_back(dtype_from_code(index, via[k]));
  chain.push_back(destination_dtype);

  const int64_t ndim = *reader.take(index, 1);
  if (ndim < 0) refuse(index, "negative number of axes " + std::to_string(ndim));
  const int64_t* shape = reader.take(index, ndim);
  const int64_t* source_strides = reader.take(index, ndim);
  const int64_t* destination_strides = reader.take(index, ndim);
  const ScaleFields scale = read_scale(index, reader, ndim, sources.size(), chain.front());

  const Dtype source_dtype = chain.front();
  copy.source_itemsize = itemsize(source_dtype);
  copy.destination_itemsize = itemsize(chain.back());
  if (scale.present) chain.front() = Dtype::float32;  // the steps start from the product
  copy.steps = cast_steps(index, chain);
  const bool moves_bytes = copy.steps.empty();
  if (moves_bytes)
    copy.steps.push_back({copy_row_for(itemsize(chain.front())), itemsize(chain.front())});
  for (int64_t k = 0; k < ndim; ++k)
    if (shape[k] < 0) refuse(index, "negative extent in shape " + tuple_text(shape, ndim));
  if (std::find(shape, shape + ndim, 0) != shape + ndim) return;  // copies nothing
  // Bytes read plus written must count in int64.
  int64_t bytes = copy.source_itemsize + copy.destination_itemsize;
  for (int64_t k = 0; k < ndim; ++k)
    if (__builtin_mul_overflow(bytes, shape[k], &bytes))
      refuse(index, "shape " + tuple_text(shape, ndim) + " has too many elements");

  const SourceBuffer& from = sources[static_cast<size_t>(source)];
  const DestinationBuffer& to = destinations[static_cast<size_t>(destination)];
  if (!region_fits(source_offset, shape, source_strides, ndim, copy.source_itemsize, from.size))
    refuse(index, "source region (offset " + std::to_string(source_offset) + ", shape " +
                      tuple_text(shape, ndim) + ", strides " + tuple_text(source_strides, ndim) +
                      ") does not fit in source " + std::to_string(source) + " of " +
                      std::to_string(from.size) + " bytes");
  if (!region_fits(destination_offset, shape, destination_strides, ndim,
                   copy.destination_itemsize, to.size))
    refuse(index, "destination region (offset " + std::to_string(destination_offset) +
                      ", shape " + tuple_text(shape, ndim) + ", strides " +
                      tuple_text(destination_strides, ndim) + ") does not fit in destination " +
                      std::to_string(destination) + " of " + std::to_string(to.size) + " bytes");

  copy.source = from.data + source_offset;
  copy.destination = to.data + destination_offset;
  copy.bytes = bytes;
  if (scale.present) {
    prepare_scales(index, copy, scale, shape, source_strides, destination_strides, ndim,
                   sources[static_cast<size_t>(scale.source)], source_dtype);
    return;
  }
  copy.axes.reserve(static_cast<size_t>(ndim));
  for (int64_t k = 0; k < ndim; ++k)
    copy.axes.push_back({shape[k], source_strides[k], destination_strides[k]});
  simplify(copy);
  if (copy.tiled) plan_tiles(copy, moves_bytes);
  if (moves_bytes && !copy.tiled && copy.axes.size() >= 2 &&
      copy.axes.back().source_stride == copy.source_itemsize &&
      copy.axes.back().destination_stride == copy.destination_itemsize)
    copy.row_bytes = copy.axes.back().extent * copy.source_itemsize;
}

// A record to run: its prepared form (`forms[form]`: axes, steps, tiles, shared by the
// records that repeat it) at its own buffers.
struct CopyAt {
  size_t form;
  const uint8_t* source;  // at the offset
  uint8_t* destination;
};

// Records that differ from one read before only in their buffers and offsets (the first
// four fields; the tensors of a large MoE: 188k copies of a few shapes, alternating) run
// in that one's checked and simplified form: each record's buffer numbers and both regions
// are still checked against its own buffers, as `read_copy` checks them.
class PreparedShapes {
 public:
  // Whether the record at the reader's position repeats a kept one: then it is added to
  // `copies` in that one's form (checked, in the order `read_copy` checks) and the reader
  // moves past it.
  bool read(TableReader& reader, const std::vector<SourceBuffer>& sources,
            const std::vector<DestinationBuffer>& destinations, std::vector<CopyAt>& copies) {
    const int64_t* fields = reader.rest();
    for (const Kept& kept : kept_) {
      if (kept.fields == nullptr || kept.length > reader.left() ||
          std::memcmp(fields + 4, kept.fields + 4,
                      static_cast<size_t>(kept.length - 4) * sizeof(int64_t)) != 0)
        continue;
      const int64_t source = fields[0], source_offset = fields[1];
      const int64_t destination = fields[2], destination_offset = fields[3];
      if (source < 0 || source >= static_cast<int64_t>(sources.size()) || destination < 0 ||
          destination >= static_cast<int64_t>(destinations.size()))
        return false;  // `read_copy` refuses it, with its message
      const SourceBuffer& from = sources[static_cast<size_t>(source)];
      const DestinationBuffer& to = destinations[static_cast<size_t>(destination)];
      if (!kept.source.fits(source_offset, from.size) ||
          !kept.destination.fits(destination_offset, to.size))
        return false;
      copies.push_back({kept.form, from.data + source_offset, to.data + destination_offset});
      reader.take(copies.size() - 1, kept.length);
      return true;
    }
    return false;
  }

  // Keeps the record `read_copy` just read into `forms[form]` (from `fields`, `length`
  // fields), where its form does not depend on its buffers: no scales, and no transpose
  // large enough to stream (whose tiles start where its destination is aligned).
  void keep(size_t form, const int64_t* fields, int64_t length,
            const std::vector<PreparedCopy>& forms) {
    const PreparedCopy& copy = forms[form];
    if (copy.bytes == 0 || copy.scales.data != nullptr || copy.bytes / 2 >= kStreamBytes) return;
    const int64_t via = fields[6], ndim = fields[7 + via];
    const int64_t* shape = fields + 8 + via;
    Kept kept{fields, length, form, {}, {}};
    if (!kept.source.measure(shape, shape + ndim, ndim, copy.source_itemsize) ||
        !kept.destination.measure(shape, shape + 2 * ndim, ndim, copy.destination_itemsize))
      return;
    kept_[next_] = kept;
    next_ = (next_ + 1) % kept_.size();
  }

 private:
  // Where a region of the kept shape reaches from its offset: its lowest and highest
  // element's first byte. A region at `offset` then fits in `size` bytes exactly where
  // `region_fits` says it does: offset + low >= 0 and offset + high <= size - itemsize,
  // neither sum overflowing (for a region that fits, no partial sum `region_fits` makes
  // overflows either: from the offset, low only falls and high only rises).
  struct Reach {
    int64_t low = 0;
    int64_t high = 0;
    int64_t itemsize = 0;
    bool measure(const int64_t* shape, const int64_t* strides, int64_t ndim, int64_t item) {
      itemsize = item;
      for (int64_t k = 0; k < ndim; ++k) {
        int64_t span;
        if (__builtin_mul_overflow(shape[k] - 1, strides[k], &span)) return false;
        if (__builtin_add_overflow(span < 0 ? low : high, span, span < 0 ? &low : &high))
          return false;
      }
      return true;
    }
    bool fits(int64_t offset, int64_t size) const {
      int64_t first, last;
      if (__builtin_add_overflow(offset, low, &first) ||
          __builtin_add_overflow(offset, high, &last))
        return false;
      return first >= 0 && last <= size - itemsize;
    }
  };
  struct Kept {
    const int64_t* fields = nullptr;  // the record, in the table
    int64_t length = 0;
    size_t form = 0;  // its prepared form
    Reach source;
    Reach destination;
  };
  std::array<Kept, 4> kept_{};
  size_t next_ = 0;
};

// ---------------------------------------------------------------------------------------
// Walking a copy.

void run_row(const PreparedCopy& copy, const uint8_t* source, int64_t source_stride,
             uint8_t* destination, int64_t destination_stride, int64_t count) {
  if (copy.steps.size() == 1) {
    copy.steps[0].row(source, source_stride, destination, destination_stride, count);
    return;
  }
  alignas(8) uint8_t scratch[2][kChainBlock * 8];
  for (int64_t start = 0; start < count; start += kChainBlock) {
    const int64_t block = std::min(kChainBlock, count - start);
    const uint8_t* in = source + start * source_stride;
    int64_t in_stride = source_stride;
    for (size_t k = 0; k < copy.steps.size(); ++k) {
      const bool last = k + 1 == copy.steps.size();
      uint8_t* out = last ? destination + start * destination_stride : scratch[k % 2];
      const int64_t out_stride = last ? destination_stride : copy.steps[k].output_itemsize;
      copy.steps[k].row(in, in_stride, out, out_stride, block);
      in = out;
      in_stride = out_stride;
    }
  }
}

// A TileFn through rows, for any copy.
void run_tile(const PreparedCopy& copy, const uint8_t* source, uint8_t* destination,
              int64_t row0, int64_t row_end, int64_t column0, int64_t width) {
  const Axis& rows = copy.axes[copy.axes.size() - 2];
  const Axis& columns = copy.axes.back();
  for (int64_t row = row0; row < row_end; ++row)
    run_row(copy, source + row * rows.source_stride + column0 * columns.source_stride,
            columns.source_stride,
            destination + row * rows.destination_stride + column0 * columns.destination_stride,
            columns.destination_stride, width);
}

// A TileFn for an exact transpose: whole blocks of Rows x Columns (inlined), then the
// edges through `Edge` (rows, or smaller blocks).
template <BlockFn Block, int64_t Rows, int64_t Columns, TileFn Edge = &run_tile>
[[gnu::always_inline]] inline void transposed_tile(const PreparedCopy& copy, const uint8_t* source,
                                                   uint8_t* destination, int64_t row0,
                                                   int64_t row_end, int64_t column0,
                                                   int64_t width) {
  const Axis& rows = copy.axes[copy.axes.size() - 2];
  const Axis& columns = copy.axes.back();
  const int64_t block_rows_end = row0 + (row_end - row0) / Rows * Rows;
  const int64_t block_width = width / Columns * Columns;
  for (int64_t row = row0; row < block_rows_end; row += Rows)
    for (int64_t column = column0; column < column0 + block_width; column += Columns)
      Block(source + row * rows.source_stride + column * columns.source_stride,
            columns.source_stride,
            destination + row * rows.destination_stride + column * columns.destination_stride,
            rows.destination_stride);
  if (block_width < width)
    Edge(copy, source, destination, row0, block_rows_end, column0 + block_width,
         width - block_width);
  Edge(copy, source, destination, block_rows_end, row_end, column0, width);
}

template <BlockFn Block, int64_t Side>
void run_transposed_tile(const PreparedCopy& copy, const uint8_t* source, uint8_t* destination,
                         int64_t row0, int64_t row_end, int64_t column0, int64_t width) {
  transposed_tile<Block, Side, Side>(copy, source, destination, row0, row_end, column0, width);
}

#if defined(__x86_64__)
// What an AVX2 block leaves (a tile narrower or shorter than a block: the 32 x 16 experts
// of a large MoE fit no 16 x 32 block of 2-byte items) goes through SSE2 blocks.
template <int64_t Size> constexpr TileFn sse2_tile() {
  if constexpr (Size == 8) return &run_transposed_tile<&transpose_block_8, 2>;
  if constexpr (Size == 4) return &run_transposed_tile<&transpose_block_4, 4>;
  return &run_transposed_tile<&transpose_block_2, 8>;
}

// The walk over AVX2 blocks, compiled for AVX2 and flattened so that they inline.
template <int64_t Size, bool Stream>
AOA_AVX2 [[gnu::flatten]] void run_transposed_tile_avx2(const PreparedCopy& copy,
                                                        const uint8_t* source,
                                                        uint8_t* destination, int64_t row0,
                                                        int64_t row_end, int64_t column0,
                                                        int64_t width) {
  transposed_tile<&transpose_block_avx2<Size, Stream>, 32 / Size, 64 / Size, sse2_tile<Size>()>(
      copy, source, destination, row0, row_end, column0, width);
  if (Stream) _mm_sfence();  // streamed stores are ordered before whatever comes next
}

template <int64_t Size> TileFn transposed_tile_avx2(bool stream) {
  return stream ? &run_transposed_tile_avx2<Size, true> : &run_transposed_tile_avx2<Size, false>;
}

// The first column from which the destination rows of a copy start on 64-byte lines (so
// that its blocks write whole lines), or -1 where not every row does.
int64_t first_aligned_column(const PreparedCopy& copy) {
  const int64_t item = copy.destination_itemsize;
  const int64_t misalignment = static_cast<int64_t>(reinterpret_cast<uintptr_t>(copy.destination) % 64);
  const bool rows_aligned = std::all_of(copy.axes.begin(), copy.axes.end() - 1,
                                        [](const Axis& a) { return a.destination_stride % 64 == 0; });
  if (!rows_aligned || misalignment % item != 0) return -1;
  return (64 - misalignment) % 64 / item;
}
#endif

// Exact byte transposes (the source contiguous down the rows, the destination along the
// columns) go in blocks, AVX2 ones where the CPU has it; anything else through rows.
void plan_tiles(PreparedCopy& copy, bool moves_bytes) {
  const int64_t item = copy.source_itemsize;
  copy.tile_rows = copy.tile_columns = kTile;
  copy.first_column = 0;
  copy.tile = &run_tile;
  if (!moves_bytes || copy.axes[copy.axes.size() - 2].source_stride != item ||
      copy.axes.back().destination_stride != item)
    return;
#if defined(__x86_64__)
  static const bool avx2 = __builtin_cpu_supports("avx2");
  if (avx2 && item >= 2) {
    const int64_t first_column = first_aligned_column(copy);
    const bool stream = copy.bytes / 2 >= kStreamBytes && first_column >= 0;
    if (stream) {
      copy.tile_rows = kStreamTileRows;
      copy.tile_columns = kStreamTileBytes / item;
      copy.first_column = first_column;  // the columns before it go through rows
    }
    copy.tile = item == 8   ? transposed_tile_avx2<8>(stream)
                : item == 4 ? transposed_tile_avx2<4>(stream)
                            : transposed_tile_avx2<2>(stream);
    return;
  }
#endif
  switch (item) {
#if defined(__SSE2__)
    case 8: copy.tile = &run_transposed_tile<&transpose_block_8, 2>; break;
    case 4: copy.tile = &run_transposed_tile<&transpose_block_4, 4>; break;
    case 2: copy.tile = &run_transposed_tile<&transpose_block_2, 8>; break;
#else
    case 8: copy.tile = &run_transposed_tile<&transpose_block_plain<8, 4>, 4>; break;
    case 4: copy.tile = &run_transposed_tile<&transpose_block_plain<4, 8>, 8>; break;
    case 2: copy.tile = &run_transposed_tile<&transpose_block_plain<2, 8>, 8>; break;
#endif
    default: copy.tile = &run_transposed_tile<&transpose_block_plain<1, 16>, 16>; break;
  }
}

// The last two axes in tiles, rows of the second-to-last in [begin, end): each tile reads
// the source lines it touches while they are still in cache.
void run_tiles(const PreparedCopy& copy, const uint8_t* source, uint8_t* destination,
               int64_t begin, int64_t end) {
  const int64_t columns = copy.axes.back().extent;
  for (int64_t row0 = begin; row0 < end; row0 += copy.tile_rows) {
    const int64_t row_end = std::min(row0 + copy.tile_rows, end);
    for (int64_t column0 = 0, width; column0 < columns; column0 += width) {
      width = std::min(column0 < copy.first_column ? copy.first_column : copy.tile_columns,
                       columns - column0);
      copy.tile(copy, source, destination, row0, row_end, column0, width);
    }
  }
}

// Axis `axis` of the copy, indices [begin, end) along it, everything inside it in full.
void walk(const PreparedCopy& copy, size_t axis, const uint8_t* source, uint8_t* destination,
          int64_t begin, int64_t end) {
  const size_t loop_axes = copy.axes.size() - (copy.tiled ? 2 : 1);
  const Axis& a = copy.axes[axis];
  if (copy.row_bytes > 0 && axis + 1 == loop_axes) {  // rows [begin, end) of plain bytes
    copy_rows(copy.row_bytes, source + begin * a.source_stride, a.source_stride,
              destination + begin * a.destination_stride, a.destination_stride, end - begin);
    return;
  }
  if (axis == loop_axes) {
    if (copy.tiled) {
      run_tiles(copy, source, destination, begin, end);
    } else {
      run_row(copy, source + begin * a.source_stride, a.source_stride,
              destination + begin * a.destination_stride, a.destination_stride, end - begin);
    }
    return;
  }
  for (int64_t i = begin; i < end; ++i)
    walk(copy, axis + 1, source + i * a.source_stride, destination + i * a.destination_stride, 0,
         copy.axes[axis + 1].extent);
}

// ---------------------------------------------------------------------------------------
// Walking a dequantizing copy: its last two axes in tiles within one block on both (one
// scale per tile, at most kTile x kTile, so a transposed read stays in cache; where the
// source's rows run along the destination's, a tile is one row of a block, read straight
// through), the axes outside them one index at a time.

// `count` elements along one row, all of one block: widened, times `scale`, then the steps.
void run_scaled_row(const PreparedCopy& copy, const uint8_t* source, int64_t source_stride,
                    uint8_t* destination, int64_t destination_stride, int64_t count,
                    float scale) {
  float values[kChainBlock];
  for (int64_t start = 0; start < count; start += kChainBlock) {
    const int64_t block = std::min(kChainBlock, count - start);
    const uint8_t* from = source + start * source_stride;
    if (copy.scales.table != nullptr) {
      const float* table = copy.scales.table;
      for (int64_t i = 0; i < block; ++i) values[i] = table[from[i * source_stride]] * scale;
    } else {
      copy.scales.widen(from, source_stride, reinterpret_cast<uint8_t*>(values), 4, block);
      for (int64_t i = 0; i < block; ++i) values[i] *= scale;
    }
    run_row(copy, reinterpret_cast<const uint8_t*>(values), 4,
            destination + start * destination_stride, destination_stride, block);
  }
}

float scale_at(const PreparedCopy& copy, const uint8_t* scale) {
  float value;
  copy.scales.widen_scale(scale, 0, reinterpret_cast<uint8_t*>(&value), 4, 1);
  return value;
}

// Indices [begin, end) along `axis` of a copy: where the next block starts, and the scale
// of the block of `index`, from `scale` (the scale of index 0's block).
int64_t block_end(const ScaleAxis& a, int64_t index, int64_t end) {
  return std::min(end, ((a.phase + index) / a.block + 1) * a.block - a.phase);
}
const uint8_t* scale_of(const ScaleAxis& a, const uint8_t* scale, int64_t index) {
  return scale + (a.phase + index) / a.block * a.stride;
}

void walk_scaled(const PreparedCopy& copy, size_t axis, const uint8_t* source,
                 uint8_t* destination, const uint8_t* scale, int64_t begin, int64_t end) {
  const SmallVector<Axis, kInlineAxes>& axes = copy.axes;
  const std::vector<ScaleAxis>& scales = copy.scales.axes;
  const Axis& a = axes[axis];
  if (axis + 1 == axes.size()) {  // a single axis: runs of one block
    for (int64_t i = begin, stop; i < end; i = stop) {
      stop = std::min(block_end(scales[axis], i, end), i + kTile * kTile);
      run_scaled_row(copy, source + i * a.source_stride, a.source_stride,
                     destination + i * a.destination_stride, a.destination_stride, stop - i,
                     scale_at(copy, scale_of(scales[axis], scale, i)));
    }
    return;
  }
  if (axis + 2 == axes.size()) {  // rows and columns, in tiles
    const Axis& c = axes[axis + 1];
    const bool along_rows = std::abs(c.source_stride) <= std::abs(a.source_stride);
    const int64_t tile_rows = along_rows ? 1 : kTile;
    const int64_t tile_columns = along_rows ? c.extent : kTile;
    for (int64_t row0 = begin, row_end; row0 < end; row0 = row_end) {
      row_end = std::min(block_end(scales[axis], row0, end), row0 + tile_rows);
      const uint8_t* scale_row = scale_of(scales[axis], scale, row0);
      for (int64_t column0 = 0, column_end; column0 < c.extent; column0 = column_end) {
        column_end =
            std::min(block_end(scales[axis + 1], column0, c.extent), column0 + tile_columns);
        const float value = scale_at(copy, scale_of(scales[axis + 1], scale_row, column0));
        for (int64_t row = row0; row < row_end; ++row)
          run_scaled_row(copy, source + row * a.source_stride + column0 * c.source_stride,
                         c.source_stride,
                         destination + row * a.destination_stride +
                             column0 * c.destination_stride,
                         c.destination_stride, column_end - column0, value);
      }
    }
    return;
  }
  for (int64_t i = begin; i < end; ++i)
    walk_scaled(copy, axis + 1, source + i * a.source_stride,
                destination + i * a.destination_stride, scale_of(scales[axis], scale, i), 0,
                axes[axis + 1].extent);
}

// ---------------------------------------------------------------------------------------
// Splitting work over threads.

// A copy, or the slice [begin, end) of its outermost axis: its form at its buffers.
struct Piece {
  const PreparedCopy* copy;
  const uint8_t* source;
  uint8_t* destination;
  int64_t begin;
  int64_t end;
};

void run_piece(const Piece& piece) {
  const PreparedCopy& copy = *piece.copy;
  if (copy.scales.data != nullptr) {
    if (copy.axes.empty()) {
      run_scaled_row(copy, piece.source, copy.source_itemsize, piece.destination,
                     copy.destination_itemsize, 1, scale_at(copy, copy.scales.data));
    } else {
      walk_scaled(copy, 0, piece.source, piece.destination, copy.scales.data, piece.begin,
                  piece.end);
    }
  } else if (copy.axes.empty()) {
    run_row(copy, piece.source, copy.source_itemsize, piece.destination,
            copy.destination_itemsize, 1);
  } else {
    walk(copy, 0, piece.source, piece.destination, piece.begin, piece.end);
  }
}

// Work items of about `target` bytes each: a huge copy is cut along its outermost axis,
// small consecutive copies are batched. Item k is pieces[starts[k], starts[k + 1]).
struct WorkItems {
  std::vector<Piece> pieces;
  std::vector<size_t> starts;
};

WorkItems split_work(const std::vector<PreparedCopy>& forms, const std::vector<CopyAt>& copies,
                     int64_t target) {
  WorkItems work;
  int64_t batch_bytes = 0;
  auto close_batch = [&] {
    if (batch_bytes > 0) work.starts.push_back(work.pieces.size());
    batch_bytes = 0;
  };
  work.starts.push_back(0);
  for (const CopyAt& at : copies) {
    const PreparedCopy& copy = forms[at.form];
    if (copy.bytes == 0) continue;
    const int64_t extent = copy.axes.empty() ? 1 : copy.axes[0].extent;
    if (copy.bytes <= target || extent == 1) {
      work.pieces.push_back({&copy, at.source, at.destination, 0, extent});
      batch_bytes += copy.bytes;
      if (batch_bytes >= target) close_batch();
      continue;
    }
    close_batch();
    const int64_t chunks = std::min(extent, (copy.bytes + target - 1) / target);
    int64_t step = (extent + chunks - 1) / chunks;
    if (copy.tiled && copy.axes.size() == 2) step = (step + kTile - 1) / kTile * kTile;
    for (int64_t begin = 0; begin < extent; begin += step) {
      work.pieces.push_back({&copy, at.source, at.destination, begin,
                             std::min(begin + step, extent)});
      work.starts.push_back(work.pieces.size());
    }
  }
  close_batch();
  return work;
}

// Below this many bytes a call runs on the calling thread alone.
constexpr int64_t kMinBytesPerThread = int64_t{1} << 18;

void run_all(const std::vector<PreparedCopy>& forms, const std::vector<CopyAt>& copies,
             int64_t threads) {
  int64_t total = 0;
  for (const CopyAt& at : copies)
    if (__builtin_add_overflow(total, forms[at.form].bytes, &total)) total = INT64_MAX;
  threads = std::max<int64_t>(1, std::min(threads, total / kMinBytesPerThread));
  // Several items per thread, so that uneven items still balance.
  const WorkItems work =
      split_work(forms, copies, std::max(kMinBytesPerThread, total / (threads * 8)));
  bus::install();
  std::atomic<bool> faulted{false};
  std::atomic<void*> fault_address{nullptr};
  run_in_parallel(work.starts.size() - 1, threads, [&](size_t item) {
    if (faulted.load(std::memory_order_relaxed)) return;  // memory vanished: stop
    void* address = nullptr;
    const bool done = run_guarded(
        [&] {
          for (size_t p = work.starts[item]; p < work.starts[item + 1]; ++p)
            run_piece(work.pieces[p]);
        },
        &address);
    if (!done && !faulted.exchange(true)) fault_address.store(address);
  });
  if (faulted.load()) throw BusError(fault_address.load());
}

// How many records the table holds, by their lengths alone, so the prepared copies are
// allocated once (growing by doubling faulted in twice the fresh pages, ~15% of a table
// of small copies); where a length is not sensible it stops: `read_copy` refuses there.
size_t count_records(const int64_t* table, int64_t length) {
  size_t count = 0;
  for (int64_t at = 0; at < length; ++count) {
    if (length - at < 9) return count + 1;
    const int64_t via = table[at + 6];
    if (via < 0 || via > length - at - 9) return count + 1;
    const int64_t ndim = table[at + 7 + via];
    if (ndim < 0 || ndim > (length - at - 9 - via) / 3) return count + 1;
    at += 9 + via + 3 * ndim;
    if (table[at - 1] == 1) at += 3 + 3 * ndim;  // has_scale: the scale's fields
  }
  return count;
}

}  // namespace

void execute_copies(const int64_t* table, int64_t table_length,
                    const std::vector<SourceBuffer>& sources,
                    const std::vector<DestinationBuffer>& destinations, int64_t threads) {
  if (threads < 1) throw CopyError("threads must be at least 1, not " + std::to_string(threads));
  const size_t records = count_records(table, table_length);
  std::vector<PreparedCopy> forms;  // (pages of the part never used are never touched)
  forms.reserve(records);
  std::vector<CopyAt> copies;
  copies.reserve(records);
  TableReader reader(table, table_length);
  PreparedShapes shapes;
  while (!reader.done()) {
    if (shapes.read(reader, sources, destinations, copies)) continue;
    const int64_t* fields = reader.rest();
    const int64_t before = reader.left();
    PreparedCopy& form = forms.emplace_back();
    read_copy(copies.size(), reader, sources, destinations, form);
    copies.push_back({forms.size() - 1, form.source, form.destination});
    shapes.keep(forms.size() - 1, fields, before - reader.left(), forms);
  }
  run_all(forms, copies, threads);
}

}  // namespace aoa
