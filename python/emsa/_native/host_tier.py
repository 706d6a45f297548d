"""The host tier for CUDA parameters, seen from torch: libemsa's HostTier (emsa/host_tier.h) fed
from the CUDA engine, and the forward pre-hook that makes the next forward wait per module.

Per host-tier bucket: submit() copies its gradients to pinned staging on a D2H stream (paced by
libemsa's worker with step_in_backward, holding at most hold_bytes of gradients until their
copies are enqueued); libemsa updates the bucket on the CPU, or on the GPU for buckets the plan
marks device_update, and enqueues the upload. The bucket is then pending until the first module
forward that reads one of its parameters makes the compute stream wait for that upload. Gated
steps (begin_step(..., gated=True)) copy whole buckets and update nothing until release() hands
libemsa the GPU's verdict. Step counts are per tensor and kept by libemsa (read_steps,
set_steps). A parameter read outside a module's forward is not seen by the hook: call
synchronize() first. Details (pacing, device deltas, compiled forwards): docs/internals.md.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import sys
import warnings
import weakref

import torch

from . import tuning
from .library import check, lib
from .structs import OPTIMIZER, SIMD, HostTierOptions, HostTierStepStats, HostTierTensor


def _is_compiling_function():
    """torch's test for whether torch.compile (Dynamo) is tracing the calling code."""
    found = getattr(torch.compiler, "is_compiling", None)  # torch >= 2.3
    if found is None:
        found = importlib.import_module("torch._dynamo").is_compiling
    return found


_compiling = _is_compiling_function()


def forward_pre_hook(tier: "HostTier"):
    """The global module forward pre-hook of a tier (held weakly). In an eager forward each
    module waits for the pending uploads of its own parameters. Under torch.compile (Dynamo
    traces the hook) it reads only tier.pending, which Dynamo guards on. The first module of a
    compiled region that finds uploads pending waits for all of them (tier.wait_all_compiled,
    run eagerly at a graph break). The rest trace as nothing to wait for. torch.compile(model)'s
    wrapper waits for all of them too, before the trace begins."""
    ref = weakref.ref(tier)

    def pre_hook(module, args):
        tier = ref()
        if tier is None:
            return
        if _compiling():
            if tier.pending:
                tier.wait_all_compiled()
            return
        if tier.held:
            tier._release_copied()
        if tier.pending:
            if isinstance(module, _compiled_wrapper()):  # torch.compile(model), eager here
                tier.wait_all_compiled()
            else:
                tier._module_forward(module)

    return pre_hook


