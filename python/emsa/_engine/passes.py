"""step_in_backward=True: the gradient hooks, and the passes they drive.

A pass is one backward() call: it opens at the first hook that fires (where lr and the other
hyperparameters are read and the engine begins the pass), updates each of the plan's buckets
once all its gradients are final, and ends at the autograd engine's callback queued from there,
which runs once, when that backward ends (a reentrant backward inside it belongs to the outer
one). With ddp= DDP's communication hook drives the pass instead (emsa._distributed.ddp). With
accumulate=N only every Nth pass updates. grad_scaler= gives the pass its loss scale, and
GradScaler.step(opt) the passes' inf verdict. docs/usage.md ("Updating in backward") has the
whole story, the refusals included.
"""

from __future__ import annotations

import sys
import time
import weakref

import torch

from . import hand_clipping, trainer_checks

__all__ = ["Passes"]

# The autograd node being run on this thread (None outside backward, and at the end of a
# top-level backward); torch versions without it run no reentrant check.
_current_node = getattr(torch._C, "_current_autograd_node", lambda: None)


class Passes:
    """The in-backward passes of one optimizer: owned by it (opt, held weakly), over its
    binding (engine, planned parameters, DTensor shards)."""

    def __init__(self, opt, binding, setup, dist, accumulate: int):
        self._opt = weakref.ref(opt)
        self.binding = binding
        self.engine = binding.engine
        self.setup = setup  # the optimizer's SetupTimes: the first pass is its first step
        self.dist = dist
        self.accumulate = accumulate  # the optimizer sets it when a trainer hands it over
        self.names = binding.planned.names
        self.fired: set[int] = set()
        self.state = opt.state  # opt.state (one object for the optimizer's life)
        self.touched: set[int] = set()  # slots updated, while some have no opt.state entry
        self.count = 0  # passes ended
        self.consumed = False  # the last pass updated from and released the gradients
        self.updating = False
        self.is_open = False
        self.token = 0
        self.last_skipped = False
        self.found_inf: torch.Tensor | None = None  # in-backward skips, for the GradScaler
        self.trainer_checked = False
        self._first_start: float | None = None
        self.bucket_members = self.engine.bucket_slots()
        self.bucket_of = {i: b for b, members in enumerate(self.bucket_members)
                          for i in members}
        self.waiting = [len(m) for m in self.bucket_members]
        self.hooks: list = []
        hand_clipping.watch(self)  # torch's clipping by hand after a pass: refused or answered
        ref = weakref.ref(self)
        for i, s in enumerate(binding.planned.slots):
            def hook(p, i=i):
                passes = ref()
                if passes is not None:
                    passes.grad_ready(i)

            self.hooks.append(s.param.register_post_accumulate_grad_hook(hook))

    def opt(self):
        return self._opt()

    # ---- one pass ---------------------------------------------------------------------------
    def grad_ready(self, i: int) -> None:
        try:
            if not self.is_open:
                self.open_pass()
            if i in self.fired:
                raise RuntimeError(
                    f"emsa: {self.names[i]} got a second gradient within one backward() call "
                    "(a parameter used in several segments of checkpoint(use_reentrant=True) "
                    "gets one per segment), after emsa had updated from the first; emsa updates "
                    "each parameter once per backward: use checkpoint(use_reentrant=False), or "
                    "step_in_backward=False")
            self.fired.add(i)
            if not self.updating:
                return
            b = self.bucket_of[i]
            self.waiting[b] -= 1
            if self.waiting[b]:
                return
            members = self.bucket_members[b]
            shards = self.binding.shards
            shards.pull(members)
            with torch.no_grad():
                if self.engine.step_bucket(b):
                    # Released now, not at zero_grad: the point of stepping in backward. On a
                    # device the caching allocator reuses the memory in stream order, after the
                    # update that reads it.
                    shards.release(members)
                    if self.state.hidden:  # updated, even if the backward fails later
                        self.touched.update(members)
        except BaseException:
            self.abandon_pass()
            raise

    def open_pass(self) -> None:
        opt = self._opt()
        if self.count == 0:
            why = self.dist.first_pass_error()  # reduced gradients emsa cannot see: refuse
            if why:
                self.remove_hooks()
                raise RuntimeError(why)
        self.updating = (self.count + 1) % self.accumulate == 0
        groups = opt._engine_groups(unfrozen=True)
        if self.updating and "first_step" not in self.setup.times:
            self._first_start = time.perf_counter()
        if self.updating:  # the pass's first gradient: its lr and hyperparameters
            with torch.no_grad():
                self.engine.begin_pass(self.binding.shards.groups(groups),
                                       opt._gate(**self._scaling()))
        self.waiting = [len(m) for m in self.bucket_members]
        self.consumed = False  # set when a pass has updated from and released the gradients
        self.token += 1
        token, ref = self.token, weakref.ref(self)
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
            passes = ref()
            if passes is not None:
                passes.close_pass(token)

        if self.dist.ddp_model is None:  # else DDP's hook ends the pass, after DDP's finalize
            engine.queue_callback(end_of_backward)
        self.is_open = True

    def abandon_pass(self) -> None:
        """A hook raised: the backward fails and its callback never runs; the next backward
        starts a new pass (begin_pass discards what the engine kept of this one)."""
        self.is_open = False
        self.fired.clear()
        self._reveal()

    def _reveal(self) -> None:
        """Slots updated since the last call get their opt.state entries, in parameter order
        (torch creates them in that order at a step)."""
        if self.touched:
            self.state.reveal(sorted(self.touched))
            self.touched.clear()

    def close_current(self) -> None:
        """The pass under way ends now (DDP's hook, after DDP's own finalize)."""
        self.close_pass(self.token)

    def close_pass(self, token: int) -> None:
        if token != self.token or not self.is_open:
            return
        self.is_open = False
        self.fired.clear()
        self.count += 1
        if not self.updating:
            return
        opt = self._opt()
        opt._engine_groups()  # a frozen parameter with a gradient: refuse before finishing
        if self.state.hidden:  # end_pass updates every slot with a gradient now
            self.touched.update(self.state.unshown_with_grads())
        shards = self.binding.shards
        shards.pull()
        with torch.no_grad():
            self.engine.end_pass()
        shards.release()
        self._reveal()  # parameters updated for the first time get their opt.state entries
        self.consumed = True  # clipping them by hand now would act on nothing (hand_clipping)
        hand_clipping.install()  # Accelerate imported since: its clip_grad_norm_ too
        skips = self.engine.finished_skips()  # deferred engines: those known by now
        if not self.engine.deferred:
            self.last_skipped = bool(skips)
        if opt.grad_scaler is None:  # a scaler's skips are routine: no warning
            opt._warn_skipped(skips, stacklevel=3)
        if self._first_start is not None:
            self.setup.times["first_step"] = time.perf_counter() - self._first_start
            self._first_start = None

    def _scaling(self) -> dict:
        """The pass's loss scale and found_inf output, from the optimizer's grad_scaler."""
        scaler = self._opt().grad_scaler
        if scaler is None or not scaler.is_enabled():
            return {}
        # GradScaler keeps its scale as a 0-d float32 tensor, _scale (set by its first
        # scale() call); reading it as a tensor keeps the device from waiting for the host.
        scale = getattr(scaler, "_scale", None)
        if scale is None:
            raise RuntimeError("emsa: grad_scaler= is given but the GradScaler has no scale "
                               "yet: backward from scaler.scale(loss), not from loss")
        if self.found_inf is None:
            self.found_inf = torch.zeros((), dtype=torch.float32, device=scale.device)
        return {"loss_scale": scale, "found_inf_out": self.found_inf, "amp": True}

    # ---- step(): what the optimizer's step does in this mode ---------------------------------
    def amp_step(self, unscaled: bool) -> None:
        """GradScaler.step(opt) called step() (unscaled: scaler.unscale_(opt) ran first). The
        updates (or skips) were made in backward; hand the scaler the passes' inf verdict so
        that scaler.update() backs off after a skipped pass, as after a skipped torch step."""
        opt = self._opt()
        scaler = opt.grad_scaler
        cls = type(opt).__name__
        if scaler is None:
            raise RuntimeError(
                f"emsa.{cls}(step_in_backward=True) was stepped by a GradScaler but was not "
                "given it: the updates in backward used gradients still multiplied by the loss "
                "scale and did not skip inf/nan. Build the optimizer with grad_scaler=scaler "
                "(emsa then divides by its scale in backward, skips non-finite passes and "
                "reports them to scaler.update())")
        if unscaled:
            opt._warn_once("unscale", (
                "emsa: scaler.unscale_(opt) ran after backward, but with step_in_backward=True "
                "emsa consumed (and unscaled) the gradients in backward: whatever reads or "
                "clips .grad after unscale_ sees None. Clip with emsa's max_grad_norm= instead"),
                stacklevel=4)
        found = self.found_inf
        if found is None:
            found = torch.zeros((), dtype=torch.float32,
                                device=getattr(scaler, "_scale", torch.zeros(())).device)
        # GradScaler.update reads each optimizer's found_inf_per_device, which its own check
        # left empty (every .grad was None). A copy: update() may add into the first one.
        scaler._per_optimizer_states[id(opt)]["found_inf_per_device"] = {
            found.device: found.clone()}
        found.zero_()

    def refuse_trainer_settings(self, frame=None) -> None:
        """step() with step_in_backward, the first time (or a clipping call by hand before it,
        from `frame`): a Hugging Face Trainer calling it without emsa.hf.EmsaTrainerCallback
        clips after backward (args.max_grad_norm, 1.0 by default), which finds the gradients
        this mode consumed gone, and accumulates batches that emsa updated from one by one.
        Refused, with what to do (the first pass's update is done by then; later ones would
        repeat it). Found by the Trainer in the calling frames, looked for once."""
        self.trainer_checked = True
        trainer = trainer_checks.calling_trainer(frame or sys._getframe(1))
        if trainer is None:
            return
        args = trainer.args
        steps = int(getattr(args, "gradient_accumulation_steps", 1) or 1)
        clip = float(getattr(args, "max_grad_norm", 0.0) or 0.0)
        if clip > 0 or steps != self.accumulate:
            cls = type(self._opt()).__name__
            raise RuntimeError(
                f"emsa.{cls}(step_in_backward=True) is stepped by a Hugging Face Trainer "
                f"(max_grad_norm={clip}, gradient_accumulation_steps={steps}) without "
                "emsa.hf.EmsaTrainerCallback: Trainer would clip gradients emsa has already "
                "updated from and released, and emsa would update in every accumulated "
                "backward. Pass callbacks=[EmsaTrainerCallback()] to the Trainer (it hands "
                "both to emsa), or set max_grad_norm=0 and "
                f"gradient_accumulation_steps={self.accumulate}")

    def refuse_clipping_after(self, closure) -> None:
        """step(closure): refuses, before the closure runs (so this step changes nothing), a
        closure after which Lightning clips (Trainer(gradient_clip_val=...)): the clipping
        would find the gradients this pass consumes already gone, unless emsa clips them
        itself. Also refuses a Trainer that accumulates batches emsa does not, found only here,
        at the step after them (EmsaLightningCallback hands the count to emsa first)."""
        opt = self._opt()
        cls = type(opt).__name__
        clip, algorithm, accumulate = trainer_checks.lightning_request(closure)
        if accumulate is not None and accumulate != self.accumulate:
            raise RuntimeError(
                f"emsa.{cls}(step_in_backward=True): Lightning accumulates {accumulate} batches "
                f"per optimizer step (accumulate_grad_batches), emsa updates every "
                f"{self.accumulate} backward passes, so the earlier backwards of this step "
                "already updated the parameters. Add emsa.lightning.EmsaLightningCallback() to "
                "the Trainer's callbacks (it hands accumulate_grad_batches to emsa) or pass "
                f"accumulate={accumulate} to emsa")
        if clip is None:
            return
        if algorithm != "norm":
            raise RuntimeError(
                f"emsa.{cls}(step_in_backward=True): Lightning clips each gradient element "
                f"after backward (gradient_clip_algorithm={algorithm!r}), but emsa updates "
                "from the gradients, and releases them, during backward: the clipping would act "
                "on nothing. emsa clips by the global norm only (max_grad_norm=, or "
                "gradient_clip_algorithm='norm' with emsa.lightning.EmsaLightningCallback()); "
                "or use step_in_backward=False")
        ours = opt.max_grad_norm
        if ours is None:
            raise RuntimeError(
                f"emsa.{cls}(step_in_backward=True): Lightning clips the gradients after "
                f"backward (gradient_clip_val={clip}), but emsa updates from them, and releases "
                "them, during backward: the clipping would act on nothing. Add "
                "emsa.lightning.EmsaLightningCallback() to the Trainer's callbacks, which hands "
                "gradient_clip_val to emsa, or pass max_grad_norm= to emsa and leave "
                "gradient_clip_val unset")
        if clip != ours:
            opt._warn_once("lightning_clip", (
                f"emsa: Lightning's gradient_clip_val={clip} finds no gradients after an "
                f"in-backward pass; emsa clips at its own max_grad_norm={ours}"), stacklevel=4)

    def remove_hooks(self) -> None:
        """Removes the gradient hooks; later backwards update nothing."""
        for h in self.hooks:
            h.remove()
        self.hooks = []
        self.consumed = False
