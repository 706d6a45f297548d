"""emsa.probe(): one eager forward and backward on the user's batch, observed through hooks:
per parameter its first use in forward, its module's call count, when its gradient became
final, and device memory at module boundaries (torch.fx adds a graph where the model traces).
It leaves parameters, .grad, buffers, RNG states and train/eval mode exactly as it found them;
docs/usage.md ("Probing") says what it measures and what it does not restore.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
import weakref
from collections.abc import Mapping
from typing import Any, Callable

import torch

from . import _progress
from ._distributed import dtensor as _dtensor
from ._engine.params import DTYPE_NAMES, check_param
from ._native import profile_cache as _profile_cache
from ._native.host_load import host_load
from ._native.library import EmsaError
from ._native.planner import measure_profile, profile_json, require_library
from .probe_record import GraphOp, MemorySample, ParamRecord, ProbeRecord

__all__ = ["probe", "default_loss"]

_log = logging.getLogger("emsa")


def default_loss(output: Any) -> torch.Tensor:
    """The scalar the probe differentiates when no loss_fn is given.

    A scalar tensor is used as is; a Hugging Face output (or any mapping or object) with a
    non-None `loss` gives that; otherwise the sum of every floating-point tensor in the output
    (nested tuples, lists and mappings included), in float32. A sum reaches every parameter the
    output depends on, which is all the probe needs: it observes timing, not learning.
    """
    if isinstance(output, torch.Tensor) and output.dim() == 0:
        return output
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    tensors = [t for t in _flatten(output) if t.is_floating_point() and t.requires_grad]
    if not tensors:
        raise ValueError("emsa.probe: the model's output holds no floating-point tensor that "
                         "requires grad; pass loss_fn=lambda out: <a scalar loss>")
    return sum(t.float().sum() for t in tensors)


def _flatten(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, Mapping):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in _flatten(item)]
    return []


class _Clock:
    """Marks on the host clock (CPU) or as CUDA events (GPU: no sync until the end)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.marks: list[Any] = []

    def mark(self) -> int:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())
        return len(self.marks) - 1

    def resolve(self) -> list[float]:
        """Seconds since the first mark, for every mark."""
        if self.cuda and self.marks:
            torch.cuda.synchronize(self.device)
            return [max(0.0, self.marks[0].elapsed_time(e) / 1000.0) for e in self.marks]
        return [max(0.0, t - self.marks[0]) for t in self.marks]


