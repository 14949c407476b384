// aoa._core: the copy kernel for Python (and records.cpp's bulk records, header_text.cpp's and
// compact_header.cpp's header texts). Converts the arguments, releases the GIL, runs
// the loops; the table format and every check live in copy_kernel.cpp.
#include <pybind11/pybind11.h>

#include <memory>
#include <string>
#include <vector>

#include "copy_kernel.hpp"
#include "compact_header.hpp"
#include "header_text.hpp"
#include "records.hpp"

namespace py = pybind11;

namespace {

// The bytes of any buffer-protocol object, contiguous, open while this lives. Asked for
// without an item format: numpy exports bfloat16 and fp8 arrays only that way (and
// py::buffer::request always asks for one), and the kernel needs bytes only.
class ByteView {
 public:
  ByteView(py::handle object, const std::string& name, bool writable) {
    if (PyObject_GetBuffer(object.ptr(), &view_, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) != 0) {
      const py::error_already_set error;
      throw py::value_error(name + " is not a " + (writable ? "writable " : "") +
                            "contiguous buffer: " + error.what());
    }
  }
  ByteView(const ByteView&) = delete;
  ByteView& operator=(const ByteView&) = delete;
  ~ByteView() { PyBuffer_Release(&view_); }
  uint8_t* data() const { return static_cast<uint8_t*>(view_.buf); }
  int64_t size() const { return static_cast<int64_t>(view_.len); }

