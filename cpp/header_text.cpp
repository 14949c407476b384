// aoa._core.header_texts: a safetensors file's header entries, and DCP's sharding info, as
// text, from the file's shard descriptions in one pass. In Python the layouts join them
// column by column, all but the joins in C-level loops, and still take 10-30 ms for a rank
// file of 31k tiny tensors (61x256 to TP4: ~75 ms of a 1.1 s conversion); here a few.
//
// Only the plain case is made here: keys of printable ASCII with no quote or backslash (a
// key then reads as itself between quotes, escaped or not), dtypes the caller's table
// names, boxes of ints in int64 and sizes that add up within it. Anything else returns
// None, and the caller takes its Python path, whose checks and messages stay the only ones.
#include "header_text.hpp"

#include <pybind11/numpy.h>
#include <structmember.h>

#include <charconv>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>

namespace py = pybind11;

namespace {

// Why a shard cannot be made here (the caller's Python path then reads it).
struct NotPlain {};

py::object owned(PyObject* object) {
  if (object == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(object);
}

// One field of objects of a slotted class, read straight from its slot (a member descriptor
// of an object, which getattr reads first too, being a data descriptor): a borrowed
// reference, held by the object for as long as no Python code runs. The type's slot is
// found (`bind`, which may run Python code) before any field of an object of that type is
// read; then none runs. A type without such a slot, or an empty slot, is not plain.
class Field {
 public:
  explicit Field(const char* name) : name_(py::str(name)) {}

  void bind(PyTypeObject* type) {
    type_ = nullptr;
    const py::object descriptor = py::reinterpret_steal<py::object>(
        PyObject_GetAttr(reinterpret_cast<PyObject*>(type), name_.ptr()));
    if (!descriptor) {
      PyErr_Clear();
      throw NotPlain{};
    }
    if (!Py_IS_TYPE(descriptor.ptr(), &PyMemberDescr_Type)) throw NotPlain{};
    const PyMemberDef* member =
        reinterpret_cast<PyMemberDescrObject*>(descriptor.ptr())->d_member;
    if (member->type != T_OBJECT_EX) throw NotPlain{};
    offset_ = member->offset;
    type_ = type;
  }

  // The field of `object`, of the type bound last.
  PyObject* get(PyObject* object) const {
    PyObject* value = slot(object);
    if (value == nullptr) throw NotPlain{};
    return value;
  }

  // Starts loading what the slot of `object` holds (where a key's text begins), for a
  // shard some way ahead of the one being written.
  void prefetch(PyObject* object) const {
    if (Py_TYPE(object) == type_) __builtin_prefetch(slot(object));
  }

 private:
  PyObject* slot(PyObject* object) const {
    return *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(object) + offset_);
  }

  py::str name_;
  PyTypeObject* type_ = nullptr;
  Py_ssize_t offset_ = 0;
};

// The shards of a sequence, and their fields bound to the type of the shard at hand.
class Shards {
 public:
  Field key{"key"}, local_shape{"local_shape"}, dtype{"dtype"}, global_offset{"global_offset"};

  explicit Shards(const py::sequence& shards)
      : list_(owned(PySequence_Fast(shards.ptr(), "shards must be a sequence"))) {
    look();
  }
  Py_ssize_t size() const { return count_; }

  // Shard `at`, its fields bound to its type. Binding a new type may run Python code
  // (a metaclass's), which may change the sequence: it is looked at again after.
  PyObject* at(Py_ssize_t at) {
    if (at >= count_) throw NotPlain{};
    PyObject* shard = items_[at];
    if (Py_TYPE(shard) == type_) return shard;
    type_ = nullptr;
    PyTypeObject* type = Py_TYPE(shard);
    const py::object held = py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(type));
    for (Field* field : {&key, &local_shape, &dtype, &global_offset}) field->bind(type);
    look();
    if (at >= count_ || Py_TYPE(items_[at]) != type) throw NotPlain{};
    type_ = type;
    return items_[at];
  }

  // Whether the sequence still holds `count` shards (a metaclass's code may change it).
  bool holds(Py_ssize_t count) const { return count_ == count; }

  // Starts loading shard `at` (nothing past the end).
  void prefetch(Py_ssize_t at) const {
    if (at < count_) __builtin_prefetch(items_[at]);
  }
  // Starts loading the key of shard `at`, where its type is bound.
  void prefetch_key(Py_ssize_t at) const {
    if (at < count_) key.prefetch(items_[at]);
  }

