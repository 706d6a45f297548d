// json.h — a small JSON value, parser, reader and writer for emsa's own files (probe records,
// device profiles, plans) and Hugging Face config.json files. Internal: not part of the public API.
//
// Parse reads the text with nlohmann/json's parser (header-only, included by json_parse.cc alone)
// and adds emsa's limits and rules. The Value, the Reader and the writer are emsa's: a Value is one
// word, so a parsed record stays within a small multiple of its text; errors name the field that
// is wrong ("params[3].shape[1]: expected an integer"); and written files keep emsa's layout and
// insertion order byte for byte (examples/probes/ are compared as bytes). docs/decisions.md has
// the measurements behind the split.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "emsa/status.h"

namespace emsa::json {

// A JSON value in 16 bytes: the kind and one word, a scalar or the pointer to an owned string,
// array or object, so a parsed document stays within a small multiple of its text.
class Value {
 public:
  enum class Kind : uint8_t { kNull, kBool, kNumber, kString, kArray, kObject };
  using Array = std::vector<Value>;
  using Object = std::vector<std::pair<std::string, Value>>;  // insertion order kept

  Value() = default;                                        // null
  Value(bool b) : kind_(Kind::kBool) { word_.b = b; }       // NOLINT
  Value(int v) : Value(static_cast<int64_t>(v)) {}          // NOLINT
  Value(int64_t v) : kind_(Kind::kNumber), is_int_(true) {  // NOLINT
    word_.i = v;
  }
  Value(uint64_t v) : Value(static_cast<int64_t>(v)) {}    // NOLINT: values above 2^63 are not used
  Value(double v) : kind_(Kind::kNumber) { word_.d = v; }  // NOLINT
  Value(const char* s) : Value(std::string(s)) {}          // NOLINT
  Value(std::string s) : kind_(Kind::kString) {            // NOLINT
    word_.s = new std::string(std::move(s));
  }
  Value(Array a) : kind_(Kind::kArray) { word_.a = new Array(std::move(a)); }     // NOLINT
  Value(Object o) : kind_(Kind::kObject) { word_.o = new Object(std::move(o)); }  // NOLINT
  Value(const Value& other);
  Value(Value&& other) noexcept : kind_(other.kind_), is_int_(other.is_int_), word_(other.word_) {
    other.kind_ = Kind::kNull;
  }
  Value& operator=(const Value& other);
  Value& operator=(Value&& other) noexcept;
  ~Value() { Release(); }
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

  // Accessors of the wrong kind answer false, 0, or an empty string, array or object; the
  // mutable as_array()/as_object() first make a value of another kind an empty one of theirs.
  bool as_bool() const { return kind_ == Kind::kBool && word_.b; }
  double as_double() const;
  int64_t as_int() const;
  const std::string& as_string() const;
  const Array& as_array() const;
  Array& as_array();
  const Object& as_object() const;
  Object& as_object();

  // Object helpers. Set() replaces an existing key in place or appends.
  const Value* Find(std::string_view key) const;
  Value& Set(std::string key, Value v);
  // Array helper.
  Value& Push(Value v);

 private:
  void Release() noexcept;
  Kind kind_ = Kind::kNull;
  bool is_int_ = false;
  union Word {
    bool b;
    int64_t i;
    double d;
    std::string* s;
    Array* a;
    Object* o;
  } word_{};
};

// Limits that keep hostile text from exhausting the stack or memory: deeper nesting or more
// values than these is refused. A probe record of a model with a hundred thousand parameter
// tensors holds about two million values.
inline constexpr int kMaxDepth = 256;
inline constexpr size_t kMaxValues = size_t{1} << 22;
// Files larger than this are refused before they are read.
inline constexpr uint64_t kMaxFileBytes = uint64_t{128} << 20;

// Parses one JSON document (RFC 8259: strings must be UTF-8; a leading byte order mark is
// skipped). Errors are kParseError with "line L, column C: what"; kOutOfMemory if an allocation
// fails. Refused beyond the RFC: nesting deeper than kMaxDepth, more than kMaxValues values, a key
// repeated in an object, an integer outside int64 (never rounded to a double), a NUL byte.
// Linear in the text.
Result<Value> Parse(std::string_view text);

// Where Parse hands over the elements of the root object's large arrays, so that a document
// such as a probe record is never held whole beside what it is read into: each element of an
// array under one of `keys` in the root object goes to `take` (its key, its index, the element)
// as soon as it is parsed, and the document keeps an empty array under that key, so a missing,
// repeated or mistyped key is still seen there. Syntax errors anywhere still fail Parse; `take`
// keeps its own errors, to report after Parse has succeeded.
struct ElementSink {
  std::vector<std::string> keys;
  std::function<void(const std::string& key, size_t index, Value element)> take;
};
Result<Value> Parse(std::string_view text, const ElementSink& sink);

// Writes compact (indent < 0) or pretty (indent >= 0 spaces) JSON. Doubles are written with the
// fewest digits that read back to the same value, so identical values give identical text.
// Strings are written as held: one that is not UTF-8 gives text Parse refuses.
std::string Write(const Value& value, int indent = 2);

// Writes an object one member at a time, the same text as Write(object, indent), so that a
// document with large arrays is never held whole as Values: each element is built, written and
// dropped. The elements given to Element() must be objects or arrays (Write keeps arrays of
// scalars on one line; this writer never does).
class ObjectWriter {
 public:
  ObjectWriter(std::string* out, int indent);
  void Member(std::string_view key, const Value& value);
  void BeginArray(std::string_view key);  // a member holding an array of objects or arrays
  void Element(const Value& element);
  void EndArray();
  void Finish();  // closes the object; with indent >= 0 adds the newline that Write ends with

 private:
  void Key(std::string_view key);
  std::string* out_;
  int indent_;
  size_t members_ = 0, elements_ = 0;
};

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

// File helpers with kIoError naming the path. ReadFile refuses a file (or a stream such as
// /dev/zero) longer than max_bytes before holding more of it. WriteFile is atomic: it writes a
// temporary file in the same folder, flushes and fsyncs it, then renames it over `path`, so a
// reader sees the old file or the new one, never a torn one.
Result<std::string> ReadFile(const std::string& path, uint64_t max_bytes = kMaxFileBytes);
Status WriteFile(const std::string& path, std::string_view text);
// The same for text made in pieces: `produce` hands each piece, in order, to the function it is
// given, so a large text need not be held whole before it is written.
using Producer = std::function<void(const std::function<void(std::string_view)>& emit)>;
Status WriteFile(const std::string& path, const Producer& produce);

}  // namespace emsa::json
