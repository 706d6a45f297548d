"""step_in_backward=True for the optimizers (emsa.optimizers): the gradient hooks, and the
passes they drive.

A pass is one backward() call: it opens at the first hook that fires (where lr and the other
hyperparameters are read and the backend begins the pass), updates each of the plan's buckets
once all its gradients are final, and ends at the autograd engine's callback queued from there,
which runs once, when that backward ends (a reentrant backward inside it belongs to the outer
one). With ddp= DDP's hook ends the pass instead (emsa._ddp). With accumulate=N only every Nth
pass updates. grad_scaler= gives the pass its loss scale, and GradScaler.step(opt) the passes'
inf verdict.

InBackwardPasses is a mixin of emsa.optimizers._EmsaOptimizer: its methods read the optimizer's
attributes (_backend, _shards, _accumulate, _grad_scaler, ...) and call its _engine_groups,
_configure and _warn_skipped.
"""

from __future__ import annotations

import sys
import time
import weakref

import torch

from . import _distributed, _hand_clipping, _recipes

__all__ = ["InBackwardPasses"]

# The autograd node being run on this thread (None outside backward, and at the end of a
# top-level backward); torch versions without it run no reentrant check.
_current_node = getattr(torch._C, "_current_autograd_node", lambda: None)


class InBackwardPasses:
    """The in-backward methods of the optimizers (see the module docstring)."""

    def _install_hooks(self, slots, backend_cls) -> None:
        if self._in_backward and not backend_cls.steps_in_backward:
            raise NotImplementedError(
                f"step_in_backward=True is not supported for parameters on "
                f"{slots[0].param.device} yet (the device engine updates all tables in one "
                "call); use step_in_backward=False and call step() after backward")
        self._names = [s.name for s in slots]
        self._fired: set[int] = set()
        self._passes = 0
        self._consumed = False
        _hand_clipping.watch(self)  # torch's clipping by hand after a pass: refused or answered
        self._updating = False
        self._bucket_members = self._backend.bucket_slots()
        self._bucket_of = {i: b for b, members in enumerate(self._bucket_members)
                           for i in members}
        self._waiting = [len(m) for m in self._bucket_members]
        ref = weakref.ref(self)
        for i, s in enumerate(slots):
            def hook(p, i=i):
                opt = ref()
                if opt is not None:
                    opt._grad_ready(i)

            self._hooks.append(s.param.register_post_accumulate_grad_hook(hook))

    def _grad_ready(self, i: int) -> None:
        try:
            if not self._pass_open:
                self._open_pass()
            fired = self._fired
            if i in fired:
                raise RuntimeError(
                    f"emsa: {self._names[i]} got a second gradient within one backward() call "
                    "(a parameter used in several segments of checkpoint(use_reentrant=True) "
                    "gets one per segment), after emsa had updated from the first; emsa updates "
                    "each parameter once per backward: use checkpoint(use_reentrant=False), or "
                    "step_in_backward=False")
            fired.add(i)
            if not self._updating:
                return
            b = self._bucket_of[i]
            self._waiting[b] -= 1
            if self._waiting[b]:
                return
            backend = self._backend
            members = self._bucket_members[b]
            self._shards.pull(members)
            with torch.no_grad():
                if backend.step_bucket(b):
                    # Released now, not at zero_grad: the point of stepping in backward. On a
                    # device the caching allocator reuses the memory in stream order, after the
                    # update that reads it.
                    self._shards.release(members)
        except BaseException:
            self._abandon_pass()
            raise

    def _open_pass(self) -> None:
        if self._passes == 0:
            _distributed.check_first_pass(self)  # reduced gradients emsa cannot see: refuse
        backend = self._backend
        self._updating = (self._passes + 1) % self._accumulate == 0
        groups = self._engine_groups(unfrozen=True)
        if self._updating and "first_step" not in self._setup_times:
            self._first_pass_start = time.perf_counter()
        if self._updating:  # the pass's first gradient: its lr and hyperparameters
            self._configure(backend, **self._pass_scaling())
            with torch.no_grad():
                backend.begin_pass(self._shards.groups(groups))
        self._waiting = [len(m) for m in self._bucket_members]
        self._consumed = False  # set when a pass has updated from and released the gradients
        self._pass_token += 1
        token, ref = self._pass_token, weakref.ref(self)

        engine = torch.autograd.Variable._execution_engine

        def end_of_backward():
            node = _current_node()
            if node is not None:
                # A reentrant backward (checkpoint(use_reentrant=True)) ended inside the node
                # `node` of an outer one: the pass ends with the outer backward. A post hook of
                # that node runs in the outer backward and queues this callback there.
                def outer(grad_inputs, grad_outputs):
                    handle.remove()
                    engine.queue_callback(end_of_backward)

                handle = node.register_hook(outer)
                return
            opt = ref()
            if opt is not None:
                opt._close_pass(token)

        if self._ddp is None:  # else DDP's hook ends the pass, after DDP's own finalize
            engine.queue_callback(end_of_backward)
        self._pass_open = True

    def _abandon_pass(self) -> None:
        """A hook raised: the backward fails and its callback never runs; the next backward
        starts a new pass (begin_pass discards what the backend kept of this one)."""
        self._pass_open = False
        self._fired.clear()

    def _close_pass(self, token: int) -> None:
        if token != self._pass_token or not self._pass_open:
            return
        self._pass_open = False
        self._fired.clear()
        backend = self._backend
        self._passes += 1
        if not self._updating:
            return
        self._engine_groups()  # a frozen parameter with a gradient: refuse before finishing
        self._shards.pull()
        with torch.no_grad():
            backend.end_pass()
        self._shards.release()
        self._consumed = True  # clipping them by hand now would act on nothing (_hand_clipping)
        _hand_clipping.install()  # Accelerate imported since: its clip_grad_norm_ too
        skips = backend.finished_skips()  # deferred engines: those known by now
        if not backend.deferred:
            self._last_skipped = bool(skips)
        if self._grad_scaler is None:  # a scaler's skips are routine: no warning
            self._warn_skipped(skips, stacklevel=3)
        start = self.__dict__.pop("_first_pass_start", None)
        if start is not None:
            self._setup_times["first_step"] = time.perf_counter() - start

    def _pass_scaling(self) -> dict:
        """The in-backward pass's loss scale and found_inf output, from grad_scaler=."""
        scaler = self._grad_scaler
        if scaler is None or not scaler.is_enabled():
            return {}
        # GradScaler keeps its scale as a 0-d float32 tensor, _scale (set by its first
        # scale() call); reading it as a tensor keeps the device from waiting for the host.
        scale = getattr(scaler, "_scale", None)
        if scale is None:
            raise RuntimeError("emsa: grad_scaler= is given but the GradScaler has no scale "
                               "yet: backward from scaler.scale(loss), not from loss")
        if self._found_inf is None:
            self._found_inf = torch.zeros((), dtype=torch.float32, device=scale.device)
        return {"loss_scale": scale, "found_inf_out": self._found_inf, "amp": True}

    def _amp_step(self) -> None:
        """step_in_backward: GradScaler.step(opt) called step(). The updates (or skips) were
        made in backward; hand the scaler the passes' inf verdict so that scaler.update()
        backs off after a skipped pass, as it would after a skipped torch step."""
        scaler = self._grad_scaler
        if scaler is None:
            raise RuntimeError(
                f"emsa.{type(self).__name__}(step_in_backward=True) was stepped by a GradScaler "
                "but was not given it: the updates in backward used gradients still multiplied "
                "by the loss scale and did not skip inf/nan. Build the optimizer with "
                "grad_scaler=scaler (emsa then divides by its scale in backward, skips "
                "non-finite passes and reports them to scaler.update())")
        if self.__dict__.get("grad_scale", 0) is None:
            self._warn_once("unscale", (
                "emsa: scaler.unscale_(opt) ran after backward, but with step_in_backward=True "
                "emsa consumed (and unscaled) the gradients in backward: whatever reads or "
                "clips .grad after unscale_ sees None. Clip with emsa's max_grad_norm= instead"),
                stacklevel=4)
        found = self._found_inf
        if found is None:
            found = torch.zeros((), dtype=torch.float32,
                                device=getattr(scaler, "_scale", torch.zeros(())).device)
        # GradScaler.update reads each optimizer's found_inf_per_device, which its own check
        # left empty (every .grad was None). A copy: update() may add into the first one.
        scaler._per_optimizer_states[id(self)]["found_inf_per_device"] = {
            found.device: found.clone()}
        found.zero_()

    def _refuse_trainer_settings(self, frame=None) -> None:
        """step() with step_in_backward, the first time (or a clipping call by hand before it,
        from `frame`): a Hugging Face Trainer calling it without emsa.hf.EmsaTrainerCallback
        clips after backward (args.max_grad_norm, 1.0 by default), which finds the gradients
        this mode consumed gone, and accumulates batches that emsa updated from one by one. Refused, with what to do (the first pass's update is
        done by then; later ones would repeat it). Found by the Trainer in the calling frames,
        looked for once."""
        self._trainer_checked = True
        trainer = _recipes.calling_trainer(frame or sys._getframe(1))
        if trainer is None:
            return
        args = trainer.args
        steps = int(getattr(args, "gradient_accumulation_steps", 1) or 1)
        clip = float(getattr(args, "max_grad_norm", 0.0) or 0.0)
        if clip > 0 or steps != self._accumulate:
            raise RuntimeError(
                f"emsa.{type(self).__name__}(step_in_backward=True) is stepped by a Hugging "
                f"Face Trainer (max_grad_norm={clip}, gradient_accumulation_steps={steps}) "
                "without emsa.hf.EmsaTrainerCallback: Trainer would clip gradients emsa has "
                "already updated from and released, and emsa would update in every "
                "accumulated backward. Pass callbacks=[EmsaTrainerCallback()] to the Trainer "
                "(it hands both to emsa), or set max_grad_norm=0 and "
                f"gradient_accumulation_steps={self._accumulate}")

    def _refuse_clipping_after(self, closure) -> None:
        """step(closure) with step_in_backward: refuses, before the closure runs (so this step
        changes nothing), a closure after which Lightning clips (Trainer(gradient_clip_val=...)):
        the clipping would find the gradients this pass consumes already gone, unless emsa clips
        them itself. Also refuses a Trainer that accumulates batches emsa does not, found only
        here, at the step after them (a Lightning callback sees it first: EmsaLightningCallback
        hands the count to emsa)."""
        clip, algorithm, accumulate = _recipes.lightning_request(closure)
        if accumulate is not None and accumulate != self._accumulate:
            raise RuntimeError(
                f"emsa.{type(self).__name__}(step_in_backward=True): Lightning accumulates "
                f"{accumulate} batches per optimizer step (accumulate_grad_batches), emsa "
                f"updates every {self._accumulate} backward passes, so the earlier backwards of "
                "this step already updated the parameters. Add "
                "emsa.lightning.EmsaLightningCallback() to the Trainer's callbacks (it hands "
                f"accumulate_grad_batches to emsa) or pass accumulate={accumulate} to emsa")
        if clip is None:
            return
        if algorithm != "norm":
            raise RuntimeError(
                f"emsa.{type(self).__name__}(step_in_backward=True): Lightning clips each "
                f"gradient element after backward (gradient_clip_algorithm={algorithm!r}), but "
                "emsa updates from the gradients, and releases them, during backward: the "
                "clipping would act on nothing. emsa clips by the global norm only "
                "(max_grad_norm=, or gradient_clip_algorithm='norm' with "
                "emsa.lightning.EmsaLightningCallback()); or use step_in_backward=False")
        if self._max_grad_norm is None:
            raise RuntimeError(
                f"emsa.{type(self).__name__}(step_in_backward=True): Lightning clips the "
                f"gradients after backward (gradient_clip_val={clip}), but emsa updates from "
                "them, and releases them, during backward: the clipping would act on nothing. "
                "Add emsa.lightning.EmsaLightningCallback() to the Trainer's callbacks, which "
                "hands gradient_clip_val to emsa, or pass max_grad_norm= to emsa and leave "
                "gradient_clip_val unset")
        if clip != self._max_grad_norm:
            self._warn_once("lightning_clip", (
                f"emsa: Lightning's gradient_clip_val={clip} finds no gradients after an "
                f"in-backward pass; emsa clips at its own max_grad_norm={self._max_grad_norm}"),
                stacklevel=4)

    def remove_hooks(self) -> None:
        """Step in backward: removes the gradient hooks; later backwards update nothing."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._consumed = False

