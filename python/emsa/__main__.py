"""`python -m emsa`: the `emsa` command's plan and profile, through the C ABI (no binary needed).

Exit codes as the C++ CLI's: 0 ok, 2 usage or bad input, 3 the budget cannot be met, 1 other.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from . import _files
from ._capi import EmsaError, EmsaLibraryError
from ._model import (device_preset, format_bytes, matmul_flops_of, model_options, model_probe,
                     plan_summary)
from .plan import InfeasibleBudgetError, infeasible_message, make_plan, measure_profile

STATE_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
                "bfloat16": torch.bfloat16}
PARAM_DTYPES = ["fp32", "float32", "bf16", "bfloat16", "fp16", "float16"]
DEFAULT_DEVICE = "h200"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m emsa")
    sub = parser.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="plan optimizer state for a probed model, or a model "
                                       "known by its config (--model)")
    plan.add_argument("probe", nargs="?",
                      help="a probe record (JSON), from emsa.probe(...).save(path)")
    plan.add_argument("--budget", help="device memory the training may use, e.g. 24GiB")
    plan.add_argument("--profile", help="plan against this device profile (JSON)")
    plan.add_argument("--optimizer", default="adamw", choices=["adamw", "adam", "lion"])
    plan.add_argument("--state-dtype", default="fp32", choices=sorted(STATE_DTYPES))
    plan.add_argument("--no-host-tier", action="store_true", help="all state on the device")
    plan.add_argument("--all-host", action="store_true", help="all state on the host")
    plan.add_argument("--json", help="also write the plan as JSON here ('-': stdout, no table)")
    plan.add_argument("--summary", action="store_true",
                      help="totals and the prediction, not one row per parameter")
    plan.add_argument("--step-in-backward", action="store_true",
                      help="plan for updates in backward: each gradient freed once used")
    model = plan.add_argument_group("model options (with --model)")
    model.add_argument("--model", help="a preset (llama-2-7b, ...) or a Hugging Face "
                                       "config.json (or its folder)")
    model.add_argument("--gpu-mem", help="the device budget, e.g. 24GiB (= --budget)")
    model.add_argument("--batch", type=int, help="sequences per step (default 1)")
    model.add_argument("--seq", type=int,
                       help="tokens per sequence (default: the model's context, at most 2048)")
    model.add_argument("--checkpointing", action="store_true",
                       help="activation checkpointing (each layer keeps only its input)")
    model.add_argument("--eager-attention", action="store_true",
                       help="attention saves its scores (default: fused attention, SDPA)")
    model.add_argument("--param-dtype", choices=PARAM_DTYPES,
                       help="the parameters on the device (default bf16, their fp32 master in "
                            "the optimizer state; bf16 autocast)")
    model.add_argument("--device", help="h200 (default), a100-40gb, rtx-4090, or 'this'")
    model.add_argument("--keep-grads", action="store_true",
                       help="plan for step() after backward, every gradient held at once")
    sub.add_parser("demo", add_help=False,
                   help="train a small GPT with emsa.AdamW next to torch.optim.AdamW "
                        "(emsa demo --help)")
    sub.add_parser("report", add_help=False,
                   help="report.md and plots for a run directory (emsa report --help)")
    profile = sub.add_parser("profile", help="measure this machine, print the profile as JSON")
    profile.add_argument("--no-bandwidth", action="store_true", help="skip the timed parts")
    return parser


MODEL_ONLY = ["gpu_mem", "batch", "seq", "checkpointing", "eager_attention", "param_dtype",
              "device", "keep_grads"]


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The combinations argparse cannot check; exits 2 as the C++ CLI does."""
    def flag(dest):
        return "--" + dest.replace("_", "-")
    if args.all_host and args.no_host_tier:
        parser.error("--all-host and --no-host-tier contradict each other; pick one")
    if args.step_in_backward and args.keep_grads:
        parser.error("--step-in-backward and --keep-grads contradict each other; pick one")
    if args.model is None:
        given = [flag(d) for d in MODEL_ONLY if getattr(args, d) not in (None, False)]
        if given:
            parser.error(f"{given[0]} goes with --model NAME|PATH")
        if args.probe is None:
            parser.error("plan needs a probe record (plan PROBE.json) or a model "
                         "(plan --model NAME)")
        return
    if args.probe is not None:
        parser.error(f"give a probe record or --model, not both: got {args.probe!r} and "
                     f"--model {args.model}")
    if args.gpu_mem is not None and args.budget is not None:
        parser.error("--gpu-mem and --budget name the same thing; give one")
    if args.device is not None and args.profile is not None:
        parser.error("--device and --profile both name the device; give one")
    for dest in ("batch", "seq"):
        value = getattr(args, dest)
        if value is not None and value <= 0:
            parser.error(f"{flag(dest)} {value} is not a positive whole number")


