// plan/plan_json.h — PlanToJson's text in pieces, for a caller that keeps it somewhere other
// than a std::string (the C ABI's malloc'd string), so that the text is never held twice.
// Internal: not part of the public API.
#pragma once

#include <functional>
#include <string_view>

#include "emsa/plan.h"

namespace emsa {

// Calls `emit` with consecutive pieces of PlanToJson(plan) (each up to about a mebibyte, and
// always whole elements); together they are exactly that text.
void WritePlanJson(const Plan& plan, const std::function<void(std::string_view)>& emit);

}  // namespace emsa
