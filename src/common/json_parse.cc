// json_parse.cc — json::Parse of src/common/json.h on nlohmann/json's parser.
//
// nlohmann's lexer and grammar read the text (RFC 8259: strings must be UTF-8, escapes and
// surrogate pairs are checked, numbers follow the grammar) and drive the SAX handler below, which
// builds json::Values and adds what emsa requires beyond the RFC: nesting and value-count limits,
// duplicate keys refused, integers that do not fit int64 refused rather than read as doubles,
// NUL bytes refused (nlohmann stops at one as if the text ended there), the root object's arrays
// handed to an ElementSink, and errors as "line L, column C: what". nlohmann reports errors to the
// handler, not by throwing; anything thrown anyway (bad_alloc, an ElementSink) is caught here.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <iterator>
#include <limits>
#include <new>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/json.h"

// Describe() reads the wording of nlohmann's messages, checked against 3.11.
static_assert(NLOHMANN_JSON_VERSION_MAJOR == 3 && NLOHMANN_JSON_VERSION_MINOR >= 11,
              "emsa's JSON parser is written against nlohmann/json 3.11");

namespace emsa::json {

namespace {

using Nlohmann = nlohmann::json;  // for its SAX interface and types; no nlohmann DOM is built

// The text as nlohmann's lexer reads it, one char at a time, leaving in a shared slot how far
// it has read: SAX events carry no position, and a duplicate key or a limit is refused where it
// is found. The lexer reads one char past a number; everything else ends where its token ends.
class TrackedChars {
 public:
  using iterator_category = std::input_iterator_tag;
  using value_type = char;
  using difference_type = std::ptrdiff_t;
  using pointer = const char*;
  using reference = const char&;

  explicit TrackedChars(const char** at) : at_(at) {}
  reference operator*() const { return **at_; }
  TrackedChars& operator++() {
    ++*at_;
    return *this;
  }
  bool operator==(const TrackedChars& other) const { return *at_ == *other.at_; }
  bool operator!=(const TrackedChars& other) const { return *at_ != *other.at_; }

 private:
  const char** at_;
};

// Bytes outside printable ASCII as \xNN, so that a message stays one line of ASCII; a long token
// keeps its end, where the lexer stopped.
std::string Printable(std::string_view s) {
  constexpr size_t kMost = 40;
  std::string out = s.size() > kMost ? "..." : "";
  for (char c : s.substr(s.size() > kMost ? s.size() - kMost : 0)) {
    const auto u = static_cast<unsigned char>(c);
    if (u >= 0x20 && u < 0x7f) {
      out.push_back(c);
    } else {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", u);
      out += buf;
    }
  }
  return out;
}

// nlohmann's message, "[json.exception.parse_error.101] parse error at line 1, column 4: syntax
// error while parsing CONTEXT - DETAIL", in emsa's words: what was expected where, and what came
// instead. A token the lexer could not read (a bad string, number or literal) is described by
// the lexer's own words. Should a later nlohmann word its messages otherwise, its text is kept.
std::string Describe(const nlohmann::detail::exception& e, const std::string& last_token) {
  if (e.id == 406) return "number out of range: " + Printable(last_token);  // 1e999
  const std::string what = e.what();
  constexpr std::string_view kSyntax = "syntax error while parsing ";
  const size_t syntax = what.find(kSyntax);
  const size_t dash = what.find(" - ", syntax);
  if (syntax == std::string::npos || dash == std::string::npos) {
    const size_t tag = what.find("] ");  // "[json.exception.NAME.ID] "
    return tag == std::string::npos ? what : what.substr(tag + 2);
  }
  const std::string context = what.substr(syntax + kSyntax.size(), dash - syntax - kSyntax.size());
  const std::string detail = what.substr(dash + 3);
  constexpr std::string_view kEndExpected = "; expected end of input";
  if (detail.size() >= kEndExpected.size() &&
      detail.compare(detail.size() - kEndExpected.size(), kEndExpected.size(), kEndExpected) == 0) {
    return "unexpected text after the JSON value";
  }
  constexpr std::string_view kUnexpected = "unexpected ";
  if (detail.compare(0, kUnexpected.size(), kUnexpected) != 0) {  // the lexer's words
    return detail.substr(0, detail.find("; last read: ")) + "; last read: '" +
           Printable(last_token) + "'";
  }
  const std::string got =
      detail.substr(kUnexpected.size(), detail.find("; expected") - kUnexpected.size());
  if (context == "object key") return "expected a quoted key, got " + got;
  if (context == "object separator") return "expected ':' after key, got " + got;
  if (context == "object") return "expected ',' or '}' in object, got " + got;
  if (context == "array") return "expected ',' or ']' in array, got " + got;
  return "expected a value, got " + got;
}

// Builds the document from nlohmann's SAX events (the interface nlohmann::json::sax_parse
// requires: each returns false to stop the parse).
class Builder {
 public:
  // `text` is the whole text, `limit` where the parse ends (a NUL byte, or the end), `read_to`
  // the slot TrackedChars advances.
  Builder(std::string_view text, size_t limit, const char* const* read_to, const ElementSink* sink)
      : text_(text), limit_(limit), read_to_(read_to), sink_(sink) {}

