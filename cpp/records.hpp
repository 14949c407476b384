// Objects of a slotted Python class made in bulk (records.cpp).
#pragma once

#include <pybind11/pybind11.h>

namespace aoa {

// Adds new_records and new_record_groups to the module.
void register_records(pybind11::module_& m);

}  // namespace aoa
