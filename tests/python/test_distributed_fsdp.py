"""emsa under FSDP2 (torch.distributed.fsdp.fully_shard) and torch.distributed.checkpoint (DCP).

CPU, gloo, 2 processes, fp32, 20 steps of a small MLP whose last layer has one output (its
shard on rank 1 is empty: FSDP2 shards dim 0 unevenly) and no bias without a true gradient:
- FSDP2 + emsa.AdamW equals FSDP2 + torch.optim.AdamW (1e-6 relative), in step() mode and with
  updates in backward (FSDP2 calls the sharded parameters' post-accumulate-grad hooks after
  its reduce-scatter), with and without max_grad_norm=1.0 (against clip_grad_norm_ on the
  DTensor gradients: the norm is the whole model's, and clipping fires);
- the sharded parameters each FSDP unit's pre-forward reads (what the host tier's per-unit
  forward waits wait for) are its own and its forward-prefetch targets', and cover the model;
- DCP: saved at step 10, loaded by fresh processes, continued to 20: bitwise the uninterrupted
  run (and within 1e-6 of torch.optim's); the 2-rank checkpoint loaded into 1 rank (a plain
  model) with emsa and with torch.optim.AdamW continues within 1e-6 of the uninterrupted 2-rank
  runs, emsa's and torch.optim's.

CUDA (world size 1, NCCL, the same MLP, batches and wrapping, on the GPU), in one process: per
variant (step(), in backward, clipped in backward, the root unit holding parameters) FSDP2 +
emsa.AdamW with tier="host" and with tier="device" each equals FSDP2 + torch.optim.AdamW within
1e-4 of how far training moved each parameter (far less than one update: torch's run one step
short, and the initial parameters, are checked to fail it), no gradient is left after a
backward, and the two tiers are bitwise equal (losses every step, parameters at the end): a
forward that read a shard before its upload, or a gradient released before its copy, changes
bits. The plans' buckets are cut at 2 KiB of parameters (the default 32 MiB would make the MLP one
bucket), so the host tier has several and each unit's forward waits for its own uploads while
the later units' may still be pending.

The ranks are started by tests/python/dist_util.py (a fresh process group per run; a hang fails
the test at its timeout).
"""

from __future__ import annotations

import pytest
import torch

import dist_util

STEPS, SAVE_AT, TIMEOUT_S = 20, 10, 120
GLOBAL_BATCH, IN, HIDDEN = 8, 16, 33


def _missing() -> str:
    """Why this torch cannot run these tests ("" when it can)."""
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        return "torch.distributed with gloo is not available"
    try:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict  # noqa
        from torch.distributed.fsdp import fully_shard  # noqa
    except ImportError as e:
        return f"this torch lacks FSDP2 or DCP's state_dict API ({e})"
    return ""


# ---- one rank ----------------------------------------------------------------------------------
def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(),
                               torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh(),
                               torch.nn.Linear(HIDDEN, 1))