def _memory(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def _model_device(params: list[torch.Tensor]) -> torch.device:
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise ValueError("emsa.probe: the model's parameters are on several devices ("
                         + ", ".join(sorted(str(d) for d in devices))
                         + "); emsa plans one device per optimizer: move the model to one device")
    return devices.pop() if devices else torch.device("cpu")


@contextlib.contextmanager
def _preserved_state(model: torch.nn.Module, params: list[torch.Tensor]):
    """Grads detached (so the probe's backward cannot accumulate into them) and buffers and RNG
    snapshotted; everything put back exactly on exit, error or not."""
    grads = [p.grad for p in params]
    buffers = [(m, name, b, b.detach().clone()) for m in model.modules()
               for name, b in m._buffers.items() if b is not None]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    for p in params:
        p.grad = None
    try:
        yield
    finally:
        for p, g in zip(params, grads):
            p.grad = g
        with torch.no_grad():
            for m, name, b, saved in buffers:
                if m._buffers.get(name) is not b:  # a forward that rebinds instead of mutating
                    m._buffers[name] = b
                b.copy_(saved)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


def probe(model: torch.nn.Module, *example_args: Any, loss_fn: Callable[[Any], torch.Tensor]
          | None = None, profile: Any = None, trace: bool = True, warmup: bool = True,
          under_load: bool | None = None, **example_kwargs: Any) -> ProbeRecord:
    """Runs model(*example_args, **example_kwargs), then backward of loss_fn(output), without
    updating anything, and returns what it observed (docs/usage.md, "Probing").

    Args:
        model (nn.Module): the model, on the device it trains on
        example_args, example_kwargs: one real batch, as the model's forward takes it
        loss_fn (callable, optional): output -> scalar loss (default: default_loss)
        profile (dict, str or path, optional): the DeviceProfile to embed (default: None:
            this machine's, bandwidths from its profile cache, measured when it has none)
        trace (bool, optional): add the torch.fx graph where the model traces (default: True)
        warmup (bool, optional): on a GPU, one unobserved pass first, and unobserved passes
            after the observed one that its times are rescaled to (default: True)
        under_load (bool, optional): on a GPU, time forward and backward again under the host
            tier's load (record.period_under_load); None: only when the optimizer state would
            not fit the device beside the model's peak (default: None)

    record.setup_times holds the seconds of each phase ("profile", "passes", "trace",
    "under_load"); record.profile_source where the profile came from.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"emsa.probe takes an nn.Module, not {type(model).__name__}")
    require_library()
    named = list(model.named_parameters())
    params = [p for _, p in named]
    device = _model_device(params)
    for name, p in named:
        check_param(name, p)
    names_of: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
    owners: dict[int, list[torch.nn.Module]] = {}
    for _, m in model.named_modules(remove_duplicate=False):
        for p in m._parameters.values():
            if p is not None and m not in owners.setdefault(id(p), []):
                owners[id(p)].append(m)

    times: dict[str, float] = {}
    with _progress.setup("emsa.probe"):
        with _progress.timed("profile", times):
            profile_dict, source = _profile(profile, device)
        obs = _Observer(model, named, names_of, owners, device)
        run = _Passes(model, loss_fn or default_loss, example_args, example_kwargs,
                      [p for p in params if p.requires_grad], device)
        with _preserved_state(model, params):
            record = _observe(run, obs, trace, warmup and device.type == "cuda", names_of, times)
            if warmup and device.type == "cuda" and _wants_load(under_load, run, record):
                with _progress.timed("under_load", times):
                    record.period_under_load = _period_under_load(run)
    record.profile = profile_dict
    record.setup_times = times
    record.profile_source = source
    return record


def _observe(run: "_Passes", obs: "_Observer", trace: bool, timed: bool,
             names_of: dict[int, list[str]], times: dict[str, float]) -> ProbeRecord:
    """The warm-up pass, the graph, the observed pass and the unobserved ones it is rescaled to."""
    first = None
    if timed:
        with _progress.timed("passes", times):
            first = run.timed()
    with _progress.timed("trace", times):
        # torch.fx calls submodules on their own, which FSDP2 refuses (its root runs first).
        sharded = any(_dtensor.is_dtensor(p) for p in run.targets)
        graph = _trace_graph(run.model, names_of) if trace and not sharded else []
    with _progress.timed("passes", times):
        with obs.installed():
            record = obs.run(run.loss_fn, run.args, run.kwargs)
        if timed:
            forward, backward = _settled_pass(run, 2, ALONE_PASSES, first)
            _rescale(record, forward, backward)
    record.graph = graph
    return record


class _Passes:
    """The model's forward and backward on the example batch, run unobserved."""

    def __init__(self, model, loss_fn, args, kwargs, targets: list[torch.Tensor], device):
        self.model, self.loss_fn, self.args, self.kwargs = model, loss_fn, args, kwargs
        self.targets, self.device = targets, device

    def timed(self) -> tuple[float, float]:
        return _timed_pass(self.model, self.loss_fn, self.args, self.kwargs, self.targets,
                           self.device)


def _timed_pass(model, loss_fn, args, kwargs, targets, device) -> tuple[float, float]:
    """Forward and backward seconds of one pass with nothing observing it."""
    clock = _Clock(device)
    clock.mark()
    loss = loss_fn(model(*args, **kwargs))
    clock.mark()
    if targets and isinstance(loss, torch.Tensor) and loss.requires_grad:
        _dtensor.backward(loss, targets)
    clock.mark()
    del loss
    for p in targets:
        p.grad = None
    # Under the caller's autocast, the casts of the weights are cached for the whole context:
    # the observed pass would reuse this pass's cast nodes, and the order in which gradients
    # become final would be wrong (the casts' leaves all at once). Make it cast anew.
    torch.clear_autocast_cache()
    _, forward, end = clock.resolve()
    return forward, end - forward


# Passes timed alone and under the host tier's load stop once one more pass moves the median
# (the training step is a median over steps) by no more than SETTLED of it; under load one pass
# can take twice another, so at least LOADED_LEAST are run.
SETTLED = 0.05
ALONE_PASSES = 3  # at most, after the observed pass
LOADED_PASSES = 9  # at most
LOADED_LEAST = 3


def _median(passes: list[tuple[float, float]]) -> tuple[float, float]:
    """The pass with the median forward + backward (the faster middle one of an even count)."""
    ordered = sorted(passes, key=sum)
    return ordered[(len(ordered) - 1) // 2]


def _settled_pass(run: _Passes, least: int, most: int,
                  first: tuple[float, float] | None = None) -> tuple[float, float]:
    """The median pass of at least `least` (counting `first`, a pass timed before) and at most
    `most` new ones, stopping once the newest moved the median by at most SETTLED."""
    passes = [first] if first is not None else []
    for _ in range(most):
        passes.append(run.timed())
        if len(passes) >= max(least, 2):
            now, before = sum(_median(passes)), sum(_median(passes[:-1]))
            if abs(now - before) <= SETTLED * now:
                break
    return _median(passes)


# The optimizer state the host tier would take: two fp32 moments, and an fp32 master copy for
# parameters of 16 bits. It "fits with room" when it fits beside the probed peak, a margin (the
# planner's default safety margin) and a tenth of the device for fragmentation.
_STATE_MARGIN = 1 << 30


def _wants_load(under_load: bool | None, run: _Passes, record: ProbeRecord) -> bool:
    """Whether to time the passes under the host tier's load (see probe's under_load)."""
    if under_load is not None:
        return bool(under_load)
    state = sum(p.numel() * (8 if p.dtype == torch.float32 else 12) for p in run.targets)
    free, total = torch.cuda.mem_get_info(run.device)
    # What this process can have: what the driver has free and what torch's pool holds (the
    # probed peak, which counts the parameters and gradients, lies within it).
    capacity = free + torch.cuda.memory_reserved(run.device)
    fits = record.peak_device_bytes + state + _STATE_MARGIN + total // 10 <= capacity
    if fits:
        _log.info("emsa.probe: not timed under the host tier's load: the optimizer state "
                  "(%.1f GiB) fits the device beside the model's peak (%.1f GiB) with room; "
                  "probe(..., under_load=True) times it for plans with budget= or tier='host'",
                  state / 2**30, record.peak_device_bytes / 2**30)
    return not fits


def _period_under_load(run: _Passes) -> float:
    """Forward + backward seconds while emsa::HostLoad runs: the settled median of
    LOADED_LEAST..LOADED_PASSES passes (the training step under load is an average, not a best
    case)."""
    device = run.device
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        with host_load(index):
            forward, backward = _settled_pass(run, LOADED_LEAST, LOADED_PASSES)
    except EmsaError as e:  # e.g. no room for its buffers on a full device: said, not hidden
        warnings.warn(f"emsa.probe: forward and backward not timed under the host tier's load "
                      f"({e}); plans will assume that load does not slow them "
                      f"(probe(..., under_load=False) skips this)", stacklevel=3)
        return 0.0
    return forward + backward


def _rescale(record: ProbeRecord, forward: float, backward: float) -> None:
    """Maps the observed pass's times onto the unobserved durations: forward times by one
    factor, backward times by another. Durations only shrink (the hooks can only add time; a
    slower unobserved pass is noise)."""
    f0, b0 = record.forward_time, record.backward_time
    f = min(forward, f0) if forward > 0 else f0
    b = min(backward, b0) if backward > 0 else b0

    def scale(t: float) -> float:
        if t <= f0:
            return t * (f / f0) if f0 > 0 else t
        return f + (t - f0) * (b / b0 if b0 > 0 else 1.0)

    for p in record.params:
        p.forward_time = scale(p.forward_time)
        if p.grad_ready_order >= 0:
            p.grad_ready_time = scale(p.grad_ready_time)
    for m in record.memory:
        m.time = scale(m.time)
    record.forward_time, record.backward_time = f, b


class _Observer:
    """The hooks, what they saw, and the record made from it."""

    def __init__(self, model, named, names_of, owners, device):
        self.model, self.named, self.names_of = model, named, names_of
        self.owners, self.device = owners, device
        self.clock = _Clock(device)
        self.module_names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
        self.holders = _dtensor.holder_ids(model)  # FSDP2: forwards read unsharded copies
        self.calls: dict[int, int] = {}
        self.first_use: dict[int, int] = {}  # id(param) -> mark
        self.use_order: list[int] = []
        self.grad_mark: dict[int, int] = {}
        self.grad_order: list[int] = []
        self.samples: list[tuple[str, str, int, int]] = []  # module, event, mark, bytes
        self.in_backward = False
        self.forward_start = self.forward_end = self.backward_end = 0
        self.memory_before = _memory(device)

    def _pre(self, module, _args):
        if self.in_backward:  # activation checkpointing re-runs forwards in backward
            return
        mark = self.clock.mark()
        self.calls[id(module)] = self.calls.get(id(module), 0) + 1
        for key, p in module._parameters.items():
            pid = self.holders.get((id(module), key), id(p)) if p is not None else None
            if pid is not None and pid not in self.first_use:
                self.first_use[pid] = mark
                self.use_order.append(pid)
        self.samples.append((self.module_names.get(id(module), ""), "forward_pre", mark,
                             _memory(self.device)))

    def _post(self, module, _args, _out):
        if self.in_backward:
            return
        self.samples.append((self.module_names.get(id(module), ""), "forward_post",
                             self.clock.mark(), _memory(self.device)))

    def _grad_ready(self, p):
        if id(p) in self.grad_mark:
            return
        mark = self.clock.mark()
        self.grad_mark[id(p)] = mark
        self.grad_order.append(id(p))
        owner = self.owners.get(id(p), [None])[0]
        self.samples.append((self.module_names.get(id(owner), ""), "backward_post", mark,
                             _memory(self.device)))

    def run(self, loss_fn, args, kwargs) -> ProbeRecord:
        self.forward_start = self.clock.mark()
        output = self.model(*args, **kwargs)
        self.forward_end = self.clock.mark()
        self.in_backward = True
        loss = loss_fn(output)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError("emsa.probe: loss_fn must return a scalar tensor")
        # inputs= keeps the backward from accumulating into anything but the parameters (an
        # input tensor that requires grad keeps its .grad).
        targets = [p for _, p in self.named if p.requires_grad]
        if targets and loss.requires_grad:
            _dtensor.backward(loss, targets)
        self.backward_end = self.clock.mark()
        return self.record()

    @contextlib.contextmanager
    def installed(self):
        handles = []
        try:
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
                self.memory_before = _memory(self.device)
            for m in self.model.modules():
                handles.append(m.register_forward_pre_hook(self._pre))
                handles.append(m.register_forward_hook(self._post))
            for _, p in self.named:
                if p.requires_grad:
                    handles.append(p.register_post_accumulate_grad_hook(self._grad_ready))
            yield
        finally:
            for h in handles:
                h.remove()

    def record(self) -> ProbeRecord:
        peak = (torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda"
                else 0)
        times = self.clock.resolve()
        use_rank = {pid: r for r, pid in enumerate(self.use_order)}
        grad_rank = {pid: r for r, pid in enumerate(self.grad_order)}
        params = []
        for name, p in self.named:
            pid = id(p)
            shard = _dtensor.local(p)  # a DTensor (FSDP2) is planned as this rank's shard
            shape = list(shard.shape)
            use_count = sum(self.calls.get(id(m), 0) for m in self.owners.get(pid, []))
            params.append(ParamRecord(
                name=name,
                module=name.rsplit(".", 1)[0] if "." in name else "",
                shape=shape,
                dtype=DTYPE_NAMES[p.dtype],
                numel=shard.numel(),
                bytes=shard.numel() * shard.element_size(),
                trainable=p.requires_grad,
                tied_names=[n for n in self.names_of[pid] if n != name],
                use_count=use_count,
                forward_order=use_rank.get(pid, -1),
                forward_time=times[self.first_use[pid]] if pid in self.first_use else 0.0,
                grad_ready_order=grad_rank.get(pid, -1),
                grad_ready_time=times[self.grad_mark[pid]] if pid in self.grad_mark else 0.0,
            ))
        forward_time = times[self.forward_end]
        record = ProbeRecord(
            model=type(self.model).__name__,
            device=str(self.device),
            forward_time=forward_time,
            backward_time=max(0.0, times[self.backward_end] - forward_time),
            peak_device_bytes=peak,
            activation_peak_bytes=max(0, peak - self.memory_before),
            params=params,
            memory=[MemorySample(mod, ev, times[mark], min(b, peak))
                    for mod, ev, mark, b in self.samples],
        )
        record.tensors = [weakref.ref(p) for _, p in self.named]
        return record


def _profile(profile: Any, device: torch.device) -> tuple[dict[str, Any], str]:
    """The profile to embed and where its bandwidths came from ("" when given)."""
    import json

    if profile is not None:
        return json.loads(profile_json(profile)), ""
    gpu = device.index if device.type == "cuda" and device.index is not None else 0
    try:
        measured = _profile_cache.cached_profile(gpu)
        return measured["profile"], _profile_cache.source_line(measured)
    except RuntimeError as e:  # e.g. too little free device memory for the bandwidth test
        warnings.warn(f"emsa.probe: measuring bandwidths failed ({e}); the profile holds the "
                      "device description only", stacklevel=3)
        return measure_profile(measure_bandwidth=False, gpu_device=gpu), "description only"


def _trace_graph(model: torch.nn.Module, names_of: dict[int, list[str]]) -> list[GraphOp]:
    """Ops in topological order with the parameters each reads, when torch.fx traces the model.
    Never required: any failure (data-dependent control flow, unsupported ops) gives []."""
    if type(model).__module__.startswith("transformers."):
        return []  # transformers 5 dropped fx support; tracing would only fail slowly
    known = {n for names in names_of.values() for n in names}
    try:
        import torch.fx

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            gm = torch.fx.symbolic_trace(model)
    except Exception:  # noqa: BLE001 - any tracing failure means "no graph", never an error
        return []
    ops: list[GraphOp] = []
    index: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        params: list[str] = []
        if node.op == "call_module":
            sub = gm.get_submodule(node.target)
            params = [f"{node.target}.{n}" for n, _ in sub.named_parameters()]
        elif node.op == "get_attr":
            params = [node.target]
        params = list(dict.fromkeys(n for n in params if n in known))
        inputs = sorted({index[a.name] for a in node.all_input_nodes if a.name in index})
        index[node.name] = len(ops)
        ops.append(GraphOp(name=node.name, params=params, inputs=inputs))
    return ops
