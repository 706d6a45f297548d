"""`python -m emsa`: the `emsa` command's plan and profile, through the C ABI (no binary needed).

Exit codes as the C++ CLI's: 0 ok, 2 usage or bad input, 3 the budget cannot be met, 1 other.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from ._capi import EmsaError, EmsaLibraryError
from .plan import InfeasibleBudgetError, make_plan, measure_profile
from .probe_record import ProbeRecord

STATE_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
                "bfloat16": torch.bfloat16}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m emsa")
    sub = parser.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="plan optimizer state for a probed model")
    plan.add_argument("probe", help="a probe record (JSON), from emsa.probe(...).save(path)")
    plan.add_argument("--budget", help="device memory the training may use, e.g. 24GiB")
    plan.add_argument("--profile", help="plan against this device profile (JSON)")
    plan.add_argument("--optimizer", default="adamw", choices=["adamw", "adam", "lion"])
    plan.add_argument("--state-dtype", default="fp32", choices=sorted(STATE_DTYPES))
    plan.add_argument("--no-host-tier", action="store_true", help="all state on the device")
    plan.add_argument("--all-host", action="store_true", help="all state on the host")
    plan.add_argument("--json", help="also write the plan as JSON here ('-': stdout, no table)")
    profile = sub.add_parser("profile", help="measure this machine, print the profile as JSON")
    profile.add_argument("--no-bandwidth", action="store_true", help="skip the timed parts")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "profile":
            print(json.dumps(measure_profile(not args.no_bandwidth), indent=2))
            return 0
        plan = make_plan(ProbeRecord.load(args.probe), args.profile, optimizer=args.optimizer,
                         state_dtype=STATE_DTYPES[args.state_dtype], budget=args.budget,
                         allow_host_tier=not args.no_host_tier, force_all_host=args.all_host)
    except InfeasibleBudgetError as e:
        print(f"emsa: {e}", file=sys.stderr)
        return 3
    except (EmsaError, ValueError, OSError) as e:
        print(f"emsa: {e}", file=sys.stderr)
        return 2
    except EmsaLibraryError as e:
        print(f"emsa: {e}", file=sys.stderr)
        return 1
    if args.json == "-":
        sys.stdout.write(plan.text)
        return 0
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(plan.text)
    print(plan)
    return 0


if __name__ == "__main__":
    sys.exit(main())