def _batch(step: int, rank: int, world: int):
    """The global batch of a step, the same whatever the world size; this rank's rows."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, IN, generator=g)
    y = 3.0 * torch.randn(GLOBAL_BATCH, 1, generator=g)
    rows = GLOBAL_BATCH // world
    return x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]


def _optimizer(cfg: dict, model: torch.nn.Module, rank: int, world: int):
    hyper = dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
    if cfg["opt"] == "torch":
        return torch.optim.AdamW(model.parameters(), foreach=False, **hyper)
    import emsa

    record = None
    if cfg.get("probe"):
        record = emsa.probe(model, _batch(0, rank, world)[0], warmup=False)
        # Planned per rank: each entry is this rank's shard, in the order FSDP2 ran them.
        shards = [list(p._local_tensor.shape) for p in model.parameters()]
        assert [r.shape for r in record.params] == shards, (record.params, shards)
        assert sorted(r.grad_ready_order for r in record.params) == list(range(len(shards)))
        assert sorted(r.forward_order for r in record.params) == list(range(len(shards)))
    return emsa.AdamW(model.parameters(), **hyper, max_grad_norm=cfg.get("clip"),
                      step_in_backward=cfg.get("in_backward", False), probe=record,
                      tier=cfg.get("tier"))


def _state(model, opt):
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                         get_optimizer_state_dict)

    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}


def _train(ctx, cfg: dict) -> dict:
    """Trains the MLP on ctx.device (sharded by FSDP2 unless cfg["fsdp"] is False; cfg
    ["root_keeps"]: the root unit holds the first and last Linear) to cfg["stop"] steps, from
    the checkpoint cfg["load"] if given, saving one at cfg["save_at"]; returns the full
    parameters before and after, the losses, the gradient norms, which sharded parameters'
    storage moved and (updates in backward) which held a gradient after a backward."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (set_model_state_dict,
                                                         set_optimizer_state_dict)

    rank, world = ctx.rank, ctx.world_size
    model = _model().to(ctx.device)
    if cfg.get("fsdp", True):
        # The mesh on the ranks' own device: fully_shard's default mesh is the accelerator's
        # when one exists, which would move a CPU (gloo) run's model to the GPU.
        from torch.distributed.device_mesh import init_device_mesh
        _shard_mlp(model, init_device_mesh(ctx.device.type, (world,)),
                   cfg.get("root_keeps", False))
    init = _full_params(model)
    opt = _optimizer(cfg, model, rank, world)
    start = 0
    if cfg.get("load"):
        before = [p.detach().clone() for p in model.parameters()]
        # With no state yet, get_optimizer_state_dict runs step() at lr=0 on zero gradients
        # (torch's _init_optim_state): as torch, the counts become 1, nothing else moves.
        state = _state(model, opt)
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
        assert {float(st["step"]) for st in opt.state_dict()["state"].values()} == {1.0}
        dcp.load(state, checkpoint_id=cfg["load"])
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, opt, state["optim"])
        start = SAVE_AT
    norms, losses, held = [], [], set()
    ptrs = [_local(p).data_ptr() for p in model.parameters()]
    for step in range(start, cfg.get("stop", STEPS)):
        x, y = (t.to(ctx.device) for t in _batch(step, rank, world))
        if cfg.get("accumulate"):  # two micro-batches, the first without reduce-scatter
            model.set_requires_gradient_sync(False)
            torch.nn.functional.mse_loss(model(x[::2]), y[::2]).backward()
            model.set_requires_gradient_sync(True)
            x, y = x[1::2], y[1::2]
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        losses.append(loss.detach())
        if cfg.get("in_backward"):
            held |= {n for n, p in model.named_parameters() if p.grad is not None}
        if cfg["opt"] == "torch" and cfg.get("clip"):
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["clip"])
            norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        opt.step()
        if cfg["opt"] == "emsa" and cfg.get("clip"):
            norms.append(opt.last_grad_norm)
        opt.zero_grad()
        if step + 1 == cfg.get("save_at"):
            dcp.save(_state(model, opt), checkpoint_id=cfg["save"])
    if cfg["opt"] == "emsa":
        opt.synchronize()  # the host tier's last uploads, before reading outside a forward
    moved = [n for (n, p), q in zip(model.named_parameters(), ptrs) if _local(p).data_ptr() != q]
    host = getattr(getattr(getattr(opt, "_bound", None), "engine", None), "host", None)  # emsa's CUDA host tier
    return {"init": init, "params": _full_params(model), "moved": moved,
            "losses": torch.stack(losses).cpu() if losses else torch.zeros(0),
            "norms": norms, "held": sorted(held), "clip_count": getattr(opt, "clip_count", None),
            "host_buckets": 0 if host is None else len(host.buckets)}


def _local(p: torch.Tensor) -> torch.Tensor:
    return p._local_tensor if hasattr(p, "_local_tensor") else p


