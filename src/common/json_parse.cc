// json_parse.cc — json::Parse of src/common/json.h.
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "common/json.h"

namespace emsa::json {

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

}  // namespace

Result<Value> Parse(std::string_view text) { return Parser(text, nullptr).Document(); }

Result<Value> Parse(std::string_view text, const ElementSink& sink) {
  return Parser(text, &sink).Document();
}

}  // namespace emsa::json
