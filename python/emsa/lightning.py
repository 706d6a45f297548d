"""Lightning's Trainer with an emsa optimizer: clipping by emsa, exact in every mode.

Lightning clips with clip_grad_norm_ after backward; with step_in_backward=True emsa has already
updated from the gradients by then, and in step() mode that clipping is an extra pass emsa fuses
into its update. The callback hands the threshold (and accumulate_grad_batches, and fp16's
GradScaler) to emsa at fit start and gives them back at fit end:

    trainer = L.Trainer(gradient_clip_val=1.0, callbacks=[EmsaLightningCallback()])
    trainer.fit(Model(), loader)   # configure_optimizers returns an emsa optimizer

Clipping by value has no fused form: refused with step_in_backward=True, left to Lightning in
step() mode. docs/usage.md ("Lightning") has the recipe in full.
"""

from __future__ import annotations

import warnings

try:
    from lightning.pytorch import Callback
except ImportError:  # the standalone package
    from pytorch_lightning import Callback

from ._engine.trainer_checks import clip_algorithm
from ._optimizer import EmsaOptimizer

__all__ = ["EmsaLightningCallback"]


def _emsa_optimizers(trainer) -> list:
    """The emsa optimizers among the Trainer's (Lightning may wrap them as .optimizer)."""
    found = []
    for opt in getattr(trainer, "optimizers", []) or []:
        inner = getattr(opt, "optimizer", opt)
        if isinstance(inner, EmsaOptimizer):
            found.append(inner)
    return found


class EmsaLightningCallback(Callback):
    """Moves Lightning's gradient clipping (Trainer(gradient_clip_val=...)) into the emsa
    optimizers; see the module docstring for the recipe."""

    def __init__(self):
        self._restore = None
        self._give_back = []  # each optimizer's accumulate= before fit, to give back

    def on_fit_start(self, trainer, pl_module):
        opts = _emsa_optimizers(trainer)
        if not opts:
            warnings.warn("EmsaLightningCallback: none of the Trainer's optimizers is an emsa "
                          "optimizer; the callback does nothing (Lightning clips as usual)",
                          RuntimeWarning, stacklevel=2)
            return
        steps = int(getattr(trainer, "accumulate_grad_batches", 1) or 1)
        for opt in opts:
            self._give_back.append(opt.hand_over(by="EmsaLightningCallback", accumulate=steps,
                                                 accumulate_setting="accumulate_grad_batches"))
        wanted = float(trainer.gradient_clip_val or 0.0)
        if wanted > 0:
            algorithm = clip_algorithm(trainer)
            if algorithm != "norm":
                if any(opt.step_in_backward for opt in opts):
                    raise ValueError(
                        f"EmsaLightningCallback: gradient_clip_algorithm={algorithm!r} clips "
                        "each gradient element after backward, which an emsa optimizer with "
                        "step_in_backward=True has already consumed. emsa clips by the global "
                        "norm only: use gradient_clip_algorithm='norm', or step_in_backward=False")
                return  # step() mode: Lightning clips by value on .grad, exactly
            for opt in opts:
                opt.hand_over(by="EmsaLightningCallback", max_grad_norm=wanted,
                              clip_setting="gradient_clip_val")
            self._restore = trainer.gradient_clip_val
            trainer.gradient_clip_val = None
        scaler = getattr(getattr(trainer, "precision_plugin", None), "scaler", None)
        if scaler is not None:
            for opt in opts:
                opt.hand_over(by="EmsaLightningCallback", grad_scaler=scaler)

    def on_fit_end(self, trainer, pl_module):
        if self._restore is not None:
            trainer.gradient_clip_val, self._restore = self._restore, None
        give_back, self._give_back = self._give_back, []
        for undo in give_back:
            undo()

    def on_exception(self, trainer, pl_module, exception):
        self.on_fit_end(trainer, pl_module)

