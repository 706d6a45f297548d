"""emsa.AdamW, emsa.Adam, emsa.Lion: torch.optim optimizers whose state emsa plans and runs.

Each takes torch.optim's arguments and keeps torch's param groups, state_dict layout and
schedulers, plus emsa's keyword options (the same for all three, defined once in
emsa._engine.options.EmsaOptions). help(emsa.AdamW) shows the math and every argument;
docs/usage.md the modes, the host tier, trainers and torch.distributed.
"""

from __future__ import annotations

import inspect

import torch

from ._engine import options as checks
from ._engine.options import EmsaOptions
from ._optimizer import EmsaOptimizer

__all__ = ["AdamW", "Adam", "Lion"]

_PARAMS = """\
        params (iterable): the parameters to optimize, or dicts defining param groups (as
            torch.optim takes them; named_parameters() lets a probe record match by name)"""

_ADAM_ARGS = """\
        lr (float, Tensor, optional): learning rate (default: {lr})
        betas (tuple[float, float], optional): coefficients of the running averages of the
            gradient and its square (default: (0.9, 0.999))
        eps (float, optional): added to the denominator for numerical stability; emsa needs
            eps > 0 (default: 1e-8)
        weight_decay (float, optional): {decay} (default: {wd})
        amsgrad (bool, optional): refused when True (default: False)
        maximize (bool, optional): maximize the objective instead of minimizing it
            (default: False)
        foreach, fused (bool, optional): accepted at any value (both True refused, as torch
            does): emsa's step is one fused multi-tensor call whichever it is
        capturable, differentiable (bool, optional): accepted only at False"""

_EMSA_ARGS = """\
    emsa's keyword options (all keyword-only):
        probe (ProbeRecord or path, optional): emsa.probe(model, batch)'s record; given, the
            optimizer plans at construction, so a budget that cannot be met fails before
            training. Not given, it plans at the first step() from the parameters' shapes and
            the first backward's gradient order (default: None)
        budget (int or str, optional): device memory for the whole training process, bytes or
            text such as "20GiB"; state the budget cannot hold goes to the host tier, coldest
            first (default: None: free device memory minus a margin; no GPU: unlimited)
        state_dtype (torch.dtype, optional): torch.float32 (matches torch.optim) or
            torch.bfloat16 (default: torch.float32)
        skip_nonfinite (bool, optional): a step whose gradients hold inf/nan changes nothing
            and warns (opt.last_step_skipped) (default: None: True in step() mode, False with
            step_in_backward, where the check makes every update wait for the end of backward)
        max_grad_norm (float, optional): clip by the global L2 norm of every gradient the
            optimizer holds, exactly as torch.nn.utils.clip_grad_norm_ before the step, fused
            into the update; settable as opt.max_grad_norm (default: None: no clipping)
        profile (dict, str or path, optional): a DeviceProfile to plan against instead of this
            machine's (default: None)
        step_in_backward (bool, optional): update each bucket of parameters from its gradient
            hook during backward and release its gradients there; step() then only runs the
            closure. Hides the host tier's copies under backward (default: False)
        accumulate (int, optional): with step_in_backward, update every Nth backward
            (default: 1)
        tier (str, optional): None: the planner decides under budget; "device": all state on
            the device; "host": all state (and an fp32 master of every parameter) in pinned
            host memory, updated by the CPU while the GPU runs (default: None)
        grad_scaler (torch.amp.GradScaler, optional): with step_in_backward, the scaler whose
            scale emsa divides by in backward; in step() mode scaler.step(opt) hands it over by
            itself (default: None)
        process_group (ProcessGroup, optional): ranks that each hold part of the parameters
            (ZeRO-1, FSDP2): the norm and the non-finite count are summed over them
            (default: None: this rank's, the ZeroRedundancyOptimizer's or the DTensor mesh's)
        ddp (DistributedDataParallel or False, optional): with step_in_backward under DDP, the
            DDP model: emsa updates from its communication hook once each bucket's all-reduce
            is done; False: this rank's gradients are its own (default: None)"""

_STATE = """\
    State (opt.state[p], and state_dict() in torch.optim's layout): "step", "exp_avg"{sq}, and
    "master" (fp32) for bf16/fp16 parameters; the tensors are views into emsa's arenas. An entry
    appears at its parameter's first update; clear(), del or {{}} start it afresh, as in torch."""


def _with_emsa_options(init):
    """Gives init (which takes **emsa_options) a signature listing emsa's options with their
    defaults, keyword-only, so help() and inspect show every argument."""
    sig = inspect.signature(init)
    params = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
    defaults = EmsaOptions()
    params += [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY,
                                 default=getattr(defaults, name))
               for name in EmsaOptions.names()]
    init.__signature__ = sig.replace(parameters=params)
    return init


