"""Plans, device profiles and byte sizes.

    plan = emsa.make_plan(record, budget="20GiB")   # a ProbeRecord (emsa.probe) or its JSON
    print(plan)                                     # the table: where every byte lives
    plan.json["prediction"]                         # predicted step time and peak memory

Everything is decided by libemsa's C++ planner (emsa/plan.h); the objects here hold its
results. `emsa plan` (the command) answers the same questions without a GPU, for a model
known by its Hugging Face config.
"""

from __future__ import annotations

from ._native.planner import (InfeasibleBudgetError, Plan, infeasible_message, make_plan,
                              measure_profile, parse_bytes)

__all__ = ["Plan", "make_plan", "infeasible_message", "measure_profile", "parse_bytes",
           "InfeasibleBudgetError"]
