// Element casts, bit-identical to numpy / ml_dtypes `astype` for every supported pair.
//
// Values are exact: every finite value of a format converts to the nearest value of the
// target, ties to even (float64 -> bfloat16 and float64 -> fp8 round once, from the double,
// as ml_dtypes does). Overflow gives infinity, or NaN for float8_e4m3fn, which has no
// infinity. What differs between pairs is only what happens to a NaN's sign and payload,
// and that follows whichever library implements the pair in numpy:
//   numpy's own half conversions (float16 <-> float32/float64) shift the payload and keep a
//   signalling NaN signalling; float32 <-> float64 is the C cast (the hardware quiets);
//   bfloat16 -> float32 is a 16-bit shift; every other pair (ml_dtypes) gives the target's
//   canonical quiet NaN with the sign kept.
// Integers convert as numpy does: to float64 and float32 by the C cast, to the narrower
// formats correctly rounded from the exact integer. A bool is 0 or 1 (any nonzero byte is 1).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace aoa {

// Codes of the kernel table; exported by name as aoa._core.DTYPE_CODES, which Python reads.
enum class Dtype : int64_t {
  float64 = 0,
  float32 = 1,
  float16 = 2,
  bfloat16 = 3,
  float8_e4m3fn = 4,
  float8_e5m2 = 5,
  int64 = 6,
  int32 = 7,
  int16 = 8,
  int8 = 9,
  uint64 = 10,
  uint32 = 11,
  uint16 = 12,
  uint8 = 13,
  bool_ = 14,
};
constexpr int64_t kDtypeCount = 15;

// The Paddle name, as in python/aoa/dtypes.py.
constexpr const char* dtype_name(Dtype d) {
  constexpr const char* kNames[kDtypeCount] = {
      "float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "int64",
      "int32", "int16", "int8", "uint64", "uint32", "uint16", "uint8", "bool"};
  return kNames[static_cast<int64_t>(d)];
}

// The C type that holds one element: the value for integers, the bits for floats.
template <Dtype D> struct Storage;
template <> struct Storage<Dtype::float64> { using type = uint64_t; };
template <> struct Storage<Dtype::float32> { using type = uint32_t; };
template <> struct Storage<Dtype::float16> { using type = uint16_t; };
template <> struct Storage<Dtype::bfloat16> { using type = uint16_t; };
template <> struct Storage<Dtype::float8_e4m3fn> { using type = uint8_t; };
template <> struct Storage<Dtype::float8_e5m2> { using type = uint8_t; };
template <> struct Storage<Dtype::int64> { using type = int64_t; };
template <> struct Storage<Dtype::int32> { using type = int32_t; };
template <> struct Storage<Dtype::int16> { using type = int16_t; };
template <> struct Storage<Dtype::int8> { using type = int8_t; };
template <> struct Storage<Dtype::uint64> { using type = uint64_t; };
template <> struct Storage<Dtype::uint32> { using type = uint32_t; };
template <> struct Storage<Dtype::uint16> { using type = uint16_t; };
template <> struct Storage<Dtype::uint8> { using type = uint8_t; };
template <> struct Storage<Dtype::bool_> { using type = uint8_t; };
template <Dtype D> using StorageT = typename Storage<D>::type;

constexpr bool is_float(Dtype d) { return d <= Dtype::float8_e5m2; }
constexpr bool is_integer(Dtype d) { return d >= Dtype::int64 && d <= Dtype::uint8; }

// Bit layout of a floating format. `finite_only` is float8_e4m3fn: no infinity, and only
// the all-ones pattern of the top exponent is NaN.
template <Dtype D> struct Format;
template <int M, int E, bool FiniteOnly = false> struct FormatBits {
  static constexpr int mantissa = M;
  static constexpr int exponent = E;
  static constexpr int bias = (1 << (E - 1)) - 1;
  static constexpr int width = 1 + E + M;
  static constexpr bool finite_only = FiniteOnly;
  static constexpr uint64_t mantissa_mask = (uint64_t{1} << M) - 1;
  static constexpr uint64_t magnitude_mask = (uint64_t{1} << (width - 1)) - 1;
  static constexpr uint64_t infinity = ((uint64_t{1} << E) - 1) << M;
  static constexpr uint64_t canonical_nan =
      FiniteOnly ? magnitude_mask : infinity | (uint64_t{1} << (M - 1));
  // The largest finite magnitude, as bits.
  static constexpr uint64_t max_finite = FiniteOnly ? magnitude_mask - 1 : infinity - 1;
};
template <> struct Format<Dtype::float64> : FormatBits<52, 11> {};
template <> struct Format<Dtype::float32> : FormatBits<23, 8> {};
template <> struct Format<Dtype::float16> : FormatBits<10, 5> {};
template <> struct Format<Dtype::bfloat16> : FormatBits<7, 8> {};
template <> struct Format<Dtype::float8_e4m3fn> : FormatBits<3, 4, true> {};
template <> struct Format<Dtype::float8_e5m2> : FormatBits<2, 5> {};