 private:
  void look() {
    items_ = PySequence_Fast_ITEMS(list_.ptr());
    count_ = PySequence_Fast_GET_SIZE(list_.ptr());
  }

  py::object list_;
  PyObject** items_ = nullptr;
  Py_ssize_t count_ = 0;
  PyTypeObject* type_ = nullptr;
};

// Text written front to back into the bytes object that returns it (no copy made at the
// end; memory not zeroed first: only what is written is touched), grown as needed: appends
// are a bounds check and a copy (std::string's checked appends were a third of the time).
// In a conversion each copy of a rank file's header texts (3-4 MB) is fresh memory, ~1k
// page faults.
class Text {
 public:
  explicit Text(size_t capacity)
      : bytes_(owned(PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(capacity)))),
        capacity_(capacity) {}

  void add(const char* text, size_t size) {
    if (size_ + size > capacity_) resize(2 * (size_ + size));
    std::memcpy(PyBytes_AS_STRING(bytes_.ptr()) + size_, text, size);
    size_ += size;
  }
  void add(std::string_view text) { add(text.data(), text.size()); }
  void add(char c) { add(&c, 1); }
  void add_number(int64_t number) {
    char digits[24];
    add(digits, static_cast<size_t>(std::to_chars(digits, digits + sizeof digits, number).ptr -
                                    digits));
  }

  // The bytes written; the text is done with.
  py::bytes finish() {
    resize(size_);
    return py::reinterpret_steal<py::bytes>(bytes_.release());
  }

 private:
  // The bytes object made `capacity` long, moved where it must be (it is this text's alone,
  // as _PyBytes_Resize wants).
  void resize(size_t capacity) {
    PyObject* bytes = bytes_.release().ptr();
    if (_PyBytes_Resize(&bytes, static_cast<Py_ssize_t>(capacity)) != 0)
      throw py::error_already_set();  // (the object is gone then)
    bytes_ = py::reinterpret_steal<py::object>(bytes);
    capacity_ = capacity;
  }

  py::object bytes_;
  size_t capacity_;
  size_t size_ = 0;
};

// A box's text (its numbers parted by a separator) and the product of its numbers, made
// once for each box object in a row: a file's shards share a few shape and offset tuples.
class Boxes {
 public:
  explicit Boxes(std::string_view separator) : separator_(separator) {}

  // `box`, a tuple of ints each in 0 .. 2^63-1 (else not plain; NotPlain too where their
  // product passes int64, for a shape).
  void find(PyObject* box, bool product_needed) {
    if (box == last_) return;
    if (!PyTuple_CheckExact(box)) throw NotPlain{};
    text_.clear();
    product_ = 1;
    bool overflowed = false;
    const Py_ssize_t count = PyTuple_GET_SIZE(box);
    for (Py_ssize_t at = 0; at < count; ++at) {
      PyObject* item = PyTuple_GET_ITEM(box, at);
      if (!PyLong_CheckExact(item)) throw NotPlain{};
      int overflow = 0;
      const long long number = PyLong_AsLongLongAndOverflow(item, &overflow);
      if (overflow != 0 || number < 0) throw NotPlain{};
      if (at > 0) text_ += separator_;
      char digits[24];
      text_.append(digits, std::to_chars(digits, digits + sizeof digits, number).ptr);
      overflowed |= __builtin_mul_overflow(product_, static_cast<int64_t>(number), &product_);
    }
    if (overflowed && product_needed) throw NotPlain{};
    last_ = box;
    held_ = py::reinterpret_borrow<py::object>(box);  // keeps `last_` what it was
  }
  std::string_view text() const { return text_; }
  int64_t product() const { return product_; }

 private:
  std::string separator_;
  PyObject* last_ = nullptr;
  py::object held_;
  std::string text_;
  int64_t product_ = 1;
};