def _profile_text(path: str) -> str:
    """The text of a --profile file, bounded in size; ValueError unless it is a JSON object."""
    text = _files.read_text(path)
    if not text.lstrip().startswith("{"):
        raise ValueError(f"{path}: not a device profile (expected a JSON object, as "
                         "`emsa profile` writes)")
    return text


def _choose_device(args) -> tuple[str, str]:
    """(profile JSON text, label) for --profile FILE, --device this, or a device preset."""
    if args.profile is not None:
        return _profile_text(args.profile), f"profile {args.profile}"
    if args.device == "this":
        return json.dumps(measure_profile()), "this machine, measured"
    name = args.device or DEFAULT_DEVICE
    return device_preset(name), f"preset {name}"


def _device_line(profile: dict, label: str) -> str:
    gpu = profile.get("gpu", {})
    if not gpu.get("present"):
        return f"device     no GPU ({label}): no device limit unless --gpu-mem\n"
    return f"device     {gpu['name']} ({label}), {format_bytes(gpu['total_memory'])}\n"


def _optimizer_line(args, release_grads: bool) -> str:
    state = "float32" if STATE_DTYPES[args.state_dtype] == torch.float32 else "bfloat16"
    how = ("step in backward (each gradient freed once its update has it)" if release_grads
           else "step() after backward (every gradient held at once)")
    return f"optimizer  {args.optimizer}, {state} state, {how}\n"


class _Infeasible(Exception):
    """The budget cannot be met; str() is the whole message, as the C++ CLI prints it."""


def _plan(record, profile, model=None, **plan_kwargs):
    """make_plan; where the budget cannot be met, _Infeasible with libemsa's message for it."""
    try:
        return make_plan(record, profile, **plan_kwargs)
    except InfeasibleBudgetError:
        raise _Infeasible(infeasible_message(record, profile, model=model,
                                             **plan_kwargs)) from None


def _plan_model(args) -> tuple[object, str]:
    """(plan, text before its table); raises _Infeasible."""
    profile_text, label = _choose_device(args)
    shape = dict(batch=args.batch or 1, seq_len=args.seq or 0, checkpointing=args.checkpointing,
                 eager_attention=args.eager_attention, param_dtype=args.param_dtype or "bf16",
                 matmul_flops=matmul_flops_of(profile_text))
    probe, summary = model_probe(args.model, **shape)
    release_grads = not args.keep_grads
    plan = _plan(probe, profile_text, model_options(**shape), optimizer=args.optimizer,
                 state_dtype=STATE_DTYPES[args.state_dtype],
                 budget=args.gpu_mem if args.gpu_mem is not None else args.budget,
                 allow_host_tier=not args.no_host_tier, force_all_host=args.all_host,
                 release_grads=release_grads)
    preamble = (summary + _device_line(json.loads(profile_text), label)
                + _optimizer_line(args, release_grads))
    return plan, preamble + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "demo":  # their own parsers: torch and matplotlib load only here
        from .demo import main as demo_main

        return demo_main(argv[1:])
    if argv and argv[0] == "report":
        from .report import main as report_main

        return report_main(argv[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "plan":
        _check_args(parser, args)
    preamble = ""
    try:
        if args.command == "profile":
            print(json.dumps(measure_profile(not args.no_bandwidth), indent=2))
            return 0
        if args.model is not None:
            plan, preamble = _plan_model(args)
        else:
            # The text goes to the C++ reader as it is: bounded in size, nesting and values,
            # with the messages the C++ CLI gives.
            profile = _profile_text(args.profile) if args.profile is not None else None
            plan = _plan(_files.read_text(args.probe), profile, optimizer=args.optimizer,
                         state_dtype=STATE_DTYPES[args.state_dtype], budget=args.budget,
                         allow_host_tier=not args.no_host_tier, force_all_host=args.all_host,
                         release_grads=args.step_in_backward)
    except _Infeasible as e:
        print(f"emsa: {e}", file=sys.stderr)
        return 3
    except (EmsaError, ValueError, OSError) as e:
        print(f"emsa: {e}", file=sys.stderr)
        return 2
    except RecursionError:
        print("emsa: the input's JSON nests too deeply", file=sys.stderr)
        return 2
    except (EmsaLibraryError, MemoryError) as e:
        print(f"emsa: {e or 'out of memory'}", file=sys.stderr)
        return 1
    if args.json == "-":
        sys.stdout.write(plan.text)
        return 0
    if args.json:
        try:
            _files.write_text(args.json, plan.text)
        except OSError as e:
            print(f"emsa: cannot write {args.json}: {e.strerror or e}", file=sys.stderr)
            return 1
    sys.stdout.write(preamble + (plan_summary(plan) if args.summary else plan.table()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