template <class To, class From> inline To bit_cast(From from) {
  static_assert(sizeof(To) == sizeof(From));
  To to;
  std::memcpy(&to, &from, sizeof(To));
  return to;
}

template <Dtype D> constexpr uint64_t sign_bit() { return uint64_t{1} << (Format<D>::width - 1); }

template <Dtype D> inline bool is_nan(uint64_t bits) {
  using F = Format<D>;
  const uint64_t magnitude = bits & F::magnitude_mask;
  return F::finite_only ? magnitude == F::magnitude_mask : magnitude > F::infinity;
}

// A value of a format narrower than float32 (float16, fp8), as a float; not for NaN.
template <Dtype D> inline float narrow_to_float(uint64_t bits) {
  using F = Format<D>;
  static_assert(F::bias < Format<Dtype::float32>::bias, "the value must be a normal float");
  const uint32_t sign = static_cast<uint32_t>((bits & sign_bit<D>()) ? 1u << 31 : 0u);
  int exponent = static_cast<int>((bits >> F::mantissa) & ((1u << F::exponent) - 1));
  uint64_t mantissa = bits & F::mantissa_mask;
  if (exponent == 0 && mantissa == 0) return bit_cast<float>(sign);
  if (!F::finite_only && (bits & F::magnitude_mask) == F::infinity)
    return bit_cast<float>(sign | 0x7f800000u);
  if (exponent == 0) {  // subnormal: normalize, it is a normal float
    exponent = 1;
    while (!(mantissa & (uint64_t{1} << F::mantissa))) {
      mantissa <<= 1;
      --exponent;
    }
    mantissa &= F::mantissa_mask;
  }
  const uint32_t float_exponent = static_cast<uint32_t>(exponent - F::bias + 127);
  return bit_cast<float>(sign | float_exponent << 23 |
                         static_cast<uint32_t>(mantissa) << (23 - F::mantissa));
}

// Round a float or double (not NaN) to the nearest value of D, ties to even.
template <Dtype D, class Hub> inline uint64_t round_to(Hub value) {
  using F = Format<D>;
  using H = std::conditional_t<std::is_same_v<Hub, double>, Format<Dtype::float64>,
                               Format<Dtype::float32>>;
  using HubBits = std::conditional_t<std::is_same_v<Hub, double>, uint64_t, uint32_t>;
  static_assert(H::mantissa > F::mantissa);
  const HubBits bits = bit_cast<HubBits>(value);
  const uint64_t sign = (bits >> (H::width - 1)) ? sign_bit<D>() : 0;
  const uint64_t magnitude = bits & H::magnitude_mask;
  if (magnitude == H::infinity) return sign | (F::finite_only ? F::canonical_nan : F::infinity);

  const int hub_exponent = static_cast<int>(magnitude >> H::mantissa);
  uint64_t significand = magnitude & H::mantissa_mask;
  if (hub_exponent != 0) significand |= uint64_t{1} << H::mantissa;
  // Biased exponent in D; below 1 the result is subnormal and loses more bits.
  const int exponent = (hub_exponent ? hub_exponent : 1) - H::bias + F::bias;
  int shift = H::mantissa - F::mantissa + (exponent < 1 ? 1 - exponent : 0);
  if (shift > H::mantissa + 2) shift = H::mantissa + 2;  // below half the smallest subnormal
  uint64_t rounded = significand >> shift;
  const uint64_t remainder = significand & ((uint64_t{1} << shift) - 1);
  const uint64_t half = uint64_t{1} << (shift - 1);
  if (remainder > half || (remainder == half && (rounded & 1))) ++rounded;
  // The implicit bit of `rounded` carries into the exponent field; a carry out of the
  // mantissa moves to the next binade, up to infinity.
  const uint64_t result =
      (static_cast<uint64_t>(exponent < 1 ? 0 : exponent - 1) << F::mantissa) + rounded;
  if (result > F::max_finite) return sign | (F::finite_only ? F::canonical_nan : F::infinity);
  return sign | result;
}

