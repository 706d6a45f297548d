"""What the trainer callbacks (emsa.hf, emsa.lightning) hand an emsa optimizer: the trainer's
gradient accumulation and its clipping threshold. Neither imports a trainer library here."""

from __future__ import annotations

import warnings


def hand_accumulation(opt, steps: int, callback: str, setting: str) -> int | None:
    """With step_in_backward the trainer's `steps` backwards per optimizer step become emsa's
    accumulate= (emsa updates in the last). Returns the value to restore at the end, or None
    when nothing changed. An optimizer built with another accumulate= is refused: the trainer
    zeroes the gradients after each optimizer step, so the two must agree."""
    if not opt._in_backward or opt._accumulate == steps:
        return None
    if opt._accumulate != 1:
        raise ValueError(
            f"{callback}: the emsa optimizer accumulates {opt._accumulate} backward passes "
            f"(accumulate=), the trainer's {setting} is {steps}. The trainer zeroes the "
            f"gradients after each optimizer step, so they must agree: pass {setting}=N to the "
            "trainer (the callback hands it to emsa) and leave emsa's accumulate at 1")
    previous, opt._accumulate = opt._accumulate, steps
    return previous


def hand_clipping(opt, wanted: float, callback: str, setting: str) -> None:
    """The trainer's clipping threshold becomes emsa's max_grad_norm, unless the optimizer was
    given its own (kept, with a warning when they differ)."""
    if opt.max_grad_norm is None:
        opt.max_grad_norm = wanted
    elif opt.max_grad_norm != wanted:
        warnings.warn(
            f"{callback}: the emsa optimizer clips at max_grad_norm={opt.max_grad_norm}, the "
            f"trainer's {setting} is {wanted}; emsa's threshold is kept and the trainer's "
            "clipping is turned off", RuntimeWarning, stacklevel=3)


def clip_algorithm(trainer) -> str:
    """A Lightning Trainer's gradient_clip_algorithm as "norm" or "value" (an enum there, or
    its value; unset means "norm")."""
    algorithm = getattr(trainer, "gradient_clip_algorithm", None) or "norm"
    return str(getattr(algorithm, "value", algorithm)).lower()
