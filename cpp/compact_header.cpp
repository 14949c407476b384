// aoa._core.compact_entries / saved_offsets_of: a safetensors header's entries, and DCP's
// sharding info, read in the one compact form their writers use, in a pass over the text.
// Python's reading of that form (aoa/storage/compact_header.py: a regular expression's
// split, then the columns checked) takes ~45 ms for a rank file of 31k tiny tensors; here a
// few. Each function reads only what that form's Python reading accepts, and gives what it
// gives; anything else, or a number past int64, returns None and the Python reading decides
// (its checks and messages stay the only ones). The text is never read past its end.
#include "compact_header.hpp"

#include <cstdint>
#include <cstring>
#include <string_view>
#include <unordered_map>

namespace py = pybind11;

namespace {

// Why a text is left to the Python reading.
struct NotCompact {};

// A text read front to back; every step checks the bytes left.
class Cursor {
 public:
  explicit Cursor(std::string_view text) : at_(text.data()), end_(text.data() + text.size()) {}

  bool take(std::string_view expected) {
    if (static_cast<size_t>(end_ - at_) < expected.size() ||
        std::memcmp(at_, expected.data(), expected.size()) != 0)
      return false;
    at_ += expected.size();
    return true;
  }
  void expect(std::string_view expected) {
    if (!take(expected)) throw NotCompact{};
  }
  bool done() const { return at_ == end_; }

  // The text up to the next quote, and the quote: no backslash in it (nor, for a name, a
  // control character: JSON has them escaped).
  std::string_view quoted_rest(bool name) {
    const char* start = at_;
    while (at_ < end_ && *at_ != '"') {
      const auto c = static_cast<unsigned char>(*at_);
      if (c == '\\' || (name && c < 0x20)) throw NotCompact{};
      ++at_;
    }
    if (at_ == end_) throw NotCompact{};
    const std::string_view text(start, static_cast<size_t>(at_ - start));
    ++at_;
    return text;
  }

  // A number as JSON writes it (0, or digits without a leading zero), within int64.
  int64_t number() {
    if (at_ == end_ || !digit(*at_)) throw NotCompact{};
    if (*at_ == '0') {
      ++at_;
      if (at_ != end_ && digit(*at_)) throw NotCompact{};
      return 0;
    }
    int64_t value = 0;
    while (at_ != end_ && digit(*at_)) {
      if (__builtin_mul_overflow(value, 10, &value) ||
          __builtin_add_overflow(value, *at_ - '0', &value))
        throw NotCompact{};
      ++at_;
    }
    return value;
  }

  // Numbers parted by `separator` up to `]` (not taken), none at all where `]` comes first:
  // their text.
  std::string_view box(std::string_view separator) {
    const char* start = at_;
    if (at_ != end_ && *at_ != ']') {
      number();
      while (take(separator)) number();
    }
    return {start, static_cast<size_t>(at_ - start)};
  }