// A float (not NaN) as D.
template <Dtype D> inline uint64_t from_float(float value) {
  if constexpr (D == Dtype::float64) {
    return bit_cast<uint64_t>(static_cast<double>(value));
  } else if constexpr (D == Dtype::float32) {
    return bit_cast<uint32_t>(value);
  } else if constexpr (D == Dtype::bfloat16) {
    const uint32_t bits = bit_cast<uint32_t>(value);  // same exponent range: round the bits
    return (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  } else {
    return round_to<D>(value);
  }
}

// A double (not NaN) as D.
template <Dtype D> inline uint64_t from_double(double value) {
  if constexpr (D == Dtype::float64) {
    return bit_cast<uint64_t>(value);
  } else if constexpr (D == Dtype::float32) {
    return bit_cast<uint32_t>(static_cast<float>(value));
  } else {
    return round_to<D>(value);
  }
}

constexpr bool is_numpy_float(Dtype d) {
  return d == Dtype::float64 || d == Dtype::float32 || d == Dtype::float16;
}

// What a NaN of S becomes in D (see the header comment).
template <Dtype S, Dtype D> inline uint64_t nan_as(uint64_t bits) {
  using FS = Format<S>;
  using FD = Format<D>;
  const uint64_t sign = (bits & sign_bit<S>()) ? sign_bit<D>() : 0;
  if constexpr (S == Dtype::float32 && D == Dtype::float64) {
    return bit_cast<uint64_t>(static_cast<double>(bit_cast<float>(static_cast<uint32_t>(bits))));
  } else if constexpr (S == Dtype::float64 && D == Dtype::float32) {
    return bit_cast<uint32_t>(static_cast<float>(bit_cast<double>(bits)));
  } else if constexpr (S == Dtype::bfloat16 && D == Dtype::float32) {
    return bits << 16;
  } else if constexpr (S == Dtype::bfloat16 && D == Dtype::float64) {
    return nan_as<Dtype::float32, Dtype::float64>(bits << 16);
  } else if constexpr (is_numpy_float(S) && is_numpy_float(D)) {
    // numpy's half conversions: move the payload, never quiet; keep a narrowed NaN a NaN.
    const uint64_t payload = bits & FS::mantissa_mask;
    uint64_t moved = FS::mantissa > FD::mantissa ? payload >> (FS::mantissa - FD::mantissa)
                                                 : payload << (FD::mantissa - FS::mantissa);
    if (moved == 0) moved = 1;
    return sign | FD::infinity | moved;
  } else {
    return sign | FD::canonical_nan;
  }
}

// Round a 64-bit magnitude to 53 bits, rounding to odd: a later round to nearest-even at
// 24 bits or fewer then gives the correctly rounded result of the exact integer.
inline double round_to_odd_double(uint64_t magnitude) {
  if (magnitude < (uint64_t{1} << 53)) return static_cast<double>(magnitude);
  const int shift = 64 - __builtin_clzll(magnitude) - 53;
  uint64_t kept = magnitude >> shift;
  if (magnitude & ((uint64_t{1} << shift) - 1)) kept |= 1;
  return static_cast<double>(kept) * bit_cast<double>(static_cast<uint64_t>(1023 + shift) << 52);
}

template <Dtype S, Dtype D> inline uint64_t integer_as_float(StorageT<S> value) {
  if constexpr (S == Dtype::bool_) {
    return from_float<D>(value ? 1.0f : 0.0f);
  } else if constexpr (D == Dtype::float64) {
    return bit_cast<uint64_t>(static_cast<double>(value));
  } else if constexpr (D == Dtype::float32) {
    return bit_cast<uint32_t>(static_cast<float>(value));
  } else if constexpr (sizeof(value) <= 4) {
    return from_double<D>(static_cast<double>(value));  // exact
  } else {
    const bool negative = value < 0;
    const uint64_t magnitude =
        negative ? uint64_t{0} - static_cast<uint64_t>(value) : static_cast<uint64_t>(value);
    const double rounded = round_to_odd_double(magnitude);
    return from_double<D>(negative ? -rounded : rounded);
  }
}

constexpr int64_t itemsize(Dtype d) {
  switch (d) {
    case Dtype::float64: case Dtype::int64: case Dtype::uint64: return 8;
    case Dtype::float32: case Dtype::int32: case Dtype::uint32: return 4;
    case Dtype::float16: case Dtype::bfloat16: case Dtype::int16: case Dtype::uint16: return 2;
    default: return 1;
  }
}

// Whether `astype` from S to D is supported, and if it only moves bytes (same dtype, or
// integers of one size: numpy wraps them around, which keeps the bytes).
constexpr bool is_bytes_cast(Dtype s, Dtype d) {
  return s == d || (is_integer(s) && is_integer(d) && itemsize(s) == itemsize(d));
}
constexpr bool is_value_cast(Dtype s, Dtype d) {
  return !is_bytes_cast(s, d) && is_float(d) && (is_float(s) || is_integer(s) || s == Dtype::bool_);
}

// One element of S as D (a supported value cast).
template <Dtype S, Dtype D> inline StorageT<D> cast_element(StorageT<S> value) {
  static_assert(is_value_cast(S, D));
  if constexpr (!is_float(S)) {
    return static_cast<StorageT<D>>(integer_as_float<S, D>(value));
  } else {
    const uint64_t bits = value;
    if (is_nan<S>(bits)) return static_cast<StorageT<D>>(nan_as<S, D>(bits));
    if constexpr (S == Dtype::float64) {
      return static_cast<StorageT<D>>(from_double<D>(bit_cast<double>(bits)));
    } else if constexpr (S == Dtype::float32) {
      return static_cast<StorageT<D>>(from_float<D>(bit_cast<float>(value)));
    } else if constexpr (S == Dtype::bfloat16) {
      return static_cast<StorageT<D>>(from_float<D>(bit_cast<float>(uint32_t{value} << 16)));
    } else {
      return static_cast<StorageT<D>>(from_float<D>(narrow_to_float<S>(bits)));
    }
  }
}

}  // namespace aoa