def _full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each parameter whole (a DTensor gathered), a copy."""
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}


def _shard_mlp(model: torch.nn.Module, mesh=None, root_keeps: bool = False) -> None:
    """fully_shard on each Linear (but the first and last with root_keeps: the root unit then
    holds parameters of its own), then on the root."""
    from torch.distributed.fsdp import fully_shard

    linears = [m for m in model if isinstance(m, torch.nn.Linear)]
    for layer in linears[1:-1] if root_keeps else linears:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _unit_reads(ctx, cfg: dict) -> None:
    """Each FSDP unit's pre-forward is found to read exactly the sharded parameters of its own
    subtree (less nested units') and of the units it prefetches, and every parameter is read
    by some unit: the host tier's per-unit forward waits (emsa._distributed.dtensor.forward_waits) leave
    none unwaited."""
    from torch.distributed.device_mesh import init_device_mesh

    from emsa._distributed import dtensor as _dtensor

    model = _model()
    _shard_mlp(model, init_device_mesh(ctx.device.type, (ctx.world_size,)), cfg["root_keeps"])
    units = [m for m in model.modules() if _dtensor._fsdp_state(m) is not None]
    if cfg["prefetch"]:  # the root all-gathers the last unit at its own pre-forward
        units[0].set_modules_to_forward_prefetch([units[-1]])

    def own(unit):  # its subtree's parameters, less those of nested units
        nested = {id(p) for m in unit.modules() if m is not unit and m in units
                  for p in m.parameters()}
        return {id(p) for p in unit.parameters()} - nested

    covered = set()
    for k, unit in enumerate(units):
        found = _dtensor.reads(unit)
        assert found is not None, f"unit {k}: this torch's FSDP internals were not found"
        params, state = found
        assert state is not None and all(_dtensor.is_dtensor(p) for p in params)
        want = own(unit) | (own(units[-1]) if cfg["prefetch"] and k == 0 else set())
        assert {id(p) for p in params} == want, f"unit {k}"
        covered |= want
    assert covered == {id(p) for p in model.parameters()}
    assert _dtensor.reads(model[1]) == ([], None)  # a plain module without parameters


class _FakeTier:
    """What forward_waits' hook uses of a HostTier: pending buckets, and the waits issued
    (which buckets a module reads, and which of them it waits for, are HostTier's own)."""

    device = None

    def __init__(self):
        self.pending: set[int] = set()
        self.waits: list[tuple[int, object]] = []
        self.waited_all = 0

    def wait(self, b, stream):
        self.waits.append((b, stream))
        self.pending.discard(b)

    def wait_all(self, stream):
        self.waited_all += 1
        self.pending.clear()

    def buckets_of(self, params, bucket_of):
        from emsa._native.host_tier import HostTier
        return HostTier.buckets_of(self, params, bucket_of)

    def wait_pending(self, buckets, streams):
        from emsa._native.host_tier import HostTier
        HostTier.wait_pending(self, buckets, streams)


def _hook_waits(ctx, cfg: dict) -> None:
    """forward_waits' hook on a CPU FSDP2 model, each parameter its own bucket of a fake tier,
    the CUDA current stream a stand-in: when FSDP's own pre-forward of a unit starts, the
    unit's buckets (and its prefetch targets') have been waited for on the current stream and
    on both all-gather streams, and the buckets of the units that run later are still pending
    (the forward does not wait for every upload at its start). A forward prefetch is set
    after the hook has seen a forward without it."""
    from unittest import mock

    from torch.distributed.device_mesh import init_device_mesh

    from emsa._distributed import dtensor as _dtensor

    model = _model()
    _shard_mlp(model, init_device_mesh(ctx.device.type, (ctx.world_size,)), cfg["root_keeps"])
    units = [m for m in model.modules() if _dtensor._fsdp_state(m) is not None]
    x, y = _batch(0, ctx.rank, ctx.world_size)
    bucket = {id(p): b for b, p in enumerate(model.parameters())}
    tier = _FakeTier()
    hook = torch.nn.modules.module.register_module_forward_pre_hook(
        _dtensor._UploadWaits(tier, bucket))
    for _ in range(2):  # the first: FSDP's lazy init (its streams; the hook waits for all)
        tier.pending = set(bucket.values())
        with mock.patch.object(torch.cuda, "current_stream", lambda device=None: "current"):
            torch.nn.functional.mse_loss(model(x), y).backward()
        model.zero_grad()
    tier.waits.clear()
    tier.waited_all = 0
    if cfg["prefetch"]:
        units[0].set_modules_to_forward_prefetch([units[-1]])
    mine = {u: {bucket[id(p)] for p in _dtensor.reads(u)[0]} for u in units}
    order = []

    def before_fsdp(unit, args):  # prepended after fully_shard: runs before FSDP's pre-forward
        order.append(unit)
        assert not mine[unit] & tier.pending, f"unit {units.index(unit)}: not waited"
        later = set().union(*(mine[u] for u in units if u not in order)) - set().union(
            *(mine[u] for u in order))
        assert later <= tier.pending, f"unit {units.index(unit)}: later units' waited"

    handles = [u.register_forward_pre_hook(before_fsdp, prepend=True) for u in units]
    comm = units[0]._get_fsdp_state()._comm_ctx
    streams = {"current", comm.all_gather_copy_in_stream, comm.all_gather_stream}
    try:
        tier.pending = set(bucket.values())
        with mock.patch.object(torch.cuda, "current_stream", lambda device=None: "current"):
            model(x)
    finally:
        hook.remove()
        for h in handles:
            h.remove()
    assert tier.waited_all == 0 and not tier.pending
    for b in bucket.values():
        assert {s for c, s in tier.waits if c == b} == streams, f"bucket {b}"
    assert len(order) == len(units)


def _opaque_waits(ctx) -> None:
    """Where FSDP's internals are not what forward_waits reads, the root unit's pre-forward
    waits for every pending upload before FSDP's own pre-forward (the rule before per-unit
    waits: slower, never wrong)."""
    from unittest import mock

    from torch.distributed.device_mesh import init_device_mesh

    from emsa._distributed import dtensor as _dtensor

    model = _model()
    _shard_mlp(model, init_device_mesh(ctx.device.type, (ctx.world_size,)))
    x, y = _batch(0, ctx.rank, ctx.world_size)
    torch.nn.functional.mse_loss(model(x), y).backward()  # FSDP's lazy init
    tier = _FakeTier()
    tier.pending = {b for b, _ in enumerate(model.parameters())}
    pending_at_root = []
    model.register_forward_pre_hook(lambda m, a: pending_at_root.append(set(tier.pending)),
                                    prepend=True)
    hook = torch.nn.modules.module.register_module_forward_pre_hook(_dtensor._UploadWaits(
        tier, {id(p): b for b, p in enumerate(model.parameters())}))
    try:
        with mock.patch.object(torch.cuda, "current_stream", lambda device=None: "current"), \
                mock.patch.object(_dtensor, "_unit_params", side_effect=AttributeError("x")):
            model(x)
    finally:
        hook.remove()
    assert pending_at_root == [set()] and tier.waited_all == 1


CUDA_VARIANTS = {  # the emsa runs' options; torch.optim's run has the same clip and wrapping
    "step": {},
    "in_backward": {"in_backward": True},
    "clipped_in_backward": {"in_backward": True, "clip": 1.0},
    "in_backward_root_holds": {"in_backward": True, "root_keeps": True},
}
# Of how far training moved each parameter (max |final - initial|): a step is at most about a
# twentieth of that after STEPS steps, so a missing or stale update fails by far.
CUDA_RTOL = 1e-4
CUDA_BUCKET_BYTES = 2048  # the hidden weights each a bucket of their own


def _small_buckets(plan_options):
    """emsa._native.planner._plan_options with buckets of CUDA_BUCKET_BYTES."""
    def options(*args, **kwargs):
        out = plan_options(*args, **kwargs)
        out.bucket_bytes = CUDA_BUCKET_BYTES
        return out
    return options


def _cuda_checks(ctx) -> dict[str, str]:
    """World size 1, NCCL, every variant in this one process (module docstring): FSDP2 +
    torch.optim.AdamW, and FSDP2 + emsa.AdamW with tier="host" and tier="device". Returns per
    variant what failed its checks ("" when nothing did), so each variant is its own test."""
    from unittest import mock

    from emsa._native import planner

    refs, verdicts = {}, {}
    small = mock.patch.object(planner, "_plan_options", _small_buckets(planner._plan_options))
    for name, cfg in CUDA_VARIANTS.items():
        same = {k: cfg[k] for k in ("clip", "root_keeps") if k in cfg}
        key = tuple(sorted(same.items()))
        if key not in refs:  # torch.optim's run, and the same one step short
            refs[key] = [_train(ctx, {"opt": "torch", **same, "stop": stop})
                         for stop in (STEPS, STEPS - 1)]
        with small:
            runs = {tier: _train(ctx, {"opt": "emsa", "tier": tier, **cfg})
                    for tier in ("host", "device")}
        try:
            _check_cuda_variant(cfg, *refs[key], runs)
            verdicts[name] = ""
        except AssertionError as e:
            verdicts[name] = str(e) or "an assertion failed"
    return verdicts


def _check_cuda_variant(cfg: dict, ref: dict, short: dict, runs: dict) -> None:
    """The checks of one variant (module docstring): torch.optim's runs ref and short (one step
    fewer), emsa's by tier."""
    init = ref["init"]
    for name, wrong in (("no update at all", init), ("one update short", short["params"])):
        try:
            _assert_params(wrong, ref["params"], CUDA_RTOL, init=init)
        except AssertionError:
            continue
        raise AssertionError(f"the tolerance passes torch.optim's run {name}")
    for tier, got in runs.items():
        try:
            _assert_like_torch(got, ref, cfg.get("clip"), CUDA_RTOL, init=init, norm_rtol=1e-5)
            if cfg.get("in_backward"):
                assert got["held"] == [], f"gradients held after a backward: {got['held']}"
        except AssertionError as e:
            raise AssertionError(f"tier={tier}: {e}") from None
    host, device = runs["host"], runs["device"]
    assert host["host_buckets"] > 1, "one host-tier bucket: CUDA_BUCKET_BYTES did not apply"
    assert torch.equal(host["losses"], device["losses"]), (
        f"host and device tiers' losses differ: {host['losses']} {device['losses']}")
    _assert_params(host["params"], device["params"], rtol=0, exact=True)


# ---- the launcher -----------------------------------------------------------------------------
def _launch(world: int = 2, **cfg) -> dict:
    """Runs _train on `world` gloo ranks; returns rank 0's result."""
    return dist_util.run(_train, world_size=world, backend="gloo", args=(cfg,),
                         timeout=TIMEOUT_S)[0]


def _assert_params(got: dict, want: dict, rtol: float, exact: bool = False,
                   init: dict | None = None) -> None:
    """Each parameter within rtol of want's (relative, and absolute: rtol x its largest
    magnitude), or with init (the parameters before training) within rtol x how far training
    moved it; exact: bitwise."""
    assert got.keys() == want.keys()
    for name in want:
        msg = lambda m, name=name: f"{name}: {m}"  # noqa: E731
        if exact:
            assert torch.equal(got[name], want[name]), f"{name} differs"
        elif init is not None:
            moved = float((want[name] - init[name]).abs().max())
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=rtol * moved, msg=msg)
        else:
            torch.testing.assert_close(got[name], want[name], rtol=rtol,
                                       atol=rtol * float(want[name].abs().max()), msg=msg)


def _assert_like_torch(got: dict, ref: dict, clip: float | None, rtol: float = 1e-6,
                       init: dict | None = None, norm_rtol: float = 1e-6) -> None:
    """An emsa run against torch.optim's of the same model, batches and wrapping: the
    parameters (_assert_params), no sharded storage moved, and with clip the norms and how often
    clipping fired."""
    _assert_params(got["params"], ref["params"], rtol=rtol, init=init)
    assert got["moved"] == [], "FSDP2 moved a sharded parameter's storage"
    if clip:
        # The norm is the whole model's (all-reduced over the shards), as torch's on DTensors.
        torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(ref["norms"]),
                                   rtol=norm_rtol, atol=0)
        fired = sum(n > clip for n in ref["norms"])
        assert fired > 0, f"clipping never fired (norms {ref['norms']})"
        assert got["clip_count"] == fired


