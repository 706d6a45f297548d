// Tests for src/common/json: parse, write, and the field reader's error paths.
#include "common/json.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace emsa::json {
namespace {

TEST(Json, ParsesAndWritesRoundTrip) {
  const std::string text =
      R"({"a": 1, "b": [1, 2.5, -3e-7], "c": {"d": "x\"y\n\u00e9"}, "e": true, "f": null})";
  auto v = Parse(text);
  ASSERT_TRUE(v.ok()) << v.status().ToString();
  EXPECT_EQ(v->Find("a")->as_int(), 1);
  EXPECT_TRUE(v->Find("a")->is_int());
  EXPECT_FALSE(v->Find("b")->as_array()[1].is_int());
  EXPECT_DOUBLE_EQ(v->Find("b")->as_array()[2].as_double(), -3e-7);
  EXPECT_EQ(v->Find("c")->Find("d")->as_string(), "x\"y\n\xc3\xa9");
  std::string once = Write(*v);
  auto again = Parse(once);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(Write(*again), once);
  EXPECT_EQ(Write(*again, -1), Write(*v, -1));
}

TEST(Json, DoublesReadBackExactly) {
  for (double d : {0.1, 1.0 / 3.0, 1e-300, 6.02214076e23, 123456789.125, 2.0}) {
    Value v(d);
    auto back = Parse(Write(v, -1));
    ASSERT_TRUE(back.ok());
    EXPECT_FALSE(back->is_int()) << Write(v, -1);
    EXPECT_EQ(back->as_double(), d);
  }
  auto big = Parse("9007199254740993");  // 2^53+1: exact only as an integer
  ASSERT_TRUE(big.ok());
  EXPECT_EQ(big->as_int(), 9007199254740993LL);
}

TEST(Json, ErrorsSayWhere) {
  for (const char* bad :
       {"", "{", "[1,]", "{\"a\" 1}", "{\"a\":1,\"a\":2}", "tru", "\"abc", "01", "1.", "-", "[1 2]",
        "{\"a\":1} x", "\"\\q\"", "1e999", "99999999999999999999", "\"\\ud800\""}) {
    auto v = Parse(bad);
    ASSERT_FALSE(v.ok()) << bad;
    EXPECT_EQ(v.status().code(), StatusCode::kParseError);
    EXPECT_NE(v.status().message().find("line 1, column"), std::string::npos)
        << v.status().message();
  }
  auto multi = Parse("{\n  \"a\": 1,\n  \"b\": ?\n}");
  ASSERT_FALSE(multi.ok());
  EXPECT_NE(multi.status().message().find("line 3, column 8"), std::string::npos)
      << multi.status().message();
}

TEST(Json, DeepNestingIsRefusedNotCrashing) {
  std::string deep(100000, '[');
  auto v = Parse(deep);
  ASSERT_FALSE(v.ok());
  EXPECT_NE(v.status().message().find("nesting"), std::string::npos);
}

TEST(Json, ReaderNamesTheField) {
  auto v = Parse(R"({"p": [{"shape": [2, "x"], "n": -1, "s": 3, "f": 1.5}]})");
  ASSERT_TRUE(v.ok());
  Reader root(*v, "probe");
  auto params = root.Array("p");
  ASSERT_TRUE(params.ok());
  const Reader& p0 = (*params)[0];
  auto shape = p0.Array("shape");
  ASSERT_TRUE(shape.ok());
  EXPECT_TRUE((*shape)[0].AsInt().ok());
  auto bad = (*shape)[1].AsInt();
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().message(), "probe.p[0].shape[1]: expected an integer, got a string");
  auto neg = p0.UInt("n");
  ASSERT_FALSE(neg.ok());
  EXPECT_EQ(neg.status().message(),
            "probe.p[0].n: expected a non-negative integer, got an integer");
  auto str = p0.String("s");
  ASSERT_FALSE(str.ok());
  EXPECT_EQ(str.status().message(), "probe.p[0].s: expected a string, got an integer");
  auto missing = p0.Number("missing");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().message(), "probe.p[0].missing: required field is missing");
  auto def = p0.Number("missing", 7.0);
  ASSERT_TRUE(def.ok());
  EXPECT_EQ(*def, 7.0);
  auto wrong_def = p0.String("f", "x");
  EXPECT_FALSE(wrong_def.ok());
  auto as_int = p0.Int("f");  // 1.5 is not an integer
  EXPECT_FALSE(as_int.ok());
  auto obj = root.Object("p");
  ASSERT_FALSE(obj.ok());
  EXPECT_EQ(obj.status().message(), "probe.p: expected an object, got an array");
}

