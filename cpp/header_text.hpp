// A safetensors header's entries and DCP's sharding info as text, in one pass (header_text.cpp).
#pragma once

#include <pybind11/pybind11.h>

namespace aoa {

// Adds header_texts to the module.
void register_header_text(pybind11::module_& m);

}  // namespace aoa
