// aoa._core.new_records / new_record_groups: objects of a slotted class made in bulk, their
// fields set through their slots' descriptors, the class's constructor not called. A reader
// checks a checkpoint's shard descriptions in bulk, then makes them by the hundred thousand:
// in Python each costs an object, five stores and a class swap (0.3-0.7 us); here 0.15-0.2 us.
#include "records.hpp"

#include <string>
#include <vector>

namespace py = pybind11;

namespace {

// The slots of `cls` named by `fields`, each checked to be a slot (a member descriptor).
class Slots {
 public:
  Slots(const py::type& cls, const py::tuple& fields)
      : type_(reinterpret_cast<PyTypeObject*>(cls.ptr())) {
    for (const py::handle field : fields) {
      py::object descriptor = cls.attr(field);
      if (!Py_IS_TYPE(descriptor.ptr(), &PyMemberDescr_Type))
        throw py::type_error(std::string(py::str(field)) + " is not a slot of " +
                             std::string(py::str(cls.attr("__name__"))));
      descriptors_.push_back(std::move(descriptor));
    }
  }
  size_t size() const { return descriptors_.size(); }

  // A new object of the class with no field set yet (object.__new__ of it).
  py::object allocate() const {
    PyObject* object = type_->tp_alloc(type_, 0);
    if (object == nullptr) throw py::error_already_set();
    return py::reinterpret_steal<py::object>(object);
  }

  void set(const py::object& object, size_t field, PyObject* value) const {
    PyObject* descriptor = descriptors_[field].ptr();
    if (Py_TYPE(descriptor)->tp_descr_set(descriptor, object.ptr(), value) != 0)
      throw py::error_already_set();
  }

 private:
  PyTypeObject* type_;
  std::vector<py::object> descriptors_;
};

py::list new_records(const py::type& cls, const py::tuple& fields, const py::sequence& columns) {
  const Slots slots(cls, fields);
  if (columns.size() != slots.size())
    throw py::value_error("one column per field: " + std::to_string(slots.size()) +
                          " fields, " + std::to_string(columns.size()) + " columns");
  std::vector<py::iterator> iterators;
  for (const py::handle column : columns) iterators.push_back(py::iter(column));
  py::list records;
  while (true) {
    py::object record;
    for (size_t field = 0; field < iterators.size(); ++field) {
      const py::object value =
          py::reinterpret_steal<py::object>(PyIter_Next(iterators[field].ptr()));
      if (!value) {
        if (PyErr_Occurred()) throw py::error_already_set();
        if (field != 0) throw py::value_error("column 0 is longer than the others");
        for (size_t other = 1; other < iterators.size(); ++other) {
          PyObject* more = PyIter_Next(iterators[other].ptr());
          if (more != nullptr) {
            Py_DECREF(more);
            throw py::value_error("column " + std::to_string(other) +
                                  " is longer than column 0");
          }
          if (PyErr_Occurred()) throw py::error_already_set();
        }
        return records;
      }
      if (field == 0) record = slots.allocate();
      slots.set(record, field, value.ptr());
    }
    if (PyList_Append(records.ptr(), record.ptr()) != 0) throw py::error_already_set();
  }
}

py::list new_record_groups(const py::type& cls, const py::tuple& fields, const py::sequence& heads,
                           const py::sequence& rows) {
  const Slots slots(cls, fields);
  if (slots.size() == 0) throw py::value_error("a record has a head field");
  if (heads.size() != rows.size())
    throw py::value_error(std::to_string(heads.size()) + " heads for " +
                          std::to_string(rows.size()) + " groups of rows");
  py::list groups(heads.size());
  for (size_t group = 0; group < heads.size(); ++group) {
    const py::object head = heads[group];
    const py::object group_rows = py::reinterpret_steal<py::object>(
        PySequence_Fast(py::object(rows[group]).ptr(), "a group of rows is a sequence"));
    if (!group_rows) throw py::error_already_set();
    const Py_ssize_t count = PySequence_Fast_GET_SIZE(group_rows.ptr());
    py::list records(count);
    for (Py_ssize_t at = 0; at < count; ++at) {
      PyObject* row = PySequence_Fast_GET_ITEM(group_rows.ptr(), at);
      if (!PyTuple_Check(row) || static_cast<size_t>(PyTuple_GET_SIZE(row)) != slots.size() - 1)
        throw py::value_error("row " + std::to_string(at) + " of group " +
                              std::to_string(group) + " is not a tuple of " +
                              std::to_string(slots.size() - 1) + " values");
      py::object record = slots.allocate();
      slots.set(record, 0, head.ptr());
      for (size_t field = 1; field < slots.size(); ++field)
        slots.set(record, field, PyTuple_GET_ITEM(row, static_cast<Py_ssize_t>(field - 1)));
      PyList_SET_ITEM(records.ptr(), at, record.release().ptr());
    }
    PyList_SET_ITEM(groups.ptr(), static_cast<Py_ssize_t>(group), records.release().ptr());
  }
  return groups;
}

}  // namespace

void aoa::register_records(py::module_& m) {
  m.def("new_records", &new_records, py::arg("cls"), py::arg("fields"), py::arg("columns"),
        "Objects of the slotted class `cls`, one per row of `columns` (iterables, one per\n"
        "name in `fields`, of one length), each field set through its slot: the class is\n"
        "not called, so nothing is checked (for rows checked in bulk).");
  m.def("new_record_groups", &new_record_groups, py::arg("cls"), py::arg("fields"),
        py::arg("heads"), py::arg("rows"),
        "[[cls(heads[i], *row) for row in rows[i]] for each i], made as `new_records`\n"
        "makes them (the class not called): rows are tuples of the fields after the first.");
}