 private:
  static bool digit(char c) { return c >= '0' && c <= '9'; }
  const char* at_;
  const char* end_;
};

// The ASCII text of a compact str (None-worthy otherwise: its indices are not its bytes').
std::string_view ascii_text(const py::str& text) {
  if (!PyUnicode_IS_ASCII(text.ptr())) throw NotCompact{};
  return {reinterpret_cast<const char*>(PyUnicode_1BYTE_DATA(text.ptr())),
          static_cast<size_t>(PyUnicode_GET_LENGTH(text.ptr()))};
}

py::object owned(PyObject* object) {
  if (object == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(object);
}

py::object str_of(std::string_view text) {
  return owned(PyUnicode_FromStringAndSize(text.data(), static_cast<Py_ssize_t>(text.size())));
}

// One object for each distinct text among a column's (a box's tuple, a dtype code): a
// header's 31k shapes are a few dozen.
template <typename Make>
class Distinct {
 public:
  explicit Distinct(Make make) : make_(make) {}
  PyObject* operator()(std::string_view text) {
    auto found = made_.find(text);
    if (found == made_.end()) found = made_.emplace(text, make_(text)).first;
    return found->second.ptr();
  }

 private:
  Make make_;
  std::unordered_map<std::string_view, py::object> made_;
};

// The numbers of a box's text (as Cursor::box read it) as a tuple of ints.
py::object box_tuple(std::string_view text, std::string_view separator) {
  py::list numbers;
  Cursor cursor(text);
  if (!cursor.done()) {
    do {
      numbers.append(py::int_(cursor.number()));
    } while (cursor.take(separator));
  }
  return py::tuple(numbers);
}

void append(const py::list& list, PyObject* item) {
  if (PyList_Append(list.ptr(), item) != 0) throw py::error_already_set();
}

void append_number(const py::list& list, int64_t number) {
  append(list, owned(PyLong_FromLongLong(number)).ptr());
}

// text[start:end] read as `"name":{"dtype":"CODE","shape":[a,b],"data_offsets":[c,d]}`
// entries parted by commas, one or more: (names, codes, shapes, begins, ends), equal codes
// and shapes one object each; None where it is not that (or `text` is not ASCII).
py::object compact_entries(const py::str& text, Py_ssize_t start, Py_ssize_t end) {
  py::list names, codes, shapes, begins, ends;
  try {
    const std::string_view whole = ascii_text(text);
    if (start < 0 || end < start || static_cast<size_t>(end) > whole.size()) throw NotCompact{};
    Cursor cursor(whole.substr(static_cast<size_t>(start), static_cast<size_t>(end - start)));
    Distinct code_of([](std::string_view code) { return str_of(code); });
    Distinct shape_of([](std::string_view box) { return box_tuple(box, ","); });
    do {
      cursor.expect("\"");
      append(names, str_of(cursor.quoted_rest(true)).ptr());
      cursor.expect(":{\"dtype\":\"");
      append(codes, code_of(cursor.quoted_rest(false)));
      cursor.expect(",\"shape\":[");
      append(shapes, shape_of(cursor.box(",")));
      cursor.expect("],\"data_offsets\":[");
      append_number(begins, cursor.number());
      cursor.expect(",");
      append_number(ends, cursor.number());
      cursor.expect("]}");
    } while (cursor.take(","));
    if (!cursor.done()) throw NotCompact{};
  } catch (const NotCompact&) {
    return py::none();
  }
  return py::make_tuple(names, codes, shapes, begins, ends);
}

// `text` read as `{"name": {"saved_offsets": [a, b]}, ...}` listing exactly `names` (one
// or more, each plain: printable ASCII without quote or backslash), in their order: each
// one's offsets as a tuple of ints, equal ones one object; None where it is not that.
py::object saved_offsets_of(const py::str& text, const py::sequence& names) {
  py::list offsets;
  try {
    Cursor cursor(ascii_text(text));
    // (a tuple of them: the tuples made below may set the collector going, whose
    // finalizers could change a list)
    const py::tuple listed(names);
    const Py_ssize_t count = PyTuple_GET_SIZE(listed.ptr());
    if (count == 0) throw NotCompact{};
    Distinct offsets_of([](std::string_view box) { return box_tuple(box, ", "); });
    cursor.expect("{");
    for (Py_ssize_t at = 0; at < count; ++at) {
      PyObject* name = PyTuple_GET_ITEM(listed.ptr(), at);
      if (!PyUnicode_CheckExact(name) || !PyUnicode_IS_ASCII(name)) throw NotCompact{};
      const std::string_view name_text(
          reinterpret_cast<const char*>(PyUnicode_1BYTE_DATA(name)),
          static_cast<size_t>(PyUnicode_GET_LENGTH(name)));
      for (const char c : name_text)
        if (c < 0x20 || c == '"' || c == '\\') throw NotCompact{};
      cursor.expect(at == 0 ? "\"" : ", \"");
      cursor.expect(name_text);
      cursor.expect("\": {\"saved_offsets\": [");
      append(offsets, offsets_of(cursor.box(", ")));
      cursor.expect("]}");
    }
    cursor.expect("}");
    if (!cursor.done()) throw NotCompact{};
  } catch (const NotCompact&) {
    return py::none();
  }
  return offsets;
}

}  // namespace

void aoa::register_compact_header(py::module_& m) {
  m.def("compact_entries", &compact_entries, py::arg("text"), py::arg("start"), py::arg("end"),
        "text[start:end] (an ASCII str) read as safetensors header entries in the compact\n"
        "form, '\"name\":{\"dtype\":\"CODE\",\"shape\":[a,b],\"data_offsets\":[c,d]}' parted by\n"
        "commas: (names, codes, shapes, begins, ends), equal codes and shapes one object;\n"
        "numbers without leading zeros, within int64; names without backslash or control\n"
        "character. None where it is not that.");
  m.def("saved_offsets_of", &saved_offsets_of, py::arg("text"), py::arg("names"),
        "DCP sharding info `text` (an ASCII str) read as json.dumps writes it, listing exactly\n"
        "`names` (printable ASCII without quote or backslash) in their order: each one's saved\n"
        "offsets as a tuple of ints (equal ones one object); None where it is not that.");
}