TEST(Json, SetReplacesInPlaceAndKeepsOrder) {
  Value o = Value::MakeObject();
  o.Set("z", 1);
  o.Set("a", 2);
  o.Set("z", 3);
  EXPECT_EQ(Write(o, -1), R"({"z":3,"a":2})");
}

TEST(Json, FilesReportPaths) {
  auto r = ReadFile("/nonexistent/emsa/file.json");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kIoError);
  EXPECT_NE(r.status().message().find("/nonexistent/emsa/file.json"), std::string::npos);
}

TEST(Json, ASinkTakesTheRootArraysElementByElement) {
  const std::string text =
      R"({"a": [{"x": 1}, [2], 3], "b": [], "c": {"a": [4]}, "d": 5, "e": [6]})";
  std::vector<std::string> taken;
  ElementSink sink;
  sink.keys = {"a", "b", "d"};
  sink.take = [&](const std::string& key, size_t i, Value v) {
    taken.push_back(key + "[" + std::to_string(i) + "]=" + Write(v, -1));
  };
  Result<Value> doc = Parse(text, sink);
  ASSERT_TRUE(doc.ok()) << doc.status().ToString();
  EXPECT_EQ(taken, (std::vector<std::string>{"a[0]={\"x\":1}", "a[1]=[2]", "a[2]=3"}));
  // The document keeps an empty array where the elements were taken; a key not listed, a
  // nested "a" and a listed key that holds no array stay as they were.
  EXPECT_EQ(Write(*doc, -1), R"({"a":[],"b":[],"c":{"a":[4]},"d":5,"e":[6]})");

  // Syntax errors and repeated keys are still the parser's, wherever they are.
  EXPECT_TRUE(
      Parse(R"({"a": [1, 2], "a": []})", sink).status().message().find("duplicate key \"a\"") !=
      std::string::npos);
  taken.clear();
  const Status late = Parse(R"({"a": [1, 2], "d": tru})", sink).status();
  EXPECT_EQ(late.code(), StatusCode::kParseError);
  EXPECT_EQ(taken.size(), 2u) << "the elements before the error were handed over";
  taken.clear();
  ASSERT_TRUE(Parse(R"([{"a": [1]}])", sink).ok());
  EXPECT_TRUE(taken.empty()) << "only the root object's arrays are taken";
}

TEST(Json, AnObjectWriterWritesWhatWriteWrites) {
  Value element = Value::MakeObject();
  element.Set("name", "p\"0\"\n\x01");
  element.Set("shape", Value(Value::Array{Value(2), Value(3)}));
  element.Set("nested", Value(Value::Array{Value::MakeObject(), Value::MakeArray()}));
  element.Set("x", 0.1);
  Value whole = Value::MakeObject();
  whole.Set("format", "emsa.test");
  whole.Set("empty", Value::MakeArray());
  whole.Set("items", Value(Value::Array{element, element}));
  whole.Set("options", element);
  for (int indent : {-1, 0, 2, 4}) {
    std::string out;
    ObjectWriter w(&out, indent);
    w.Member("format", "emsa.test");
    w.BeginArray("empty");
    w.EndArray();
    w.BeginArray("items");
    w.Element(element);
    w.Element(element);
    w.EndArray();
    w.Member("options", element);
    w.Finish();
    EXPECT_EQ(out, Write(whole, indent)) << "indent " << indent;
  }
  std::string empty;
  ObjectWriter(&empty, 2).Finish();
  EXPECT_EQ(empty, Write(Value::MakeObject(), 2));
}

}  // namespace
}  // namespace emsa::json