def _compiled_wrapper() -> type:
    """The class of torch.compile(module)'s wrapper, whose forward Dynamo runs. Global hooks fire
    for the wrapper itself, outside the trace, so the wait for everything costs no graph break
    there."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    wrapper = getattr(eval_frame, "OptimizedModule", None)
    return wrapper if isinstance(wrapper, type) else ()


class HostTier:
    def __init__(self, tensors: list[HostTierTensor], buckets: list[list[int]],
                 group_count: int, optimizer: str, device: torch.device,
                 params: list[torch.Tensor], in_backward: bool = False, hold_bytes: int = -1):
        """tensors[k] belongs to bucket tensors[k].bucket; buckets[b] lists the backend slots
        of bucket b in tensor order; params[k] is tensors[k]'s parameter. in_backward: buckets
        are submitted from the gradient hooks (the copies may then be paced, keeping at most
        hold_bytes of gradients waiting on the device; -1: no limit)."""
        self.handle = ctypes.c_void_p()
        self.updater = ctypes.c_void_p()
        # Paced copies and device-updated buckets: each bucket's gradients, kept alive until
        # libemsa has enqueued what reads them (the worker's copies, the streamer's kernels);
        # record_stream then holds their memory until those have read it.
        self.held: dict[int, list[torch.Tensor]] = {}
        self.device = device
        self.buckets = buckets
        self.d2h = torch.cuda.Stream(device)
        self.h2d = torch.cuda.Stream(device)
        # libemsa's rule for the pool (one core fewer than this process may use; the profile
        # measures on as many), unless EMSA_HOST_THREADS overrides it.
        threads = tuning.host_threads() or lib.emsa_host_tier_threads(
            len(os.sched_getaffinity(0)))
        check(lib.emsa_cpu_updater_create(threads, SIMD["avx512"],
                                          ctypes.byref(self.updater)))
        # libemsa's defaults (HostTierOptions) are the product's; this states only how buckets
        # are submitted and what the caller's budget lets pacing hold. The rest are overrides
        # for A/B runs, read by tuning (None: keep the default).
        options = HostTierOptions()
        lib.emsa_host_tier_options_init(ctypes.byref(options))
        options.optimizer = OPTIMIZER[optimizer]
        options.device = device.index
        options.submit_in_backward = 1 if in_backward else 0
        options.paced_hold_bytes = hold_bytes
        for field, value in (("paced_copies", tuning.host_pace()),
                             ("device_delta", tuning.host_delta()),
                             ("stream_slots", tuning.host_stream_slots()),
                             ("stream_piece_elements", tuning.host_stream_piece())):
            if value is not None:
                setattr(options, field, int(value))
        self.paced = in_backward and options.paced_copies > 0
        # Device-updated buckets' kernels read their gradients here: a stream of torch's own, so
        # record_stream on it stays valid after the tier is gone.
        self.update_stream = torch.cuda.Stream(device)
        options.device_update_stream = self.update_stream.cuda_stream
        array = (HostTierTensor * max(len(tensors), 1))(*tensors)
        try:
            check(lib.emsa_host_tier_create(self.updater, array, len(tensors), len(buckets),
                                            group_count, self.d2h.cuda_stream,
                                            self.h2d.cuda_stream, ctypes.byref(options),
                                            ctypes.byref(self.handle)))
        except BaseException:
            self.close()
            raise
        # Device memory the tier holds beside the plan's arenas: the GPU-updated buckets'
        # staging slots, as libemsa sizes them for these options (0 without such buckets).
        gpu = [t for t in tensors if t.device_update]
        self.staging_bytes = 0 if not gpu else int(lib.emsa_host_tier_stream_staging_bytes(
            ctypes.byref(options), gpu[0].update.state_dtype, max(t.update.numel for t in gpu)))
        # Buckets updated on the GPU: their gradients are read on update_stream.
        on_gpu = {int(t.bucket) for t in tensors if t.device_update}
        self.on_gpu = [b in on_gpu for b in range(len(buckets))]
        self.grad_arrays = [(ctypes.c_void_p * len(m))() for m in buckets]
        self.group_count = group_count
        self.tensor_count = len(tensors)
        self.gated = False  # the current step is gated
        self.awaiting = False  # ... and its release has not been given yet
        self.pending: set[int] = set()  # uploads the next forward has not waited for yet
        self.unreleased: set[int] = set()  # submitted in the current gated step, not released
        self._enqueued_seen = -1  # emsa_host_tier_copies_enqueued at the last look
        self.read = 0  # stats read so far (steps)
        bucket_of = {}
        for t, p in zip(tensors, params):
            bucket_of[id(p)] = int(t.bucket)
        self._bucket_of = bucket_of
        self._module_buckets: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.sharded = False  # FSDP2's all-gathers read this tier's shards (emsa._distributed.dtensor)
        self._compiled_warned = False
        self._hook = torch.nn.modules.module.register_module_forward_pre_hook(
            forward_pre_hook(self))

    # ---- per step ---------------------------------------------------------------------------
    def begin_step(self, hypers, gated: bool = False) -> None:
        """Waits for the previous step's CPU updates (normally long done), then takes each
        group's hyperparameters (a ctypes Hyperparams array); the step counts are the tier's own,
        per tensor. gated: the step's updates wait for release() (or are dropped by discard()).
        A gated step still waiting for its verdict (its pass or step() raised before it) is
        discarded first: nothing of it is applied."""
        self.discard()
        check(lib.emsa_host_tier_begin_step_gated(self.handle, hypers, self.group_count,
                                                  int(gated)))
        self.gated = gated
        self.awaiting = gated
        self._release_copied()  # all enqueued: begin_step waited for the worker

    def submit(self, b: int, grads: list[torch.Tensor | None],
               stream: torch.cuda.Stream) -> None:
        """Bucket b's gradients, final on `stream`; None for a tensor absent this step (no
        gradient: not copied, updated or uploaded, its step count stays)."""
        array = self.grad_arrays[b]
        on_gpu = self.on_gpu[b]
        # Its memory is reused only after what reads it has: the copy, or the device update.
        reader = self.update_stream if on_gpu else self.d2h
        for k, g in enumerate(grads):
            if g is None:
                array[k] = None
                continue
            array[k] = g.data_ptr()
            g.record_stream(reader)
        check(lib.emsa_host_tier_submit(self.handle, b, array, len(grads), stream.cuda_stream))
        # A gated step's uploads exist only after its release: nothing to wait for before.
        (self.unreleased if self.gated else self.pending).add(b)
        # Read later by the paced copies, or (gated) by the device-updated bucket's kernels,
        # enqueued only after the release: held until libemsa has enqueued them.
        if self.paced or (self.gated and on_gpu):
            self.held[b] = grads
            self._release_copied()

    def release(self, scalars, stream: torch.cuda.Stream) -> None:
        """The verdict of the current gated step, after the statistics finished on `stream`:
        the CPU updates (or skips the step) once the stream has reached this point."""
        check(lib.emsa_host_tier_release(self.handle, scalars, stream.cuda_stream))
        self.awaiting = False
        self.pending |= self.unreleased
        self.unreleased.clear()

    def discard(self) -> None:
        """The current gated step, if it still waits for its verdict, gets none (its pass was
        abandoned): skipped, nothing of it updated, no step count advanced."""
        if not self.awaiting:
            return
        check(lib.emsa_host_tier_release_values(self.handle, 1.0, 1))
        self.awaiting = False
        self.unreleased.clear()

    def read_steps(self) -> list[int]:
        """Each tensor's step count, tensor order of creation (after synchronize())."""
        out = (ctypes.c_int64 * max(self.tensor_count, 1))()
        check(lib.emsa_host_tier_read_steps(self.handle, out, self.tensor_count))
        return list(out[:self.tensor_count])

    def set_steps(self, steps: list[int]) -> None:
        """Each tensor's step count (load_state_dict), between steps (after synchronize())."""
        array = (ctypes.c_int64 * max(len(steps), 1))(*steps)
        check(lib.emsa_host_tier_set_steps(self.handle, array, len(steps)))

    def _release_copied(self) -> None:
        """Drops the gradients whose copies (or device updates) libemsa has enqueued (one cheap
        call unless some were enqueued since the last look)."""
        if not self.held:  # unpaced, or nothing waiting: no call at all
            return
        seen = lib.emsa_host_tier_copies_enqueued(self.handle)
        if seen == self._enqueued_seen:
            return
        self._enqueued_seen = seen
        for b in [b for b in self.held if lib.emsa_host_tier_bucket_copies_enqueued(
                self.handle, b) != 0]:
            del self.held[b]

    def wait_grads_copied(self, stream: torch.cuda.Stream) -> None:
        check(lib.emsa_host_tier_wait_grads_copied(self.handle, stream.cuda_stream))

    def wait(self, b: int, stream: torch.cuda.Stream) -> None:
        check(lib.emsa_host_tier_wait(self.handle, b, stream.cuda_stream))
        self.pending.discard(b)

    def wait_all(self, stream: torch.cuda.Stream) -> None:
        for b in sorted(self.pending):
            self.wait(b, stream)

    def buckets_of(self, params, bucket_of: dict[int, int] | None = None) -> tuple[int, ...]:
        """The buckets holding any of params (None entries skipped), sorted: looked up by id in
        bucket_of, by default the tier's own map of its tensors' parameters."""
        bucket_of = self._bucket_of if bucket_of is None else bucket_of
        found = {bucket_of.get(id(p)) for p in params if p is not None}
        found.discard(None)
        return tuple(sorted(found))

    def wait_pending(self, buckets, streams) -> None:
        """Each of those buckets still pending: every one of streams waits for its upload."""
        for b in buckets:
            if b in self.pending:
                for stream in streams:
                    self.wait(b, stream)

    @torch.compiler.disable
    def wait_all_compiled(self) -> None:
        """What a compiled forward waits for (forward_pre_hook): every pending upload, on the
        current stream, before the compiled region's first module. It runs eagerly, in
        torch.compile(model)'s wrapper or at a graph break. Under FSDP2 the host also waits for
        those uploads, because its all-gathers read the shards on streams of their own. Warns
        once: the uploads then overlap less of the forward than an eager forward's per-module
        waits let them."""
        if not self._compiled_warned:
            self._compiled_warned = True
            warnings.warn(
                "emsa: the model's forward runs under torch.compile, which traces module hooks: "
                "the host tier waits for all of its pending uploads at the compiled region's "
                "first module (one graph break) instead of per module, so the uploads overlap "
                "less of the forward (torch.compile the optimizer's step only, or leave the "
                "model eager, to keep the overlap)", RuntimeWarning, stacklevel=2)
        self._release_copied()
        current = torch.cuda.current_stream(self.device)
        self.wait_all(current)
        if self.sharded:
            current.synchronize()

    def _module_forward(self, module: torch.nn.Module) -> None:
        mine = self._module_buckets.get(module)
        if mine is None:
            mine = self._module_buckets[module] = self.buckets_of(module._parameters.values())
        if mine:
            self.wait_pending(mine, (torch.cuda.current_stream(self.device),))

    def synchronize(self) -> None:
        """The host waits until every update is done and its parameters are on the device;
        the current stream then sees them too."""
        check(lib.emsa_host_tier_synchronize(self.handle))
        self._release_copied()
        self.wait_all(torch.cuda.current_stream(self.device))

    def stats(self) -> list[dict]:
        """Measurements of the steps not read before (call synchronize() first)."""
        out = []
        while True:
            chunk = (HostTierStepStats * 64)()
            for s in chunk:
                lib.emsa_host_tier_step_stats_init(ctypes.byref(s))
            n = ctypes.c_size_t()
            check(lib.emsa_host_tier_stats(self.handle, self.read + 1, chunk, 64,
                                           ctypes.byref(n)))
            for s in chunk[:n.value]:
                if not s.complete and s.buckets:
                    return out  # the rest is still running
                out.append({"step": s.step, "d2h_s": s.d2h_s, "cpu_s": s.cpu_s,
                            "h2d_s": s.h2d_s, "wait_s": s.wait_s, "buckets": s.buckets,
                            "grad_wait_s": s.grad_wait_s, "worker_s": s.worker_s,
                            "device_buckets": s.device_buckets, "stream_up_s": s.stream_up_s})
                self.read = s.step
            if n.value < 64:
                return out

    def trace(self) -> list[tuple[float, float, float]]:
        """The current step per bucket: (submitted, CPU start, CPU end), seconds since the
        step began on the host, -1 where not reached."""
        n = len(self.buckets)
        arrays = [(ctypes.c_double * n)() for _ in range(3)]
        check(lib.emsa_host_tier_trace(self.handle, *arrays, n))
        return list(zip(*[list(a) for a in arrays]))

    def close(self) -> None:
        hook = getattr(self, "_hook", None)
        if hook is not None:
            hook.remove()
            self._hook = None
        handle, self.handle = self.handle, ctypes.c_void_p()
        if handle:
            lib.emsa_host_tier_destroy(handle)  # waits for the worker's queue
        self.held = {}
        updater, self.updater = self.updater, ctypes.c_void_p()
        if updater:
            lib.emsa_cpu_updater_destroy(updater)
