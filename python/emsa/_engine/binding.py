"""Planning an optimizer and binding its engine: from the param groups (and a probe record, or
the first backward's order) to a plan, the engine that runs it, and opt.state's entries.

bind() is run once per optimizer: at construction with probe= or step_in_backward, else at the
first step(). It picks the engine by the parameters' device, plans under the optimizer's
options, has the replicas compare their plans (torch.distributed), and lays the state out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .._distributed.dtensor import Shards, forward_waits
from .._distributed.groups import DistributedSetup
from .._native.host_arena import host_memory
from .._native.planner import Plan, make_plan, quick_profile_json
from .._native import tuning
from ..probe_record import ProbeRecord
from . import records
from .engine import Engine
from .options import EmsaOptions
from .params import PlannedParams, frozen_of, slots_of
from .setup_times import SetupTimes

__all__ = ["Binding", "bind", "engine_class"]


@dataclass
class Binding:
    """What planning made, owned by the optimizer from then on."""

    plan: Plan
    record: ProbeRecord  # the record planned (entries the optimizer does not hold: frozen)
    engine: Engine
    planned: PlannedParams
    shards: Shards  # DTensor parameters: the engine binds their local shards
    releases_grads: bool  # what the plan assumed: gradients freed during backward
    host_memory: dict[str, Any]  # the host memory the engine's arenas hold (for the report)


def engine_class(device: torch.device) -> type[Engine]:
    if device.type == "cpu":
        from .cpu import CpuEngine

        return CpuEngine
    if device.type == "cuda":
        from .cuda import CudaEngine

        return CudaEngine
    raise NotImplementedError(f"emsa: parameters on {device} are not supported; emsa runs on "
                              "the CPU and on CUDA devices")


def _planning_profile(device: torch.device, may_offload: bool) -> str:
    if device.type == "cuda":
        from .cuda import planning_profile

        return planning_profile(device, may_offload)
    return quick_profile_json()  # CPU: bandwidths decide nothing, both tiers are host memory


def bind(param_groups: list[dict], *, kind: str, options: EmsaOptions,
         record: ProbeRecord | None, recorder: records.FirstBackwardRecorder | None,
         dist: DistributedSetup, setup: SetupTimes, gated_in_backward: bool,
         releases_grads: bool) -> Binding:
    """Plans the parameters of param_groups and builds their engine (module docstring)."""
    slots = slots_of(param_groups)
    if not slots:
        raise ValueError("the optimizer holds no parameters that require a gradient"
                         if any(g["params"] for g in param_groups)
                         else "the optimizer holds no parameters")
    frozen = frozen_of(param_groups)
    device = slots[0].param.device
    cls = engine_class(device)
    if record is None:
        planned_record = records.unprobed_record(slots, recorder, frozen)
        for i, s in enumerate(slots):
            s.record_index = i
    else:
        planned_record = records.match(slots, record)
    profile = options.profile_text
    if profile is None and planned_record.profile is None:
        # Bandwidths decide what leaves the device and predict the step: measured when the
        # plan may use the host tier for a reason (a budget, or tier="host").
        may_offload = options.tier == "host" or (options.tier is None
                                                 and options.budget_bytes is not None)
        with setup.profile_phase():
            profile = _planning_profile(device, may_offload)
    with setup.timed("plan"):
        plan = make_plan(planned_record, profile, optimizer=kind,
                         state_dtype=options.state_dtype, budget=options.budget_bytes,
                         allow_host_tier=options.tier != "device",
                         force_all_host=options.tier == "host", release_grads=releases_grads,
                         device_update_share=tuning.host_device_share(),
                         gated_steps=gated_in_backward)
    plan = dist.agreed_plan(plan)  # replicas compare layouts: one collective
    shards = Shards(slots)
    planned = PlannedParams(slots, shards.engine_slots, frozen,
                            [len(g["params"]) for g in param_groups])
    engine = cls(planned, plan, kind, options.state_dtype, len(param_groups),
                 in_backward=options.step_in_backward, norm_group=dist.norm_group,
                 setup_times=setup.times)
    forward_waits(engine, shards)
    return Binding(plan=plan, record=planned_record, engine=engine, planned=planned,
                   shards=shards, releases_grads=releases_grads,
                   host_memory=host_memory(engine.host_arenas()))
