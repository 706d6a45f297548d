// json_write.cc — json::Write and json::ObjectWriter of src/common/json.h: emsa's layout (arrays
// of scalars on one line, objects one member a line), doubles in the fewest digits that read back.
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>

#include "common/json.h"

namespace emsa::json {

namespace {

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

}  // namespace

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

}  // namespace emsa::json
