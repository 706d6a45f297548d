"""Hugging Face Trainer with an emsa optimizer: clipping by emsa, exact in every mode.

Trainer clips with clip_grad_norm_ between backward and optimizer.step() (max_grad_norm=1.0 by
default); with step_in_backward=True emsa has already updated from the gradients by then, and in
step() mode that clipping is an extra pass emsa fuses into its update. The callback hands
Trainer's threshold, gradient accumulation and fp16 GradScaler to emsa at train begin and gives
them back at train end:

    opt = emsa.AdamW(model.parameters(), lr=5e-5, step_in_backward=True, tier="host")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                                   optimizers=(opt, sched), callbacks=[EmsaTrainerCallback()])

Without the callback, an in-backward emsa optimizer refuses Trainer's first step() if Trainer
clips or accumulates, since that clipping would act on nothing. The logged "grad_norm" is
emsa's. docs/usage.md ("Hugging Face Trainer") has the recipe in full.
"""

from __future__ import annotations

import warnings

from transformers import TrainerCallback

from ._optimizer import EmsaOptimizer

__all__ = ["EmsaTrainerCallback"]


def _emsa_optimizer(optimizer):
    """The emsa optimizer inside Trainer's (Accelerate wraps it as .optimizer), or None."""
    inner = getattr(optimizer, "optimizer", optimizer)
    return inner if isinstance(inner, EmsaOptimizer) else None


class EmsaTrainerCallback(TrainerCallback):
    """Moves Trainer's gradient clipping (args.max_grad_norm) into the emsa optimizer; see the
    module docstring for the recipe."""

    # What an in-backward optimizer looks for among a Trainer's callbacks
    # (emsa._engine.trainer_checks.HANDS_OVER_TO_EMSA): this one hands Trainer's settings over.
    emsa_hands_over = True

    def __init__(self):
        self._restore: float | None = None
        self._give_back = None
        self._opt = None

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        opt = _emsa_optimizer(optimizer)
        if opt is None:
            warnings.warn("EmsaTrainerCallback: the Trainer's optimizer is not an emsa "
                          "optimizer; the callback does nothing (Trainer clips as usual)",
                          RuntimeWarning, stacklevel=2)
            return
        self._opt = opt
        wanted = float(args.max_grad_norm or 0.0)
        # Trainer's logged norm (accelerator.clip_grad_norm_ with max_norm=inf) calls
        # scaler.unscale_ after backward.
        self._give_back = opt.hand_over(
            by="EmsaTrainerCallback",
            accumulate=int(getattr(args, "gradient_accumulation_steps", 1) or 1),
            accumulate_setting="gradient_accumulation_steps", max_grad_norm=wanted or None,
            clip_setting="args.max_grad_norm", grad_scaler=getattr(optimizer, "scaler", None),
            unscales_after_backward=True)
        if wanted > 0:
            self._restore = args.max_grad_norm
            args.max_grad_norm = 0.0

    def on_log(self, args, state, control, logs=None, **kwargs):
        opt = self._opt
        if (opt is None or not opt.step_in_backward or logs is None or "grad_norm" not in logs
                or opt.max_grad_norm is None):
            return
        norm = opt.last_grad_norm
        if norm is not None:
            logs["grad_norm"] = norm
            if state.log_history and "grad_norm" in state.log_history[-1]:
                state.log_history[-1]["grad_norm"] = norm

    def on_train_end(self, args, state, control, **kwargs):
        if self._restore is not None:
            args.max_grad_norm, self._restore = self._restore, None
        if self._give_back is not None:
            self._give_back, give_back = None, self._give_back
            give_back()