// The key's text between quotes, if it reads as itself (printable ASCII, no quote or
// backslash).
std::string_view plain_key(PyObject* key) {
  if (!PyUnicode_CheckExact(key) || !PyUnicode_IS_ASCII(key)) throw NotPlain{};
  const char* text = reinterpret_cast<const char*>(PyUnicode_1BYTE_DATA(key));
  const Py_ssize_t size = PyUnicode_GET_LENGTH(key);
  for (Py_ssize_t at = 0; at < size; ++at) {
    const char c = text[at];
    if (c < 0x20 || c > 0x7E || c == '"' || c == '\\') throw NotPlain{};
  }
  return {text, static_cast<size_t>(size)};
}

// A dtype's safetensors code and item size, from the caller's table (dtype -> (code,
// itemsize), or -> itemsize where no code is wanted); a dtype of None read as `none_as`,
// where one is given. The last one found is kept, as a file's shards mostly share one
// (equal texts, not always one object).
class Dtypes {
 public:
  explicit Dtypes(const py::dict& table, PyObject* none_as = nullptr)
      : table_(table), none_as_(none_as) {}

  void find(PyObject* dtype) {
    if (dtype == last_) return;
    PyObject* name = dtype == Py_None && none_as_ != nullptr ? none_as_ : dtype;
    if (!PyUnicode_CheckExact(name)) throw NotPlain{};  // (no __eq__ of its own to run)
    if (last_name_ != nullptr && PyUnicode_Compare(name, last_name_.ptr()) == 0) {
      remember(dtype, name);
      return;
    }
    PyObject* entry = PyDict_GetItemWithError(table_.ptr(), name);  // borrowed
    if (entry == nullptr) {
      if (PyErr_Occurred()) throw py::error_already_set();
      throw NotPlain{};
    }
    PyObject* itemsize = entry;
    code_.clear();
    if (PyTuple_Check(entry)) {
      if (PyTuple_GET_SIZE(entry) != 2) throw NotPlain{};
      code_ = std::string(plain_key(PyTuple_GET_ITEM(entry, 0)));
      itemsize = PyTuple_GET_ITEM(entry, 1);
    }
    if (!PyLong_CheckExact(itemsize)) throw NotPlain{};
    itemsize_ = PyLong_AsLongLong(itemsize);
    if (itemsize_ <= 0) throw NotPlain{};
    remember(dtype, name);
  }
  std::string_view code() const { return code_; }
  int64_t itemsize() const { return itemsize_; }

 private:
  // (both held, so that `last_` stays what it was)
  void remember(PyObject* dtype, PyObject* name) {
    last_ = dtype;
    held_ = py::reinterpret_borrow<py::object>(dtype);
    last_name_ = py::reinterpret_borrow<py::object>(name);
  }

  py::dict table_;
  PyObject* none_as_;
  PyObject* last_ = nullptr;
  py::object held_, last_name_;
  std::string code_;
  int64_t itemsize_ = 0;
};

py::object header_texts(const py::sequence& shards, const py::dict& dtypes,
                        const py::object& sharding) {
  std::string quote, offsets_key, opening, closing;
  const bool with_sharding = !sharding.is_none();
  if (with_sharding)
    std::tie(quote, offsets_key, opening, closing) =
        sharding.cast<std::tuple<std::string, std::string, std::string, std::string>>();
  Shards fields(shards);
  const Py_ssize_t count = fields.size();
  Dtypes table(dtypes);
  Boxes shapes(","), offsets(", ");
  py::array_t<int64_t> sizes(count), itemsizes(count);
  int64_t* size_at = sizes.mutable_data();
  int64_t* itemsize_at = itemsizes.mutable_data();
  Text entries(static_cast<size_t>(count) * 128 + 64);
  Text info(with_sharding ? static_cast<size_t>(count) * 96 + opening.size() + 64 : 0);
  if (with_sharding) info.add(opening);
  int64_t end = 0;
  // The shards lie scattered in memory, and their keys further: each is loaded some shards
  // before it is written (the objects 16 ahead, their keys 8 ahead), not waited for.
  constexpr Py_ssize_t kObjectsAhead = 16, kKeysAhead = 8;
  try {
    for (Py_ssize_t at = 0; at < count; ++at) {
      fields.prefetch(at + kObjectsAhead);
      fields.prefetch_key(at + kKeysAhead);
      PyObject* shard = fields.at(at);
      const std::string_view name = plain_key(fields.key.get(shard));
      table.find(fields.dtype.get(shard));
      shapes.find(fields.local_shape.get(shard), true);
      int64_t size = 0;
      if (__builtin_mul_overflow(shapes.product(), table.itemsize(), &size)) throw NotPlain{};
      const int64_t begin = end;
      if (__builtin_add_overflow(end, size, &end)) throw NotPlain{};
      if (at > 0) entries.add(',');
      entries.add('"');
      entries.add(name);
      entries.add("\":{\"dtype\":\"");
      entries.add(table.code());
      entries.add("\",\"shape\":[");
      entries.add(shapes.text());
      entries.add("],\"data_offsets\":[");
      entries.add_number(begin);
      entries.add(',');
      entries.add_number(end);
      entries.add("]}");
      size_at[at] = size;
      itemsize_at[at] = table.itemsize();
      if (with_sharding) {
        offsets.find(fields.global_offset.get(shard), false);
        if (at > 0) info.add(", ");
        info.add(quote);
        info.add(name);
        info.add(quote);
        info.add(": {");
        info.add(quote);
        info.add(offsets_key);
        info.add(quote);
        info.add(": [");
        info.add(offsets.text());
        info.add("]}");
      }
    }
    if (!fields.holds(count)) throw NotPlain{};
  } catch (const NotPlain&) {
    return py::none();
  }
  py::object info_text = py::none();
  if (with_sharding) {
    info.add(closing);
    info_text = info.finish();
  }
  return py::make_tuple(entries.finish(), sizes, itemsizes, info_text);
}

