// status_test_support.h — checking an emsa::Status in GoogleTest: its code and a phrase of its
// message (what a user reads to know what to do).
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "emsa/status.h"

namespace emsa {

inline void ExpectError(const Status& s, StatusCode code, const std::string& needle) {
  EXPECT_EQ(s.code(), code) << s.ToString();
  EXPECT_NE(s.message().find(needle), std::string::npos)
      << "message \"" << s.message() << "\" lacks \"" << needle << "\"";
}

}  // namespace emsa