pytestmark = pytest.mark.skipif(bool(_missing()), reason=_missing() or "runs")


# ---- the tests ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def torch_runs():
    """FSDP2 + torch.optim.AdamW, by clip threshold, each run once for the module."""
    runs = {}

    def run(clip):
        if clip not in runs:
            runs[clip] = _launch(opt="torch", clip=clip)
        return runs[clip]

    return run


@pytest.mark.numerics
@pytest.mark.parametrize("in_backward", [False, True], ids=["step", "in_backward"])
@pytest.mark.parametrize("clip", [None, 1.0], ids=["noclip", "clip"])
def test_fsdp2_equals_torch_adamw(torch_runs, in_backward, clip):
    _assert_like_torch(_launch(opt="emsa", clip=clip, in_backward=in_backward), torch_runs(clip),
                       clip)


@pytest.mark.numerics
def test_fsdp2_accumulation_without_sync_in_backward():
    """Micro-batches under set_requires_gradient_sync(False) run no hooks; the synchronized
    backward updates from the accumulated gradients (accumulate=1)."""
    ref = _launch(opt="torch", accumulate=True)
    got = _launch(opt="emsa", in_backward=True, accumulate=True)
    _assert_params(got["params"], ref["params"], rtol=1e-6)


@pytest.mark.numerics
def test_fsdp2_probed_plan_equals_torch_adamw(torch_runs):
    """emsa.probe on the sharded model records each rank's shards in FSDP2's order of use."""
    ref = torch_runs(None)
    got = _launch(opt="emsa", probe=True)
    _assert_params(got["params"], ref["params"], rtol=1e-6)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The uninterrupted 2-rank emsa run, and a DCP checkpoint of it at step SAVE_AT."""
    tmp = tmp_path_factory.mktemp("dcp")
    full = _launch(opt="emsa")
    _launch(opt="emsa", stop=SAVE_AT, save_at=SAVE_AT, save=str(tmp / "ckpt"))
    return full, tmp / "ckpt"


@pytest.mark.numerics
def test_dcp_resume_is_bitwise(checkpoint, torch_runs):
    full, ckpt = checkpoint
    resumed = _launch(opt="emsa", load=str(ckpt))
    _assert_params(resumed["params"], full["params"], rtol=0, exact=True)
    # And the resumed run is torch.optim's uninterrupted one (the reference, not emsa's own).
    _assert_params(resumed["params"], torch_runs(None)["params"], rtol=1e-6)


@pytest.mark.numerics
@pytest.mark.parametrize("opt", ["emsa", "torch"])
def test_two_rank_checkpoint_into_one_rank(checkpoint, torch_runs, opt):
    full, ckpt = checkpoint
    got = _launch(world=1, opt=opt, fsdp=False, load=str(ckpt))
    _assert_params(got["params"], full["params"], rtol=1e-6)
    _assert_params(got["params"], torch_runs(None)["params"], rtol=1e-6)  # torch.optim's run


@pytest.mark.parametrize("prefetch", [False, True], ids=["implicit", "forward_prefetch"])
@pytest.mark.parametrize("root_keeps", [False, True], ids=["root_empty", "root_holds"])
def test_fsdp2_units_read_their_own_shards(root_keeps, prefetch):
    dist_util.run(_unit_reads, world_size=2, backend="gloo", timeout=TIMEOUT_S,
                  args=({"root_keeps": root_keeps, "prefetch": prefetch},))


@pytest.mark.parametrize("prefetch", [False, True], ids=["implicit", "forward_prefetch"])
@pytest.mark.parametrize("root_keeps", [False, True], ids=["root_empty", "root_holds"])
def test_fsdp2_forward_waits_per_unit(root_keeps, prefetch):
    dist_util.run(_hook_waits, world_size=2, backend="gloo", timeout=TIMEOUT_S,
                  args=({"root_keeps": root_keeps, "prefetch": prefetch},))


def test_fsdp2_forward_waits_for_all_where_fsdp_is_opaque():
    dist_util.run(_opaque_waits, world_size=2, backend="gloo", timeout=TIMEOUT_S)


_NO_CUDA = not torch.cuda.is_available() or not torch.distributed.is_nccl_available()


@pytest.fixture(scope="module")
def cuda_checks():
    """Every CUDA variant's verdict, from one NCCL process (its start is most of the cost)."""
    return dist_util.run(_cuda_checks, world_size=1, backend="nccl", timeout=TIMEOUT_S)[0]


@pytest.mark.numerics
@pytest.mark.skipif(_NO_CUDA, reason="needs a CUDA GPU and NCCL")
@pytest.mark.parametrize("variant", list(CUDA_VARIANTS))
def test_cuda_fsdp2_host_and_device_tiers_equal_torch_adamw(cuda_checks, variant):
    assert cuda_checks[variant] == "", cuda_checks[variant]
