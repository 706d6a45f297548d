// json_value.cc — json::Value of src/common/json.h: ownership of its one word, and accessors.
#include <string>
#include <string_view>
#include <utility>

#include "common/json.h"

namespace emsa::json {

Value::Value(const Value& other) : kind_(other.kind_), is_int_(other.is_int_), word_(other.word_) {
  switch (kind_) {
    case Kind::kString:
      word_.s = new std::string(*other.word_.s);
      break;
    case Kind::kArray:
      word_.a = new Array(*other.word_.a);
      break;
    case Kind::kObject:
      word_.o = new Object(*other.word_.o);
      break;
    default:
      break;
  }
}

Value& Value::operator=(const Value& other) {
  if (this != &other) *this = Value(other);
  return *this;
}

Value& Value::operator=(Value&& other) noexcept {
  if (this == &other) return *this;
  Release();
  kind_ = other.kind_;
  is_int_ = other.is_int_;
  word_ = other.word_;
  other.kind_ = Kind::kNull;
  return *this;
}

void Value::Release() noexcept {
  switch (kind_) {
    case Kind::kString:
      delete word_.s;
      break;
    case Kind::kArray:
      delete word_.a;
      break;
    case Kind::kObject:
      delete word_.o;
      break;
    default:
      break;
  }
  kind_ = Kind::kNull;
}

double Value::as_double() const {
  if (kind_ != Kind::kNumber) return 0.0;
  return is_int_ ? static_cast<double>(word_.i) : word_.d;
}

int64_t Value::as_int() const {
  if (kind_ != Kind::kNumber) return 0;
  return is_int_ ? word_.i : static_cast<int64_t>(word_.d);
}

const std::string& Value::as_string() const {
  static const std::string kEmpty;
  return kind_ == Kind::kString ? *word_.s : kEmpty;
}

const Value::Array& Value::as_array() const {
  static const Array kEmpty;
  return kind_ == Kind::kArray ? *word_.a : kEmpty;
}

Value::Array& Value::as_array() {
  if (kind_ != Kind::kArray) *this = MakeArray();
  return *word_.a;
}

const Value::Object& Value::as_object() const {
  static const Object kEmpty;
  return kind_ == Kind::kObject ? *word_.o : kEmpty;
}

Value::Object& Value::as_object() {
  if (kind_ != Kind::kObject) *this = MakeObject();
  return *word_.o;
}

const Value* Value::Find(std::string_view key) const {
  if (kind_ != Kind::kObject) return nullptr;
  for (const auto& [k, v] : *word_.o) {
    if (k == key) return &v;
  }
  return nullptr;
}

Value& Value::Set(std::string key, Value v) {
  Object& obj = as_object();
  for (auto& [k, old] : obj) {
    if (k == key) return old = std::move(v);
  }
  obj.emplace_back(std::move(key), std::move(v));
  return obj.back().second;
}

Value& Value::Push(Value v) {
  Array& arr = as_array();
  arr.push_back(std::move(v));
  return arr.back();
}

}  // namespace emsa::json