  bool null() { return Add(Value()); }
  bool boolean(bool b) { return Add(Value(b)); }
  bool number_integer(int64_t v) { return Add(Value(v)); }
  bool number_unsigned(uint64_t v) {
    if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return Refuse(NumberStart(std::to_string(v)), "integer out of range: " + std::to_string(v));
    }
    return Add(Value(static_cast<int64_t>(v)));
  }
  // nlohmann reads an integer too large for 64 bits as a double; emsa's integers are counts and
  // sizes, where a rounded one would be wrong without a word.
  bool number_float(double d, const std::string& text) {
    if (text.find_first_of(".eE") == std::string::npos) {
      return Refuse(NumberStart(text), "integer out of range: " + text);
    }
    return Add(Value(d));
  }
  bool string(std::string& s) { return Add(Value(std::move(s))); }
  bool binary(Nlohmann::binary_t&) { return false; }  // only binary formats (CBOR...) have these
  bool start_object(size_t) { return Open(false); }
  bool key(std::string& k) {
    Frame& f = frames_.back();
    streams_next_ = frames_.size() == 1 && sink_ != nullptr &&
                    std::find(sink_->keys.begin(), sink_->keys.end(), k) != sink_->keys.end();
    key_ends_.push_back(ReadTo());
    f.value.as_object().emplace_back(std::move(k), Value());
    return true;
  }
  bool end_object() { return Close(); }
  bool start_array(size_t) { return Open(true); }
  bool end_array() { return Close(); }
  bool parse_error(size_t position, const std::string& last_token,
                   const nlohmann::detail::exception& e) {
    // `position` counts what the lexer read, the end of input included: the culprit is the last.
    const size_t at = std::min(position > 0 ? position - 1 : 0, limit_);
    if (at >= limit_ && limit_ < text_.size()) return Refuse(limit_, "unexpected NUL byte");
    const size_t number_at = position >= last_token.size() ? position - last_token.size() : 0;
    return Refuse(e.id == 406 ? number_at : at, Describe(e, last_token));
  }

  // After the parse: its error, or the document.
  Result<Value> Finish(bool parsed) {
    if (!error_.ok()) return error_;
    if (!parsed || !frames_.empty()) return Status::Internal("JSON parse stopped without error");
    if (limit_ < text_.size()) {
      Refuse(limit_, "unexpected NUL byte");
      return error_;
    }
    return std::move(root_);
  }

 private:
  struct Frame {
    Value value;                            // the open object or array
    const std::string* streamed = nullptr;  // the root's key whose elements go to the sink
    size_t index = 0;                       // elements handed to the sink so far
    size_t first_key = 0;                   // an object's: its first key in key_ends_
  };

  size_t ReadTo() const { return static_cast<size_t>(*read_to_ - text_.data()); }

  // Where the number `token` just read starts: the lexer has read one char past it, unless the
  // text ended. A token of digits cannot be confused with its following char, which is none.
  size_t NumberStart(const std::string& token) const {
    const size_t end = ReadTo();
    if (end >= token.size() && text_.substr(end - token.size(), token.size()) == token) {
      return end - token.size();
    }
    return end > token.size() ? end - token.size() - 1 : 0;
  }

  bool Refuse(size_t at, const std::string& what) {
    size_t line = 1, line_start = 0;
    for (size_t i = 0; i < at && i < text_.size(); ++i) {
      if (text_[i] == '\n') {
        ++line;
        line_start = i + 1;
      }
    }
    error_ = Status::ParseError("line " + std::to_string(line) + ", column " +
                                std::to_string(at - line_start + 1) + ": " + what);
    return false;
  }

  // Every value, containers included, counts against the limits; a refusal names the last char
  // the lexer read (a container's bracket, a scalar's end).
  bool Count() {
    if (frames_.size() > static_cast<size_t>(kMaxDepth)) {
      return Refuse(ReadTo() - 1, "nesting deeper than " + std::to_string(kMaxDepth) + " levels");
    }
    if (++values_ > kMaxValues) {
      return Refuse(ReadTo() - 1,
                    "more than " + std::to_string(kMaxValues) + " values in one document");
    }
    return true;
  }

