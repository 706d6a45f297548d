// json.h — a small JSON value, reader and writer for emsa's own files (probe records, device
// profiles, plans). Internal: not part of the public API.
//
// Why our own: the core must build with nothing but a compiler (the GPU host installs nothing),
// and errors must name the field that is wrong ("params[3].shape[1]: expected an integer"),
// which the Reader below does. Objects keep insertion order so written files are byte-stable.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "emsa/status.h"

namespace emsa::json {

class Value {
 public:
  enum class Kind { kNull, kBool, kNumber, kString, kArray, kObject };
  using Array = std::vector<Value>;
  using Object = std::vector<std::pair<std::string, Value>>;  // insertion order kept

  Value() = default;                                // null
  Value(bool b) : kind_(Kind::kBool), bool_(b) {}   // NOLINT
  Value(int v) : Value(static_cast<int64_t>(v)) {}  // NOLINT
  Value(int64_t v)
      : kind_(Kind::kNumber), num_(static_cast<double>(v)), int_(v), is_int_(true) {}  // NOLINT
  Value(uint64_t v) : Value(static_cast<int64_t>(v)) {}    // NOLINT: values above 2^63 are not used
  Value(double v) : kind_(Kind::kNumber), num_(v) {}       // NOLINT
  Value(const char* s) : kind_(Kind::kString), str_(s) {}  // NOLINT
  Value(std::string s) : kind_(Kind::kString), str_(std::move(s)) {}  // NOLINT
  Value(Array a) : kind_(Kind::kArray), arr_(std::move(a)) {}         // NOLINT
  Value(Object o) : kind_(Kind::kObject), obj_(std::move(o)) {}       // NOLINT
  static Value MakeArray() { return Value(Array{}); }
  static Value MakeObject() { return Value(Object{}); }

  Kind kind() const { return kind_; }
  bool is_null() const { return kind_ == Kind::kNull; }
  bool is_bool() const { return kind_ == Kind::kBool; }
  bool is_number() const { return kind_ == Kind::kNumber; }
  bool is_int() const { return kind_ == Kind::kNumber && is_int_; }  // written without . or e
  bool is_string() const { return kind_ == Kind::kString; }
  bool is_array() const { return kind_ == Kind::kArray; }
  bool is_object() const { return kind_ == Kind::kObject; }

  bool as_bool() const { return bool_; }
  double as_double() const { return num_; }
  int64_t as_int() const { return is_int_ ? int_ : static_cast<int64_t>(num_); }
  const std::string& as_string() const { return str_; }
  const Array& as_array() const { return arr_; }
  Array& as_array() { return arr_; }
  const Object& as_object() const { return obj_; }
  Object& as_object() { return obj_; }

  // Object helpers. Set() replaces an existing key in place or appends.
  const Value* Find(std::string_view key) const;
  Value& Set(std::string key, Value v);
  // Array helper.
  Value& Push(Value v);

 private:
  Kind kind_ = Kind::kNull;
  bool bool_ = false;
  double num_ = 0.0;
  int64_t int_ = 0;
  bool is_int_ = false;
  std::string str_;
  Array arr_;
  Object obj_;
};

// Parses one JSON document. Errors are kParseError with "line L, column C: what".
// Nesting deeper than 256 levels is refused (no stack overflow on hostile input).
Result<Value> Parse(std::string_view text);

// Writes compact (indent < 0) or pretty (indent >= 0 spaces) JSON. Doubles are written with the
// fewest digits that read back to the same value, so identical values give identical text.
std::string Write(const Value& value, int indent = 2);

// Reads typed fields out of an object, naming the full path of any field that is missing or of
// the wrong type: "probe.params[3].numel: expected a non-negative integer, got \"abc\"".
class Reader {
 public:
  Reader(const Value& value, std::string path) : v_(&value), path_(std::move(path)) {}
  const Value& value() const { return *v_; }
  const std::string& path() const { return path_; }
  bool Has(std::string_view key) const;

  Result<std::string> String(std::string_view key) const;
  Result<int64_t> Int(std::string_view key) const;
  Result<uint64_t> UInt(std::string_view key) const;  // non-negative integer
  Result<double> Number(std::string_view key) const;  // finite
  Result<bool> Bool(std::string_view key) const;
  Result<Reader> Object(std::string_view key) const;
  Result<std::vector<Reader>> Array(std::string_view key) const;
  // Optional variants: the default when the key is absent or null; an error when present and
  // of the wrong type.
  Result<std::string> String(std::string_view key, const std::string& def) const;
  Result<int64_t> Int(std::string_view key, int64_t def) const;
  Result<uint64_t> UInt(std::string_view key, uint64_t def) const;
  Result<double> Number(std::string_view key, double def) const;
  Result<bool> Bool(std::string_view key, bool def) const;

  // The element itself, for arrays of scalars: Reader(shape[i]).AsInt().
  Result<int64_t> AsInt() const;
  Result<uint64_t> AsUInt() const;
  Result<double> AsNumber() const;
  Result<std::string> AsString() const;

  Status Error(std::string_view key, std::string_view what) const;  // kParseError at path.key

 private:
  Result<const Value*> Get(std::string_view key) const;  // present, non-null
  std::string Child(std::string_view key) const;
  const Value* v_;
  std::string path_;
};

// File helpers: whole-file read/write with kIoError naming the path.
Result<std::string> ReadFile(const std::string& path);
Status WriteFile(const std::string& path, std::string_view text);

}  // namespace emsa::json