class AdamW(EmsaOptimizer):
    __doc__ = f"""AdamW: Adam with decoupled weight decay, as torch.optim.AdamW.

    For each parameter p with gradient g at step t (g first multiplied by the clip coefficient
    and divided by the loss scale, when those are set):
        p   = p * (1 - lr * weight_decay)
        m   = beta1 * m + (1 - beta1) * g
        v   = beta2 * v + (1 - beta2) * g * g
        p   = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
    (g is -g with maximize=True.) Rounding follows torch's fused AdamW: parameters after N steps
    equal torch.optim.AdamW's to a relative 1e-5 with fp32 state.

    Args:
{_PARAMS}
{_ADAM_ARGS.format(lr="1e-3", wd="1e-2", decay="decoupled weight decay coefficient")}

{_EMSA_ARGS}

{_STATE.format(sq=', "exp_avg_sq"')}
    """

    _kind = "adamw"

    @_with_emsa_options
    def __init__(self, params, lr: float | torch.Tensor = 1e-3, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *,
                 maximize: bool = False, foreach: bool | None = None, capturable: bool = False,
                 differentiable: bool = False, fused: bool | None = None, **emsa_options):
        checks.refuse_amsgrad(amsgrad, "AdamW")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=False,
                        maximize=maximize,
                        **checks.impl_defaults(foreach, capturable, differentiable, fused),
                        decoupled_weight_decay=True)
        super().__init__(params, defaults, EmsaOptions.given("AdamW", emsa_options))


class Adam(EmsaOptimizer):
    __doc__ = f"""Adam with L2 weight decay (added to the gradient), as torch.optim.Adam;
    decoupled_weight_decay=True makes it AdamW, as in torch.

    For each parameter p with gradient g at step t (g first multiplied by the clip coefficient
    and divided by the loss scale, when those are set):
        g   = g + weight_decay * p
        m   = beta1 * m + (1 - beta1) * g
        v   = beta2 * v + (1 - beta2) * g * g
        p   = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
    (g is -g with maximize=True.)

    Args:
{_PARAMS}
{_ADAM_ARGS.format(lr="1e-3", wd="0", decay="L2 penalty added to the gradient")}
        decoupled_weight_decay (bool, optional): AdamW's decay instead (default: False); the
            same in every param group

{_EMSA_ARGS}

{_STATE.format(sq=', "exp_avg_sq"')}
    """

    _kind = "adam"

    @_with_emsa_options
    def __init__(self, params, lr: float | torch.Tensor = 1e-3, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False, *,
                 foreach: bool | None = None, maximize: bool = False, capturable: bool = False,
                 differentiable: bool = False, fused: bool | None = None,
                 decoupled_weight_decay: bool = False, **emsa_options):
        checks.refuse_amsgrad(amsgrad, "Adam")
        self._kind = "adamw" if decoupled_weight_decay else "adam"
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=False,
                        maximize=maximize,
                        **checks.impl_defaults(foreach, capturable, differentiable, fused),
                        decoupled_weight_decay=bool(decoupled_weight_decay))
        super().__init__(params, defaults, EmsaOptions.given("Adam", emsa_options))


class Lion(EmsaOptimizer):
    __doc__ = f"""Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms").

    For each parameter p with gradient g (g first multiplied by the clip coefficient and
    divided by the loss scale, when those are set):
        c   = beta1 * m + (1 - beta1) * g
        p   = p * (1 - lr * weight_decay)
        p   = p - lr * sign(c)
        m   = beta2 * m + (1 - beta2) * g
    Use a learning rate 3-10x smaller than AdamW's, and a weight decay 3-10x larger.

    Args:
{_PARAMS}
        lr (float, Tensor, optional): learning rate (default: 1e-4)
        betas (tuple[float, float], optional): the interpolation of the update's direction
            and of the momentum (default: (0.9, 0.99))
        weight_decay (float, optional): decoupled weight decay coefficient (default: 0)
        maximize (bool, optional): maximize the objective instead of minimizing it
            (default: False)

{_EMSA_ARGS}

{_STATE.format(sq="")}
    """

    _kind = "lion"

    @_with_emsa_options
    def __init__(self, params, lr: float | torch.Tensor = 1e-4, betas=(0.9, 0.99),
                 weight_decay: float = 0.0, *, maximize: bool = False, **emsa_options):
        defaults = dict(lr=lr, betas=betas, weight_decay=weight_decay, maximize=maximize)
        super().__init__(params, defaults, EmsaOptions.given("Lion", emsa_options))
