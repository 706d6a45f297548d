"""What an in-backward optimizer reads of a trainer stepping it (Hugging Face's, Lightning's):
calling_trainer finds a Hugging Face Trainer that runs no emsa callback, lightning_request what
Lightning will do after a closure. No trainer library and no emsa integration is imported here:
a callback that hands the trainer's settings to emsa carries the class attribute
HANDS_OVER_TO_EMSA, which is what is looked for."""

from __future__ import annotations

import inspect
import sys

# The marker of a trainer callback that hands the trainer's clipping and accumulation to emsa
# (emsa.hf.EmsaTrainerCallback sets it as a class attribute).
HANDS_OVER_TO_EMSA = "emsa_hands_over"


def clip_algorithm(trainer) -> str:
    """A Lightning Trainer's gradient_clip_algorithm as "norm" or "value" (an enum there, or
    its value; unset means "norm")."""
    algorithm = getattr(trainer, "gradient_clip_algorithm", None) or "norm"
    return str(getattr(algorithm, "value", algorithm)).lower()


def calling_trainer(frame):
    """The Hugging Face Trainer among the 16 frames from `frame` up (a method of Trainer itself
    called the optimizer), unless it runs emsa.hf.EmsaTrainerCallback; else None.

    Only the locals of a frame running Trainer's own code are read: up to Python 3.12, reading
    a function frame's f_locals stores a snapshot of its locals in the frame until it returns,
    so reading the caller's frames kept an optimizer the caller had dropped (`del opt`) alive,
    its gradient hooks still updating the parameters in every backward.

    Trainer is looked up in transformers.trainer only when that module is loaded: no Trainer
    can run before it is, and transformers' own lazy `transformers.Trainer` would import it (with
    what it imports) inside the first step()."""
    trainer_cls = getattr(sys.modules.get("transformers.trainer"), "Trainer", None)
    if not isinstance(trainer_cls, type):
        return None
    for _ in range(16):
        if frame is None:
            return None
        if _trainer_code(trainer_cls, frame.f_code):
            trainer = frame.f_locals.get("self")
            if isinstance(trainer, trainer_cls):
                break
        frame = frame.f_back
    else:
        return None
    handler = getattr(trainer, "callback_handler", None)
    if any(getattr(c, HANDS_OVER_TO_EMSA, False) for c in getattr(handler, "callbacks", [])):
        return None
    return trainer


def _trainer_code(trainer_cls: type, code) -> bool:
    """Whether `code` is the code of a method Trainer itself defines (its training loop calls
    the optimizer's step)."""
    method = getattr(trainer_cls, code.co_name, None)
    try:  # the function a decorator keeping __wrapped__ (functools.wraps) runs
        method = inspect.unwrap(method)
    except ValueError:  # a __wrapped__ loop: no function at its end
        return False
    return getattr(method, "__code__", None) is code


def lightning_request(closure) -> tuple[float | None, str, int | None]:
    """(threshold, algorithm) of the clipping Lightning runs after `closure`, and the number of
    batches it accumulates per optimizer step. The threshold is None when Lightning does not
    clip; all are None when the closure is not Lightning's. Lightning's precision plugin hands
    optimizer.step() functools.partial(plugin._wrap_closure, module, optimizer, closure), and
    the module's trainer holds gradient_clip_val, gradient_clip_algorithm and
    accumulate_grad_batches."""
    func = getattr(closure, "func", None)
    plugin = getattr(func, "__self__", None)
    if plugin is None or not type(plugin).__module__.startswith(("lightning.",
                                                                  "pytorch_lightning.")):
        return None, "", None
    args = getattr(closure, "args", ())
    module = args[0] if args else None
    if not getattr(module, "automatic_optimization", False):
        return None, "", None  # manual optimization: Lightning neither clips nor accumulates
    trainer = getattr(module, "_trainer", None)
    clip = getattr(trainer, "gradient_clip_val", None)
    algorithm = clip_algorithm(trainer)
    accumulate = int(getattr(trainer, "accumulate_grad_batches", 1) or 1)
    return (float(clip) if clip else None), algorithm, accumulate