 private:
  Py_buffer view_{};
};

PyObject* bus_error_type = nullptr;

// BusError(message, role, index, offset): which buffer the vanished memory was in ("source"
// or "destination", its index, the byte offset in it), or role None where in none of them.
[[noreturn]] void raise_bus_error(const void* address,
                                  const std::vector<aoa::SourceBuffer>& sources,
                                  const std::vector<aoa::DestinationBuffer>& destinations) {
  const auto at = reinterpret_cast<uintptr_t>(address);
  py::object role = py::none();
  int64_t index = -1, offset = -1;
  auto find = [&](const char* name, const auto& buffers) {
    for (size_t i = 0; i < buffers.size() && role.is_none(); ++i) {
      const auto start = reinterpret_cast<uintptr_t>(buffers[i].data);
      if (at >= start && at - start < static_cast<uintptr_t>(buffers[i].size)) {
        role = py::str(name);
        index = static_cast<int64_t>(i);
        offset = static_cast<int64_t>(at - start);
      }
    }
  };
  find("source", sources);
  find("destination", destinations);
  const std::string message =
      role.is_none() ? std::string("bus error outside every buffer")
                     : "bus error in " + role.cast<std::string>() + " " + std::to_string(index) +
                           " at byte " + std::to_string(offset) +
                           ": the memory behind it is gone (a mapped file truncated?)";
  PyErr_SetObject(bus_error_type, py::make_tuple(message, role, index, offset).ptr());
  throw py::error_already_set();
}

// The buffers a table numbers on one side (`role`: "source", "destination"): the buffers
// themselves, or with `windows` (int64 rows of buffer, offset, bytes) those ranges of them,
// each checked to lie inside its buffer. A source's windows spare a view per tensor: tens
// of thousands of small tensors lie in a few mapped files.
template <typename Buffer>
std::vector<Buffer> buffer_ranges(const std::vector<Buffer>& buffers, const py::object& windows,
                                  const char* role) {
  if (windows.is_none()) return buffers;
  const py::buffer_info rows = windows.cast<py::buffer>().request();
  if (!rows.item_type_is_equivalent_to<int64_t>() || rows.ndim != 2 || rows.shape[1] != 3 ||
      (rows.shape[0] > 0 && (rows.strides[0] != 24 || rows.strides[1] != 8)))
    throw py::value_error(std::string("the ") + role +
                          " windows must be a contiguous (n, 3) buffer of int64");
  const auto* fields = static_cast<const int64_t*>(rows.ptr);
  std::vector<Buffer> ranges;
  ranges.reserve(static_cast<size_t>(rows.shape[0]));
  for (py::ssize_t i = 0; i < rows.shape[0]; ++i) {
    const int64_t buffer = fields[3 * i], offset = fields[3 * i + 1], size = fields[3 * i + 2];
    if (buffer < 0 || buffer >= static_cast<int64_t>(buffers.size()) || offset < 0 ||
        size < 0 || size > buffers[static_cast<size_t>(buffer)].size - offset)
      throw py::value_error(std::string(role[0] == 's' ? "source " : "") + "window " +
                            std::to_string(i) + " (buffer " + std::to_string(buffer) +
                            ", offset " + std::to_string(offset) + ", " +
                            std::to_string(size) + " bytes) does not lie inside a " + role +
                            " buffer");
    ranges.push_back({buffers[static_cast<size_t>(buffer)].data + offset, size});
  }
  return ranges;
}

void execute_copies(const py::buffer& table, const py::sequence& sources,
                    const py::sequence& destinations, int64_t threads,
                    const py::object& windows, const py::object& source_windows) {
  const py::buffer_info fields = table.request();
  if (!fields.item_type_is_equivalent_to<int64_t>() || fields.ndim != 1 ||
      (fields.size > 1 && fields.strides[0] != 8))
    throw py::value_error("the copy table must be a contiguous 1-d buffer of int64");

  std::vector<std::unique_ptr<ByteView>> views;  // kept open until the copies are done
  std::vector<aoa::SourceBuffer> source_buffers;
  for (size_t i = 0; i < sources.size(); ++i) {
    views.push_back(std::make_unique<ByteView>(sources[i], "source " + std::to_string(i), false));
    source_buffers.push_back({views.back()->data(), views.back()->size()});
  }
  std::vector<aoa::DestinationBuffer> destination_buffers;
  for (size_t i = 0; i < destinations.size(); ++i) {
    views.push_back(
        std::make_unique<ByteView>(destinations[i], "destination " + std::to_string(i), true));
    destination_buffers.push_back({views.back()->data(), views.back()->size()});
  }
  source_buffers = buffer_ranges(source_buffers, source_windows, "source");
  destination_buffers = buffer_ranges(destination_buffers, windows, "destination");

  try {
    py::gil_scoped_release release;
    aoa::execute_copies(static_cast<const int64_t*>(fields.ptr), fields.size, source_buffers,
                        destination_buffers, threads);
  } catch (const aoa::BusError& error) {
    raise_bus_error(error.address, source_buffers, destination_buffers);
  }
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "The aoa copy kernel: strided region copies with fused casts, over threads.";
  py::register_exception<aoa::CopyError>(m, "CopyError", PyExc_ValueError);
  bus_error_type = PyErr_NewExceptionWithDoc(
      "aoa._core.BusError",
      "Memory behind a buffer vanished while the copies ran (a mapped file truncated):\n"
      "args are (message, role, index, offset): 'source' or 'destination' (None: neither),\n"
      "the buffer's index and the byte offset in it. The copies stopped there.",
      PyExc_RuntimeError, nullptr);
  m.attr("BusError") = py::handle(bus_error_type);

  py::dict codes;
  for (int64_t code = 0; code < aoa::kDtypeCount; ++code)
    codes[aoa::dtype_name(static_cast<aoa::Dtype>(code))] = code;
  m.attr("DTYPE_CODES") = codes;

  m.def("execute_copies", &execute_copies, py::arg("table"), py::arg("sources"),
        py::arg("destinations"), py::arg("threads") = 1, py::arg("windows") = py::none(),
        py::arg("source_windows") = py::none(),
        "Run every copy of `table` (int64 records, see cpp/copy_kernel.hpp) from the `sources`\n"
        "buffers into the writable `destinations` (or, with `windows`, int64 rows of buffer,\n"
        "offset, bytes: those ranges of them; `source_windows` likewise for the sources), on\n"
        "up to `threads` threads, the GIL released.\n"
        "Raises CopyError (a ValueError) naming the copy before any byte moves.");
  aoa::register_records(m);
  aoa::register_header_text(m);
  aoa::register_compact_header(m);
}
