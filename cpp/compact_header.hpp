// A safetensors header's entries and DCP's sharding info read in their compact form
// (compact_header.cpp).
#pragma once

#include <pybind11/pybind11.h>

namespace aoa {

// Adds compact_entries and saved_offsets_of to the module.
void register_compact_header(pybind11::module_& m);

}  // namespace aoa
