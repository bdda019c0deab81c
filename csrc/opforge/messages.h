#pragma once
// The words of opforge's input checks, one table behind both kits: the library's
// wrappers on the stable ABI (opforge/stable/common.h) and the ATen helpers that
// users' own builds include (opforge/aten/common.h); opforge/ops/_rules.py says the
// same on the Python side. Header-only torch alone, so both kits can include it.

#include <torch/headeronly/core/ScalarType.h>

#include <sstream>
#include <string>

namespace opforge {

template <typename... Args>
std::string message(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

// Python's spelling of a dtype, so a message reads "got torch.int32" as the
// user wrote it rather than c10's "Int".
inline std::string dtype_name(c10::ScalarType st) {
  using c10::ScalarType;
  switch (st) {
    case ScalarType::Float: return "torch.float32";
    case ScalarType::Half: return "torch.float16";
    case ScalarType::BFloat16: return "torch.bfloat16";
    case ScalarType::Double: return "torch.float64";
    case ScalarType::Int: return "torch.int32";
    case ScalarType::Long: return "torch.int64";
    case ScalarType::Short: return "torch.int16";
    case ScalarType::Char: return "torch.int8";
    case ScalarType::Byte: return "torch.uint8";
    case ScalarType::Bool: return "torch.bool";
    case ScalarType::ComplexFloat: return "torch.complex64";
    case ScalarType::ComplexDouble: return "torch.complex128";
    default: return std::string("torch.") + c10::toString(st);
  }
}

inline bool is_floating(c10::ScalarType st) {
  using c10::ScalarType;
  return st == ScalarType::Float || st == ScalarType::Half || st == ScalarType::BFloat16 || st == ScalarType::Double;
}

// Each message starts with the operator's name and shows the offending value.
// Devices and shapes come as whatever the kit prints them with (`<<`).
namespace msg {

inline std::string undefined(const char* op, const char* name) {
  return message(op, ": ", name, " is an undefined tensor");
}
inline std::string not_floating(const char* op, const char* name, c10::ScalarType got) {
  return message(op, ": ", name, " must be float32, float16, bfloat16 or float64, got ", dtype_name(got));
}
template <typename Device>
std::string devices_differ(const char* op, const char* a, const char* b, const Device& da, const Device& db) {
  return message(op, ": ", a, " and ", b, " must be on the same device, got ", da, " and ", db);
}
inline std::string dtypes_differ(const char* op, const char* a, const char* b, c10::ScalarType da, c10::ScalarType db) {
  return message(op, ": ", a, " and ", b, " must have the same dtype, got ", dtype_name(da), " and ", dtype_name(db));
}
template <typename Shape>
std::string not_2d(const char* op, const char* name, const char* layout, const Shape& got) {
  return message(op, ": ", name, " must be 2-D ", layout, ", got shape ", got);
}
template <typename Shape>
std::string wrong_shape(const char* op, const char* name, const char* how, const Shape& want, const Shape& got) {
  return message(op, ": ", name, " must have shape ", how, " = ", want, ", got ", got);
}
template <typename Shape>
std::string shapes_differ(const char* op, const char* a, const char* b, const Shape& sa, const Shape& sb) {
  return message(op, ": ", a, " and ", b, " must have the same shape, got ", sa, " and ", sb);
}
template <typename Device>
std::string out_device(const char* op, const Device& want, const Device& got) {
  return message(op, ": out must be on ", want, ", got ", got);
}
inline std::string out_dtype(const char* op, c10::ScalarType want, c10::ScalarType got) {
  return message(op, ": out must have dtype ", dtype_name(want), ", got ", dtype_name(got));
}
template <typename Shape>
std::string out_shape(const char* op, const Shape& want, const Shape& got) {
  return message(op, ": out must have shape ", want, ", got ", got);
}
template <typename Shape>
std::string out_self_overlap(const char* op, const Shape& strides) {
  return message(op, ": out has elements that share memory (strides ", strides, "); pass a tensor with distinct elements");
}
inline std::string out_shares(const char* op, const char* input, const void* address) {
  return message(op, ": out shares memory with input ", input, " (address ", address,
                 "); pass an out tensor that shares no memory with the inputs");
}

}  // namespace msg
}  // namespace opforge
