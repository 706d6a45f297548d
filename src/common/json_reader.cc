// json_reader.cc — json::Reader of src/common/json.h: typed fields, errors naming their path.
#include <cmath>
#include <string>
#include <string_view>
#include <vector>

#include "common/json.h"

namespace emsa::json {

namespace {

const char* KindName(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kNull:
      return "null";
    case Value::Kind::kBool:
      return "a boolean";
    case Value::Kind::kNumber:
      return v.is_int() ? "an integer" : "a number";
    case Value::Kind::kString:
      return "a string";
    case Value::Kind::kArray:
      return "an array";
    case Value::Kind::kObject:
      return "an object";
  }
  return "?";
}

}  // namespace

std::string Reader::Child(std::string_view key) const {
  if (path_.empty()) return std::string(key);
  return path_ + "." + std::string(key);
}

Status Reader::Error(std::string_view key, std::string_view what) const {
  std::string where = key.empty() ? path_ : Child(key);
  return Status::ParseError(where + ": " + std::string(what));
}

bool Reader::Has(std::string_view key) const {
  const Value* f = v_->Find(key);
  return f != nullptr && !f->is_null();
}

Result<const Value*> Reader::Get(std::string_view key) const {
  if (!v_->is_object()) return Error("", std::string("expected an object, got ") + KindName(*v_));
  const Value* f = v_->Find(key);
  if (f == nullptr || f->is_null()) return Error(key, "required field is missing");
  return f;
}

namespace {

Status TypeError(const Reader& r, std::string_view key, const char* want, const Value& got) {
  return r.Error(key, std::string("expected ") + want + ", got " + KindName(got));
}

Result<int64_t> ToInt(const Reader& r, std::string_view key, const Value& v) {
  if (!v.is_int()) return TypeError(r, key, "an integer", v);
  return v.as_int();
}
Result<uint64_t> ToUInt(const Reader& r, std::string_view key, const Value& v) {
  if (!v.is_int() || v.as_int() < 0) return TypeError(r, key, "a non-negative integer", v);
  return static_cast<uint64_t>(v.as_int());
}
Result<double> ToNumber(const Reader& r, std::string_view key, const Value& v) {
  if (!v.is_number() || !std::isfinite(v.as_double())) {
    return TypeError(r, key, "a finite number", v);
  }
  return v.as_double();
}
Result<std::string> ToString(const Reader& r, std::string_view key, const Value& v) {
  if (!v.is_string()) return TypeError(r, key, "a string", v);
  return v.as_string();
}
Result<bool> ToBool(const Reader& r, std::string_view key, const Value& v) {
  if (!v.is_bool()) return TypeError(r, key, "a boolean", v);
  return v.as_bool();
}

}  // namespace

Result<std::string> Reader::String(std::string_view key) const {
  EMSA_ASSIGN_OR_RETURN(const Value* v, Get(key));
  return ToString(*this, key, *v);
}
Result<int64_t> Reader::Int(std::string_view key) const {
  EMSA_ASSIGN_OR_RETURN(const Value* v, Get(key));
  return ToInt(*this, key, *v);
}
Result<uint64_t> Reader::UInt(std::string_view key) const {
  EMSA_ASSIGN_OR_RETURN(const Value* v, Get(key));
  return ToUInt(*this, key, *v);
}
Result<double> Reader::Number(std::string_view key) const {
  EMSA_ASSIGN_OR_RETURN(const Value* v, Get(key));
  return ToNumber(*this, key, *v);
}
Result<bool> Reader::Bool(std::string_view key) const {
  EMSA_ASSIGN_OR_RETURN(const Value* v, Get(key));
  return ToBool(*this, key, *v);
}

Result<Reader> Reader::Object(std::string_view key) const {
  EMSA_ASSIGN_OR_RETURN(const Value* v, Get(key));
  if (!v->is_object()) return TypeError(*this, key, "an object", *v);
  return Reader(*v, Child(key));
}

Result<std::vector<Reader>> Reader::Array(std::string_view key) const {
  EMSA_ASSIGN_OR_RETURN(const Value* v, Get(key));
  if (!v->is_array()) return TypeError(*this, key, "an array", *v);
  std::vector<Reader> out;
  out.reserve(v->as_array().size());
  std::string base = Child(key);
  for (size_t i = 0; i < v->as_array().size(); ++i) {
    out.emplace_back(v->as_array()[i], base + "[" + std::to_string(i) + "]");
  }
  return out;
}

Result<std::string> Reader::String(std::string_view key, const std::string& def) const {
  if (!Has(key)) return def;
  return String(key);
}
Result<int64_t> Reader::Int(std::string_view key, int64_t def) const {
  if (!Has(key)) return def;
  return Int(key);
}
Result<uint64_t> Reader::UInt(std::string_view key, uint64_t def) const {
  if (!Has(key)) return def;
  return UInt(key);
}
Result<double> Reader::Number(std::string_view key, double def) const {
  if (!Has(key)) return def;
  return Number(key);
}
Result<bool> Reader::Bool(std::string_view key, bool def) const {
  if (!Has(key)) return def;
  return Bool(key);
}

Result<int64_t> Reader::AsInt() const { return ToInt(*this, "", *v_); }
Result<uint64_t> Reader::AsUInt() const { return ToUInt(*this, "", *v_); }
Result<double> Reader::AsNumber() const { return ToNumber(*this, "", *v_); }
Result<std::string> Reader::AsString() const { return ToString(*this, "", *v_); }

}  // namespace emsa::json