// Each shard's bytes, its local shape's elements times its dtype's item size (`itemsizes`:
// dtype -> item size; a dtype of None counts as `none_as`), as an int64 array; None where a
// shard is not plain (a dtype not in `itemsizes`, a shape not a tuple of ints, bytes past
// int64).
py::object shard_nbytes(const py::sequence& shards, const py::dict& itemsizes,
                        const py::str& none_as) {
  Shards fields(shards);
  const Py_ssize_t count = fields.size();
  Boxes shapes(",");
  py::array_t<int64_t> nbytes(count);
  int64_t* nbytes_at = nbytes.mutable_data();
  Dtypes table(itemsizes, none_as.ptr());
  constexpr Py_ssize_t kObjectsAhead = 16;
  try {
    for (Py_ssize_t at = 0; at < count; ++at) {
      fields.prefetch(at + kObjectsAhead);
      PyObject* shard = fields.at(at);
      table.find(fields.dtype.get(shard));
      shapes.find(fields.local_shape.get(shard), true);
      if (__builtin_mul_overflow(shapes.product(), table.itemsize(), &nbytes_at[at]))
        throw NotPlain{};
    }
    if (!fields.holds(count)) throw NotPlain{};
  } catch (const NotPlain&) {
    return py::none();
  }
  return std::move(nbytes);
}

}  // namespace

void aoa::register_header_text(py::module_& m) {
  m.def("header_texts", &header_texts, py::arg("shards"), py::arg("dtypes"),
        py::arg("sharding") = py::none(),
        "For shard descriptions (key, local_shape, dtype, global_offset) stored back to back:\n"
        "(entries, sizes, itemsizes, sharding_info), where entries is the safetensors header's\n"
        "text of them, '\"key\":{\"dtype\":...,\"shape\":[...],\"data_offsets\":[b,e]}' parted by\n"
        "commas, as json.dumps writes it (compact); sizes and itemsizes int64 arrays; and with\n"
        "`sharding` = (quote, offsets_key, opening, closing), opening, each key's global offset\n"
        "as 'QkeyQ: {QoffsetsQ: [a, b]}' parted by ', ', then closing (else None); texts as\n"
        "bytes. `dtypes` maps a dtype to (safetensors code, item size).\n"
        "None where a shard is not plain (a key that is not printable ASCII without quote or\n"
        "backslash, a dtype not in `dtypes`, a box that is not a tuple of ints in int64, sizes\n"
        "past int64): the caller's own path reads those.");
  m.def("shard_nbytes", &shard_nbytes, py::arg("shards"), py::arg("itemsizes"),
        py::arg("none_as"),
        "Each shard's bytes (the elements of its local_shape times the item size of its\n"
        "dtype, `itemsizes` mapping dtype to item size; a dtype of None counts as `none_as`)\n"
        "as an int64 array; None where a shard is not plain (a dtype not in `itemsizes`, a\n"
        "shape that is not a tuple of ints in int64, bytes past int64).");
}