  bool Add(Value v) {
    streams_next_ = false;
    if (!Count()) return false;
    Place(std::move(v));
    return true;
  }

  bool Open(bool is_array) {
    const bool streamed = streams_next_ && is_array;
    streams_next_ = false;
    if (!Count()) return false;
    const std::string* key = streamed ? &frames_.back().value.as_object().back().first : nullptr;
    frames_.push_back(
        {is_array ? Value::MakeArray() : Value::MakeObject(), key, 0, key_ends_.size()});
    return true;
  }

  bool Close() {
    Frame f = std::move(frames_.back());
    frames_.pop_back();
    if (f.value.is_object()) {
      if (!UniqueKeys(f)) return false;
      key_ends_.resize(f.first_key);
    }
    Place(std::move(f.value));
    return true;
  }

  // A complete value into the open container, to the sink, or as the document.
  void Place(Value v) {
    if (frames_.empty()) {
      root_ = std::move(v);
      return;
    }
    Frame& parent = frames_.back();
    if (parent.streamed != nullptr) {
      sink_->take(*parent.streamed, parent.index++, std::move(v));
    } else if (parent.value.is_array()) {
      parent.value.as_array().push_back(std::move(v));
    } else {
      parent.value.as_object().back().second = std::move(v);
    }
  }

  // The error names the first key in the text that repeats an earlier one, at its opening
  // quote. Small objects compare each pair; larger ones sort, n log n.
  bool UniqueKeys(const Frame& f) {
    const Value::Object& obj = f.value.as_object();
    const size_t n = obj.size();
    size_t repeat = n;
    if (n <= 16) {
      for (size_t i = 1; i < n && repeat == n; ++i) {
        for (size_t j = 0; j < i; ++j) {
          if (obj[i].first == obj[j].first) {
            repeat = i;
            break;
          }
        }
      }
    } else {
      order_.resize(n);
      for (size_t i = 0; i < n; ++i) order_[i] = static_cast<uint32_t>(i);
      std::sort(order_.begin(), order_.end(), [&](uint32_t a, uint32_t b) {
        return obj[a].first != obj[b].first ? obj[a].first < obj[b].first : a < b;
      });
      for (size_t i = 1; i < n; ++i) {
        if (obj[order_[i]].first == obj[order_[i - 1]].first) {
          repeat = std::min<size_t>(repeat, order_[i]);
        }
      }
    }
    if (repeat == n) return true;
    return Refuse(KeyStart(key_ends_[f.first_key + repeat]),
                  "duplicate key \"" + obj[repeat].first + "\"");
  }

  // The opening quote of the key whose closing quote ends at `end`: the nearest quote before it
  // that no backslash escapes (an odd run of backslashes escapes a quote).
  size_t KeyStart(size_t end) const {
    for (size_t q = end - 1; q-- > 0;) {
      if (text_[q] != '"') continue;
      size_t slashes = 0;
      while (q > slashes && text_[q - slashes - 1] == '\\') ++slashes;
      if (slashes % 2 == 0) return q;
    }
    return 0;
  }

  std::string_view text_;
  size_t limit_;
  const char* const* read_to_;
  const ElementSink* sink_;
  std::vector<Frame> frames_;
  std::vector<size_t> key_ends_;  // where each key of the open objects ends, in order
  std::vector<uint32_t> order_;   // UniqueKeys' scratch
  Value root_;
  size_t values_ = 0;
  bool streams_next_ = false;  // the key just read is the root's and one of the sink's
  Status error_;
};

Result<Value> ParseText(std::string_view text, const ElementSink* sink) {
  try {
    const size_t limit = std::min(text.find('\0'), text.size());
    const char* at = text.data();
    const char* end = text.data() + limit;
    Builder builder(text, limit, &at, sink);
    const bool parsed = Nlohmann::sax_parse(TrackedChars(&at), TrackedChars(&end), &builder);
    return builder.Finish(parsed);
  } catch (const std::bad_alloc&) {
    return Status::OutOfMemory("out of memory while parsing JSON text of " +
                               std::to_string(text.size()) + " bytes");
  } catch (const std::exception& e) {
    return Status::Internal(std::string("while parsing JSON: ") + e.what());
  } catch (...) {
    return Status::Internal("while parsing JSON: an unknown exception");
  }
}

}  // namespace

Result<Value> Parse(std::string_view text) { return ParseText(text, nullptr); }

Result<Value> Parse(std::string_view text, const ElementSink& sink) {
  return ParseText(text, &sink);
}

}  // namespace emsa::json
