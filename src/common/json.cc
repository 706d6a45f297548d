// json.cc — parser, writer and field reader for src/common/json.h.
#include "common/json.h"

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace emsa::json {

// ---- Parser
// --------------------------------------------------------------------------------------

namespace {

class Parser {
 public:
  Parser(std::string_view text, const ElementSink* sink) : s_(text), sink_(sink) {}

  Result<Value> Document() {
    Value v;
    EMSA_RETURN_IF_ERROR(ParseValue(&v, 0));
    SkipSpace();
    if (pos_ != s_.size()) return Fail("unexpected text after the JSON value");
    return v;
  }

 private:
  Status Fail(const std::string& what) const {
    size_t line = 1, col = 1;
    for (size_t i = 0; i < pos_ && i < s_.size(); ++i) {
      if (s_[i] == '\n') {
        ++line;
        col = 1;
      } else {
        ++col;
      }
    }
    return Status::ParseError("line " + std::to_string(line) + ", column " + std::to_string(col) +
                              ": " + what);
  }

  static std::string Printable(char c) {
    const auto u = static_cast<unsigned char>(c);
    if (u >= 0x20 && u < 0x7f) return std::string("'") + c + "'";
    char buf[8];
    std::snprintf(buf, sizeof buf, "0x%02x", u);
    return buf;
  }

  void SkipSpace() {
    while (pos_ < s_.size() &&
           (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r')) {
      ++pos_;
    }
  }

  bool Consume(std::string_view word) {
    if (s_.substr(pos_, word.size()) == word) {
      pos_ += word.size();
      return true;
    }
    return false;
  }

  // `streamed`: the root object's key when this value's array elements go to the sink.
  Status ParseValue(Value* out, int depth, const std::string* streamed = nullptr) {
    if (depth > kMaxDepth) {
      return Fail("nesting deeper than " + std::to_string(kMaxDepth) + " levels");
    }
    if (++values_ > kMaxValues) {
      return Fail("more than " + std::to_string(kMaxValues) + " values in one document");
    }
    SkipSpace();
    if (pos_ >= s_.size()) return Fail("unexpected end of input, expected a value");
    char c = s_[pos_];
    if (c == '{') return ParseObject(out, depth);
    if (c == '[') return ParseArray(out, depth, streamed);
    if (c == '"') {
      std::string str;
      EMSA_RETURN_IF_ERROR(ParseString(&str));
      *out = Value(std::move(str));
      return Status::Ok();
    }
    if (c == '-' || (c >= '0' && c <= '9')) return ParseNumber(out);
    if (Consume("true")) {
      *out = Value(true);
      return Status::Ok();
    }
    if (Consume("false")) {
      *out = Value(false);
      return Status::Ok();
    }
    if (Consume("null")) {
      *out = Value();
      return Status::Ok();
    }
    return Fail("unexpected character " + Printable(c));
  }

  Status ParseObject(Value* out, int depth) {
    ++pos_;  // '{'
    Value obj = Value::MakeObject();
    SkipSpace();
    if (pos_ < s_.size() && s_[pos_] == '}') {
      ++pos_;
      *out = std::move(obj);
      return Status::Ok();
    }
    std::vector<size_t> key_at;  // where each key starts, for the duplicate check at the end
    while (true) {
      SkipSpace();
      if (pos_ >= s_.size() || s_[pos_] != '"') return Fail("expected a quoted key");
      key_at.push_back(pos_);
      std::string key;
      EMSA_RETURN_IF_ERROR(ParseString(&key));
      SkipSpace();
      if (pos_ >= s_.size() || s_[pos_] != ':') return Fail("expected ':' after key");
      ++pos_;
      Value v;
      EMSA_RETURN_IF_ERROR(ParseValue(&v, depth + 1, depth == 0 && Streams(key) ? &key : nullptr));
      obj.as_object().emplace_back(std::move(key), std::move(v));
      SkipSpace();
      if (pos_ < s_.size() && s_[pos_] == ',') {
        ++pos_;
        continue;
      }
      if (pos_ < s_.size() && s_[pos_] == '}') {
        ++pos_;
        break;
      }
      return Fail("expected ',' or '}' in object");
    }
    EMSA_RETURN_IF_ERROR(CheckUniqueKeys(obj.as_object(), key_at));
    *out = std::move(obj);
    return Status::Ok();
  }

  // Sorting the keys finds duplicates in n log n; the error names the first repeated key in the
  // text, at its position.
  Status CheckUniqueKeys(const Value::Object& obj, const std::vector<size_t>& key_at) {
    if (obj.size() < 2) return Status::Ok();
    std::vector<uint32_t> idx(obj.size());
    for (size_t i = 0; i < idx.size(); ++i) idx[i] = static_cast<uint32_t>(i);
    std::sort(idx.begin(), idx.end(), [&](uint32_t a, uint32_t b) {
      return obj[a].first != obj[b].first ? obj[a].first < obj[b].first : a < b;
    });
    size_t repeat = obj.size();
    for (size_t i = 1; i < idx.size(); ++i) {
      if (obj[idx[i]].first == obj[idx[i - 1]].first) repeat = std::min<size_t>(repeat, idx[i]);
    }
    if (repeat == obj.size()) return Status::Ok();
    pos_ = key_at[repeat];
    return Fail("duplicate key \"" + obj[repeat].first + "\"");
  }

  bool Streams(const std::string& key) const {
    return sink_ != nullptr &&
           std::find(sink_->keys.begin(), sink_->keys.end(), key) != sink_->keys.end();
  }

  Status ParseArray(Value* out, int depth, const std::string* streamed) {
    ++pos_;  // '['
    Value arr = Value::MakeArray();
    SkipSpace();
    if (pos_ < s_.size() && s_[pos_] == ']') {
      ++pos_;
      *out = std::move(arr);
      return Status::Ok();
    }
    for (size_t index = 0;; ++index) {
      Value v;
      EMSA_RETURN_IF_ERROR(ParseValue(&v, depth + 1));
      if (streamed != nullptr) {
        sink_->take(*streamed, index, std::move(v));
      } else {
        arr.as_array().push_back(std::move(v));
      }
      SkipSpace();
      if (pos_ < s_.size() && s_[pos_] == ',') {
        ++pos_;
        continue;
      }
      if (pos_ < s_.size() && s_[pos_] == ']') {
        ++pos_;
        break;
      }
      return Fail("expected ',' or ']' in array");
    }
    *out = std::move(arr);
    return Status::Ok();
  }

  static void AppendUtf8(uint32_t cp, std::string* out) {
    if (cp < 0x80) {
      out->push_back(static_cast<char>(cp));
    } else if (cp < 0x800) {
      out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else if (cp < 0x10000) {
      out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else {
      out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
  }

  Status ParseHex4(uint32_t* cp) {
    if (pos_ + 4 > s_.size()) return Fail("truncated \\u escape");
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) {
      char h = s_[pos_++];
      v <<= 4;
      if (h >= '0' && h <= '9')
        v |= static_cast<uint32_t>(h - '0');
      else if (h >= 'a' && h <= 'f')
        v |= static_cast<uint32_t>(h - 'a' + 10);
      else if (h >= 'A' && h <= 'F')
        v |= static_cast<uint32_t>(h - 'A' + 10);
      else
        return Fail("bad hex digit in \\u escape");
    }
    *cp = v;
    return Status::Ok();
  }

  Status ParseString(std::string* out) {
    ++pos_;  // opening quote
    out->clear();
    while (true) {
      if (pos_ >= s_.size()) return Fail("unterminated string");
      char c = s_[pos_++];
      if (c == '"') return Status::Ok();
      if (static_cast<unsigned char>(c) < 0x20) return Fail("control character in string");
      if (c != '\\') {
        out->push_back(c);
        continue;
      }
      if (pos_ >= s_.size()) return Fail("unterminated escape");
      char e = s_[pos_++];
      switch (e) {
        case '"':
          out->push_back('"');
          break;
        case '\\':
          out->push_back('\\');
          break;
        case '/':
          out->push_back('/');
          break;
        case 'b':
          out->push_back('\b');
          break;
        case 'f':
          out->push_back('\f');
          break;
        case 'n':
          out->push_back('\n');
          break;
        case 'r':
          out->push_back('\r');
          break;
        case 't':
          out->push_back('\t');
          break;
        case 'u': {
          uint32_t cp = 0;
          EMSA_RETURN_IF_ERROR(ParseHex4(&cp));
          if (cp >= 0xD800 && cp <= 0xDBFF) {
            if (!Consume("\\u")) return Fail("lone high surrogate in \\u escape");
            uint32_t lo = 0;
            EMSA_RETURN_IF_ERROR(ParseHex4(&lo));
            if (lo < 0xDC00 || lo > 0xDFFF) return Fail("bad low surrogate in \\u escape");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
            return Fail("lone low surrogate in \\u escape");
          }
          AppendUtf8(cp, out);
          break;
        }
        default:
          return Fail(std::string("unknown escape '\\") + e + "'");
      }
    }
  }

  Status ParseNumber(Value* out) {
    size_t start = pos_;
    bool is_int = true;
    if (s_[pos_] == '-') ++pos_;
    if (pos_ >= s_.size() || !(s_[pos_] >= '0' && s_[pos_] <= '9')) return Fail("bad number");
    if (s_[pos_] == '0') {
      ++pos_;
    } else {
      while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') ++pos_;
    }
    if (pos_ < s_.size() && s_[pos_] == '.') {
      is_int = false;
      ++pos_;
      if (pos_ >= s_.size() || !(s_[pos_] >= '0' && s_[pos_] <= '9')) return Fail("bad fraction");
      while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') ++pos_;
    }
    if (pos_ < s_.size() && (s_[pos_] == 'e' || s_[pos_] == 'E')) {
      is_int = false;
      ++pos_;
      if (pos_ < s_.size() && (s_[pos_] == '+' || s_[pos_] == '-')) ++pos_;
      if (pos_ >= s_.size() || !(s_[pos_] >= '0' && s_[pos_] <= '9')) return Fail("bad exponent");
      while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') ++pos_;
    }
    std::string text(s_.substr(start, pos_ - start));
    if (is_int) {
      errno = 0;
      long long v = std::strtoll(text.c_str(), nullptr, 10);
      if (errno == ERANGE) return Fail("integer out of range: " + text);
      *out = Value(static_cast<int64_t>(v));
      return Status::Ok();
    }
    double d = std::strtod(text.c_str(), nullptr);
    if (!std::isfinite(d)) return Fail("number out of range: " + text);
    *out = Value(d);
    return Status::Ok();
  }

  std::string_view s_;
  const ElementSink* sink_;
  size_t pos_ = 0;
  size_t values_ = 0;
};

// ---- Writer
// --------------------------------------------------------------------------------------

bool NeedsEscape(unsigned char c) { return c < 0x20 || c == '"' || c == '\\'; }

// Runs of plain characters are appended whole; only the characters JSON escapes go one by one.
void WriteString(std::string_view s, std::string* out) {
  out->push_back('"');
  for (size_t i = 0; i < s.size();) {
    size_t plain = i;
    while (plain < s.size() && !NeedsEscape(static_cast<unsigned char>(s[plain]))) ++plain;
    out->append(s.data() + i, plain - i);
    if (plain == s.size()) break;
    const auto c = static_cast<unsigned char>(s[plain]);
    i = plain + 1;
    switch (c) {
      case '"':
        *out += "\\\"";
        break;
      case '\\':
        *out += "\\\\";
        break;
      case '\n':
        *out += "\\n";
        break;
      case '\r':
        *out += "\\r";
        break;
      case '\t':
        *out += "\\t";
        break;
      default: {  // the other control characters
        char buf[8];
        std::snprintf(buf, sizeof buf, "\\u%04x", c);
        *out += buf;
      }
    }
  }
  out->push_back('"');
}

// Shortest text that reads back to the same double: try 15, 16, then 17 significant digits,
// each as printf's "%.*g" writes it (std::to_chars with chars_format::general is that, without
// the locale).
void WriteDouble(double d, std::string* out) {
  if (!std::isfinite(d)) {  // JSON has no inf/nan; writers upstream must not produce them
    *out += "null";
    return;
  }
  char buf[32];
  std::string_view text;
  for (int precision = 15; precision <= 17; ++precision) {
    const std::to_chars_result r =
        std::to_chars(buf, buf + sizeof buf, d, std::chars_format::general, precision);
    const size_t length = static_cast<size_t>(r.ptr - buf);
    text = std::string_view(buf, length);
    // strtod, not from_chars: libc++ before 17 has no floating-point from_chars. The text is
    // to_chars' (no locale), and emsa never changes LC_NUMERIC.
    char terminated[sizeof buf + 1];
    std::memcpy(terminated, buf, length);
    terminated[length] = '\0';
    if (std::strtod(terminated, nullptr) == d) break;
  }
  *out += text;
  // Keep doubles recognisable as non-integers so they read back as doubles.
  if (text.find_first_of(".eEn") == std::string_view::npos) *out += ".0";
}

void Newline(int indent, int level, std::string* out) {
  if (indent < 0) return;
  out->push_back('\n');
  out->append(static_cast<size_t>(indent * level), ' ');
}

void WriteValue(const Value& v, int indent, int level, std::string* out) {
  auto newline = [&](int lvl) { Newline(indent, lvl, out); };
  switch (v.kind()) {
    case Value::Kind::kNull:
      *out += "null";
      break;
    case Value::Kind::kBool:
      *out += v.as_bool() ? "true" : "false";
      break;
    case Value::Kind::kNumber:
      if (v.is_int())
        *out += std::to_string(v.as_int());
      else
        WriteDouble(v.as_double(), out);
      break;
    case Value::Kind::kString:
      WriteString(v.as_string(), out);
      break;
    case Value::Kind::kArray: {
      const auto& a = v.as_array();
      if (a.empty()) {
        *out += "[]";
        break;
      }
      // Arrays of scalars stay on one line: shapes and offsets read better that way.
      bool flat = true;
      for (const auto& e : a) flat = flat && !e.is_array() && !e.is_object();
      out->push_back('[');
      for (size_t i = 0; i < a.size(); ++i) {
        if (i) out->push_back(',');
        if (flat) {
          if (i && indent >= 0) out->push_back(' ');
        } else {
          newline(level + 1);
        }
        WriteValue(a[i], indent, level + 1, out);
      }
      if (!flat) newline(level);
      out->push_back(']');
      break;
    }
    case Value::Kind::kObject: {
      const auto& o = v.as_object();
      if (o.empty()) {
        *out += "{}";
        break;
      }
      out->push_back('{');
      for (size_t i = 0; i < o.size(); ++i) {
        if (i) out->push_back(',');
        newline(level + 1);
        WriteString(o[i].first, out);
        *out += indent >= 0 ? ": " : ":";
        WriteValue(o[i].second, indent, level + 1, out);
      }
      newline(level);
      out->push_back('}');
      break;
    }
  }
}

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

Result<Value> Parse(std::string_view text) { return Parser(text, nullptr).Document(); }

Result<Value> Parse(std::string_view text, const ElementSink& sink) {
  return Parser(text, &sink).Document();
}

ObjectWriter::ObjectWriter(std::string* out, int indent) : out_(out), indent_(indent) {
  out_->push_back('{');
}

void ObjectWriter::Key(std::string_view key) {
  if (members_++ > 0) out_->push_back(',');
  Newline(indent_, 1, out_);
  WriteString(key, out_);
  *out_ += indent_ >= 0 ? ": " : ":";
}

void ObjectWriter::Member(std::string_view key, const Value& value) {
  Key(key);
  WriteValue(value, indent_, 1, out_);
}

void ObjectWriter::BeginArray(std::string_view key) {
  Key(key);
  out_->push_back('[');
  elements_ = 0;
}

void ObjectWriter::Element(const Value& element) {
  if (elements_++ > 0) out_->push_back(',');
  Newline(indent_, 2, out_);
  WriteValue(element, indent_, 2, out_);
}

void ObjectWriter::EndArray() {
  if (elements_ > 0) Newline(indent_, 1, out_);
  out_->push_back(']');
}

void ObjectWriter::Finish() {
  if (members_ > 0) Newline(indent_, 0, out_);
  out_->push_back('}');
  if (indent_ >= 0) out_->push_back('\n');
}

std::string Write(const Value& value, int indent) {
  std::string out;
  WriteValue(value, indent, 0, &out);
  if (indent >= 0) out.push_back('\n');
  return out;
}

// ---- Reader
// --------------------------------------------------------------------------------------

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
