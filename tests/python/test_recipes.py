"""Issue 19's bar as tests: exact training recipes (global-norm clipping, the non-finite skip,
GradScaler, frozen and absent gradients) in every mode, against torch.optim.

Modes: "step" (step() after backward), "backward" (step_in_backward=True); on CUDA also "host"
(tier="host", step_in_backward) and "half" (a budget halfway between the all-device and the
all-host plans', step_in_backward). CUDA cases skip without a GPU.

The clipping bar and how it is judged. The bar says emsa may be no further from
torch.optim.AdamW + clip_grad_norm_ than torch's foreach and fused implementations are from each
other. Those two share their rounding almost everywhere (on the CPU fused and foreach differ in a
handful of elements by one ulp), so their distance is far below either's own error: each fp32
run is about 10x further from the same run in float64 than from the other. emsa's kernel rounds
differently (as correctly), so it is held to: (1) as accurate as torch: its distance to the
float64 run at most 1.25x torch's own (ACCURACY_FACTOR); (2) no further from torch than 4x
torch's two implementations from each other (SPREAD_FACTOR), or, where that is smaller than
torch's own error against float64, no further than that error. Both are five orders of
magnitude tighter than one update (`recipe_models.distance`: about 1/steps). Both distances are
reported (bench/recipes_numerics.py writes them per model and mode). Every model runs in
lockstep: end to end, each optimizer training its own copy, both distances measure how the
trajectories amplify one-ulp differences (on the H200, 20 steps of the Llama here: emsa 7.4e-5
from torch's foreach, fused 1.7e-5), not which update is more exact.
"""

import os

# cuBLAS is deterministic only with a fixed workspace; read when CUDA starts.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import copy  # noqa: E402
import functools  # noqa: E402
import importlib.util  # noqa: E402
import inspect  # noqa: E402
import sys  # noqa: E402
import types  # noqa: E402
import weakref  # noqa: E402
import warnings  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import emsa  # noqa: E402
import recipe_models as rm  # noqa: E402
from conftest import CPU_PROFILE  # noqa: E402

HAS_HF = importlib.util.find_spec("transformers") is not None
requires_hf = pytest.mark.skipif(not HAS_HF, reason="needs transformers (scripts/lib/setup.sh "
                                 "installs it into the venv)")
HAS_CUDA = torch.cuda.is_available()

_ARGS = inspect.signature(emsa.AdamW.__init__).parameters
MISSING_API = [name for name in ("max_grad_norm", "grad_scaler") if name not in _ARGS]
requires_api = pytest.mark.skipif(
    bool(MISSING_API), reason="emsa.AdamW lacks " + ", ".join(MISSING_API) + " (issue 19's "
    "user API, CONTRACT19.md: the front end of branch y1-frontend)")

ACCURACY_FACTOR = 1.25
SPREAD_FACTOR = 4.0
NORM_RTOL = 1e-5  # emsa's last_grad_norm against clip_grad_norm_'s, every step

MODES = [("cpu", "step"), ("cpu", "backward")] + [
    pytest.param("cuda", m, marks=pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU"))
    for m in ("step", "backward", "host", "half")]


@pytest.fixture
def deterministic():
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(was)


def half_budget(model, example_kwargs, loss_fn):
    """A probe of the model and the budget halfway between the device peaks of its all-device
    and all-host plans (updates in backward): some state goes to the host, not all."""
    record = emsa.probe(model, loss_fn=loss_fn, **example_kwargs)
    peak = lambda **kw: emsa.make_plan(record, release_grads=True, **kw).json[  # noqa: E731
        "prediction"]["peak_device_bytes"]
    device_peak, host_peak = peak(allow_host_tier=False), peak(force_all_host=True)
    assert host_peak < device_peak, "the all-host plan should need less device memory"
    return record, (device_peak + host_peak) // 2


def mode_kwargs(device, mode, model=None, example=None, loss_fn=None) -> dict:
    """emsa's options for a mode; "half" probes `model` on `example` (keyword arguments of its
    forward) with `loss_fn`."""
    kw = {"profile": str(CPU_PROFILE)} if device == "cpu" else {}
    if mode != "step":
        kw["step_in_backward"] = True
    if mode == "host":
        kw["tier"] = "host"
    if mode == "half":
        kw["probe"], kw["budget"] = half_budget(model, example, loss_fn)
    return kw


def sync(opt):
    """Waits for the GPU's updates (host-tier parameters included) before they are read."""
    if HAS_CUDA:
        opt.synchronize()
        torch.cuda.synchronize()


def snapshot(model, opt):
    params = [p.detach().clone() for p in model.parameters()]
    state = {id(p): {k: v.clone() for k, v in opt.state[p].items() if torch.is_tensor(v)}
             for p in model.parameters() if p in opt.state}
    return params, state


def assert_unchanged(model, opt, snap, what):
    params, state = snap
    for (name, p), before in zip(model.named_parameters(), params):
        assert torch.equal(p.detach(), before), f"{what}: {name} changed"
        for key, v in state.get(id(p), {}).items():
            assert torch.equal(opt.state[p][key], v), f"{what}: state {key} of {name} changed"


def assert_rel_close(model, ref, rel, what=""):
    """Every parameter within `rel` of the reference's, relative to its largest element."""
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        scale = b.detach().abs().max().item()
        err = (a.detach() - b.detach()).abs().max().item()
        assert err <= rel * scale, f"{what}{name}: off by {err:.3g}, {err / scale:.3g} relative"


# ---- clipping: four Hugging Face models, 20 steps, max_grad_norm=1.0 ----------------------
@requires_hf
@requires_api
@pytest.mark.numerics
@pytest.mark.parametrize("device,mode", MODES)
@pytest.mark.parametrize("name", sorted(rm.SPECS))
def test_clipped_adamw_within_torchs_own_spread(name, device, mode, deterministic):
    def make(model, groups, hyper):
        batch = rm.lm_batches(1, device=device)[0]
        kw = mode_kwargs(device, mode, model, dict(input_ids=batch[0], labels=batch[0]),
                         lambda out: out.loss)
        return emsa.AdamW(groups, **hyper, **kw)

    r = rm.compare_clipped(name, make, device, sync=sync)
    print(f"{name} {device} {mode}: {r}")
    assert r["torch_clipped"] > 0, f"clipping never fired: the test does not test it ({r})"
    assert r["emsa_clip_count"] == r["torch_clipped"], r
    assert r["grad_norm_gap"] <= NORM_RTOL, f"last_grad_norm is not this step's norm: {r}"
    assert within_bar(r), r


def within_bar(r: dict) -> bool:
    """The module docstring's criteria (lockstep: both; end to end: the spread alone, the
    trajectories' drift being what both distances measure)."""
    if r["e_emsa"] is None:
        return r["d_emsa"] <= SPREAD_FACTOR * r["d_torch"]
    return (r["e_emsa"] <= ACCURACY_FACTOR * max(r["e_foreach"], r["e_fused"])
            and r["d_emsa"] <= max(SPREAD_FACTOR * r["d_torch"], r["e_foreach"]))


# ---- frozen embedding and a branch used on even steps only --------------------------------
def lockstep_backward(ours, ref, scaler=None, ref_scaler=None):
    """Gives `ours` the reference's gradients through a backward of its own (so hooks and the
    end-of-backward callback run as in training): parameters whose reference gradient is None
    (frozen, or unused this step) get none. With GradScalers, the reference's gradients are
    scaled: ref_scaler's scale is divided out and `scaler.scale` (ours) applies its own (powers
    of two: exact)."""
    div = 1.0 if ref_scaler is None else ref_scaler.get_scale()
    params, grads = [], []
    for p, q in zip(ours.parameters(), ref.parameters()):
        if q.grad is not None:
            params.append(p)
            grads.append(q.grad.detach() / div)
    rm.surrogate_backward(params, grads, (lambda loss: loss) if scaler is None else scaler.scale)


def _frozen_run(device, mode, max_norm, steps=10):
    """Lockstep (the reference's gradients each step): a correct optimizer then agrees with
    torch's to rounding, where independent runs of this tanh network drift apart from one-ulp
    differences (torch's foreach and fused reach 4e-7 in 10 steps; clipped, emsa's 2e-6)."""
    torch.manual_seed(0)
    ref = rm.FrozenEmbeddingBranch().to(device)
    ours = copy.deepcopy(ref)
    hyper = dict(lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), **hyper)
    batches = rm.frozen_branch_batches(steps, device=device)
    example = None
    if mode == "half":
        example = dict(ids=batches[0][0], step=0)
    extra = {} if max_norm is None else {"max_grad_norm": max_norm}
    opt = emsa.AdamW(ours.parameters(), **hyper, **extra,
                     **mode_kwargs(device, mode, ours, example,
                                   lambda out: (out - batches[0][1]).square().mean()))
    for k, batch in enumerate(batches):
        for o in (ref_opt, opt):
            o.zero_grad(set_to_none=True)
        rm.frozen_branch_loss(ref, batch, k).backward()
        lockstep_backward(ours, ref)
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        ref_opt.step()
        opt.step()
    sync(opt)
    return ref, ref_opt, ours, opt


@requires_api
@pytest.mark.numerics
@pytest.mark.parametrize("max_norm", [None, 0.05])
@pytest.mark.parametrize("device,mode", MODES)
def test_frozen_and_absent_gradients_as_torch(device, mode, max_norm):
    ref, ref_opt, ours, opt = _frozen_run(device, mode, max_norm)
    assert_rel_close(ours, ref, 1e-6)
    assert torch.equal(ours.embed.weight, ref.embed.weight), "the frozen embedding moved"
    assert ours.embed.weight not in opt.state or not opt.state[ours.embed.weight], \
        "emsa holds state for a frozen parameter"
    sd, ref_sd = opt.state_dict(), ref_opt.state_dict()
    assert sorted(sd["state"]) == sorted(ref_sd["state"]), "state_dict entries differ"
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        if q in ref_opt.state:  # per-parameter step counts: 10 for the trunk, 5 for the branch
            assert int(opt.state[p]["step"]) == int(ref_opt.state[q]["step"]), name
    assert int(ref_opt.state[ref.branch[0].weight]["step"]) == 5
    if max_norm is not None:
        assert opt.clip_count > 0, "clipping never fired: choose a smaller max_norm"


@requires_api
def test_unfrozen_parameter_is_refused_with_a_message():
    torch.manual_seed(0)
    model = rm.FrozenEmbeddingBranch()
    opt = emsa.AdamW(model.parameters(), profile=str(CPU_PROFILE))
    batch = rm.frozen_branch_batches(2)
    rm.frozen_branch_loss(model, batch[0], 0).backward()
    opt.step()
    opt.zero_grad()
    model.embed.weight.requires_grad_(True)
    rm.frozen_branch_loss(model, batch[1], 0).backward()
    with pytest.raises((RuntimeError, ValueError), match="(?i)frozen|new optimizer"):
        opt.step()


# ---- LoRA: state only for what trains ------------------------------------------------------
def state_bytes_torch(opt) -> int:
    return sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
               if torch.is_tensor(v))


def state_bytes_emsa(opt) -> int:
    """The bytes emsa's plan lays out for state (every module's range in its arenas, alignment
    padding included), not what its views show."""
    return sum(int(m["bytes"]) for m in opt.plan.json["modules"])


# The device arena is mapped in whole units of the VMM granularity (src/plan/layout.cc), so it
# ends up to one unit past the laid-out state: a fixed cost per arena, not per parameter.
ARENA_UNIT = 2 << 20


def arena_bytes_emsa(opt) -> int:
    return int(opt.plan.device_arena_bytes) + int(opt.plan.host_arena_bytes)


@pytest.mark.numerics
@pytest.mark.parametrize("device", ["cpu", pytest.param(
    "cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU"))])
def test_lora_state_bytes_within_one_percent_of_torch(device):
    torch.manual_seed(0)
    ref = rm.LoRAModel().to(device)
    ours = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    kw = {"profile": str(CPU_PROFILE)} if device == "cpu" else {"tier": "device"}
    opt = emsa.AdamW(ours.parameters(), lr=1e-3, **kw)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):  # lockstep: both get the reference's gradients (lora_b starts at 0,
        # where Adam's normalised step amplifies one-ulp forward differences end to end)
        x = torch.randn(16, 1024, generator=g).to(device)
        for o in (ref_opt, opt):
            o.zero_grad()
        ref(x).square().mean().backward()
        lockstep_backward(ours, ref)
        for o in (ref_opt, opt):
            o.step()
    sync(opt)
    assert_rel_close(ours, ref, 1e-5)  # the adapters trained as torch's did
    want, got, arena = state_bytes_torch(ref_opt), state_bytes_emsa(opt), arena_bytes_emsa(opt)
    frozen = sum(p.numel() * 4 for p in ours.parameters() if not p.requires_grad)
    print(f"LoRA {device}: emsa state {got} B (arenas {arena} B), torch {want} B, frozen base "
          f"{frozen} B")
    assert abs(got - want) <= 0.01 * want, (
        f"emsa plans {got} B of state, torch holds {want} B (the frozen base is {frozen} B)")
    assert arena - got < 2 * ARENA_UNIT, f"emsa's arenas hold {arena} B for {got} B of state"
    assert not any(opt.state.get(p) for p in ours.parameters() if not p.requires_grad)


# ---- injected inf: the skipped step changes nothing ---------------------------------------
def _mlp(device):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 8)).to(device)


def _mlp_batches(n, device):
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(8, 16, generator=g).to(device), torch.randn(8, 8, generator=g).to(device))
            for _ in range(n)]


class InfAt:
    """A tensor hook on one parameter that puts inf into one element of its gradient at the
    chosen step: the gradient arrives non-finite in backward, as an overflow makes it (so the
    in-backward modes see it in their hooks, not after)."""

    def __init__(self, param, step):
        self.step, self.now = step, -1
        param.register_hook(self._hook)

    def _hook(self, grad):
        if self.now != self.step:
            return grad
        grad = grad.clone()
        grad.view(-1)[3] = float("inf")
        return grad


STEPS_INF, BAD = 6, 2


@requires_api
@pytest.mark.numerics
@pytest.mark.parametrize("max_norm", [None, 1.0])
@pytest.mark.parametrize("device,mode", MODES)
def test_injected_inf_is_skipped_bitwise(device, mode, max_norm):
    """emsa's own skip (skip_nonfinite=True), lockstep with torch (which is not stepped at the
    bad step): the step with an inf gradient leaves parameters and state bitwise unchanged, and
    the steps after it are torch's."""
    ours, ref = _mlp(device), _mlp(device)
    hyper = dict(lr=1e-2, weight_decay=0.1)
    extra = {} if max_norm is None else {"max_grad_norm": max_norm}
    data = _mlp_batches(STEPS_INF, device)
    opt = emsa.AdamW(ours.parameters(), **hyper, **extra, skip_nonfinite=True,
                     **mode_kwargs(device, mode, ours, dict(input=data[0][0]),
                                   lambda out: (out - data[0][1]).square().mean()))
    ref_opt = torch.optim.AdamW(ref.parameters(), **hyper)
    inject = InfAt(ours[0].weight, BAD)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the skip's own warning
        for k, (x, y) in enumerate(data):
            inject.now = k
            for o in (ref_opt, opt):
                o.zero_grad(set_to_none=True)
            (ref(x) - y).square().mean().backward()
            if k == BAD:
                sync(opt)
                before = snapshot(ours, opt)
            lockstep_backward(ours, ref)
            opt.step()
            if k == BAD:
                sync(opt)
                assert opt.last_step_skipped, "the step with an inf gradient was not skipped"
                assert_unchanged(ours, opt, before, f"{device}/{mode}: the skipped step")
                continue  # torch's run skips it too
            if max_norm is not None:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
            ref_opt.step()
    sync(opt)
    assert not opt.last_step_skipped
    assert_rel_close(ours, ref, 1e-6, "after the skip: ")
    assert int(opt.state[ours[0].weight]["step"]) == STEPS_INF - 1


@requires_api
@pytest.mark.numerics
@pytest.mark.parametrize("device,mode", MODES)
def test_grad_scaler_skips_injected_inf_and_backs_off(device, mode):
    """GradScaler's protocol: scale(loss).backward(), step(opt), update(); fp16 autocast on
    CUDA, on the CPU the same protocol in fp32 with GradScaler("cpu"). torch's run makes the
    (scaled) gradients, with an inf injected at one step; emsa gets them in lockstep through
    its own scaled backward. The inf step changes nothing in emsa, its scaler backs off as
    torch's does, and the other steps are torch's."""
    ours, ref = _mlp(device), _mlp(device)
    hyper = dict(lr=1e-2, weight_decay=0.1)
    data = _mlp_batches(STEPS_INF, device)
    scaler, ref_scaler = (torch.amp.GradScaler(device, init_scale=2.0**12, growth_interval=2)
                          for _ in range(2))
    kw = mode_kwargs(device, mode, ours, dict(input=data[0][0]),
                     lambda out: (out.float() - data[0][1]).square().mean())
    if mode != "step":
        kw["grad_scaler"] = scaler
    opt = emsa.AdamW(ours.parameters(), **hyper, **kw)
    ref_opt = torch.optim.AdamW(ref.parameters(), **hyper)
    inject = InfAt(ref[0].weight, BAD)
    autocast = (torch.autocast("cuda", dtype=torch.float16) if device == "cuda"
                else torch.autocast("cpu", enabled=False))
    scales, ref_scales = [], []
    for k, (x, y) in enumerate(data):
        inject.now = k
        for o in (ref_opt, opt):
            o.zero_grad(set_to_none=True)
        with autocast:
            loss = (ref(x).float() - y).square().mean()
        ref_scaler.scale(loss).backward()
        if k == BAD:
            sync(opt)
            before = snapshot(ours, opt)
        lockstep_backward(ours, ref, scaler, ref_scaler)
        for sc, o, out in ((ref_scaler, ref_opt, ref_scales), (scaler, opt, scales)):
            sc.step(o)
            sc.update()
            out.append(sc.get_scale())
        if k == BAD:
            sync(opt)
            assert_unchanged(ours, opt, before, f"{device}/{mode}: the GradScaler skip")
    sync(opt)
    assert scales == ref_scales, f"emsa's scaler {scales}, torch's {ref_scales}"
    assert scales[BAD] < scales[BAD - 1], "the scaler did not back off at the inf step"
    assert_rel_close(ours, ref, 1e-6)
    assert int(opt.state[ours[0].weight]["step"]) == STEPS_INF - 1


@requires_api
def test_grad_scaler_without_the_keyword_in_backward_raises():
    model = _mlp("cpu")
    opt = emsa.AdamW(model.parameters(), step_in_backward=True, profile=str(CPU_PROFILE))
    scaler = torch.amp.GradScaler("cpu")
    x, y = _mlp_batches(1, "cpu")[0]
    with pytest.raises((RuntimeError, ValueError), match="grad_scaler"):
        scaler.scale((model(x) - y).square().mean()).backward()
        scaler.step(opt)


# ---- Hugging Face Trainer: emsa's clipping through the emsa.hf recipe ----------------------
HAS_EMSA_HF = importlib.util.find_spec("emsa.hf") is not None
requires_emsa_hf = pytest.mark.skipif(not HAS_EMSA_HF, reason="emsa.hf (issue 19's Trainer "
                                      "recipe, branch y1-frontend) is missing")
TRAINER_STEPS = 50


def _trainer_losses(device, tmp_path, emsa_kw=None, save_steps=None, resume=None,
                    accumulation=1, callback=True, max_grad_norm=1.0, strict=True):
    """50 logged losses of a tiny Llama trained by Trainer (max_grad_norm=1.0, warmup+cosine,
    its two param groups): with torch AdamW (emsa_kw None) or emsa.AdamW(**emsa_kw) and the
    emsa.hf recipe. Returns the losses and the emsa optimizer (None for torch's run).
    save_steps: Trainer saves a checkpoint every that many steps; resume: the checkpoint
    folder this run resumes from (the losses are then those logged after it); accumulation:
    Trainer's gradient_accumulation_steps (the batch of 4 split into that many); callback:
    whether emsa's run gets the EmsaTrainerCallback; strict: emsa's warnings raise."""
    import transformers

    torch.manual_seed(0)
    model = rm.llama("tiny")
    batches = rm.lm_batches(TRAINER_STEPS, batch=4, seed=3)
    data = [{"input_ids": ids[i], "labels": ids[i]} for ids, _ in batches for i in range(4)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=TRAINER_STEPS,
        per_device_train_batch_size=4 // accumulation, gradient_accumulation_steps=accumulation,
        learning_rate=3e-3, weight_decay=0.1, adam_beta2=0.95, warmup_steps=5,
        lr_scheduler_type="cosine", max_grad_norm=max_grad_norm, logging_steps=1, report_to=[],
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
        use_cpu=device == "cpu", seed=0, dataloader_num_workers=0, disable_tqdm=True,
        optim="adamw_torch")
    kw, opt = {}, None
    if emsa_kw is not None:
        probe = transformers.Trainer(model=model, args=args)  # only for its param groups
        decay = set(probe.get_decay_parameter_names(model))
        groups = [{"params": [p for n, p in model.named_parameters() if n in decay],
                   "weight_decay": args.weight_decay},
                  {"params": [p for n, p in model.named_parameters() if n not in decay],
                   "weight_decay": 0.0}]
        model = model.to(device)
        opt = emsa.AdamW(groups, lr=args.learning_rate, betas=(0.9, 0.95), eps=1e-8,
                         **emsa_kw)
        from emsa.hf import EmsaTrainerCallback

        kw = dict(optimizers=(opt, None), callbacks=[EmsaTrainerCallback()] if callback else [])
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, **kw)
    with warnings.catch_warnings():
        # emsa's warning that clipping was asked of consumed gradients: the recipe avoids it.
        if strict:
            warnings.filterwarnings("error", message="emsa", category=RuntimeWarning)
        trainer.train(resume_from_checkpoint=resume)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if resume is None:
        assert len(losses) == TRAINER_STEPS
    else:  # the history loaded from the checkpoint, then this run's
        losses = [h["loss"] for h in trainer.state.log_history
                  if "loss" in h and h["step"] > trainer.state.global_step - TRAINER_STEPS // 2]
    return losses, opt


_TORCH_TRAINER_LOSSES: dict[str, list[float]] = {}
TRAINER_MODES = [("cpu", "step"), ("cpu", "backward")] + [
    pytest.param("cuda", m, marks=pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU"))
    for m in ("step", "host")]


@requires_hf
@requires_api
@requires_emsa_hf
@pytest.mark.numerics
@pytest.mark.parametrize("device,mode", TRAINER_MODES)
def test_trainer_losses_match_torch_with_emsas_clipping(device, mode, tmp_path, deterministic):
    if device not in _TORCH_TRAINER_LOSSES:  # one torch run per device serves every mode
        _TORCH_TRAINER_LOSSES[device] = _trainer_losses(device, tmp_path / "torch")[0]
    want = _TORCH_TRAINER_LOSSES[device]
    got, opt = _trainer_losses(device, tmp_path / "emsa", mode_kwargs(device, mode))
    sync(opt)
    gaps = [abs(a - b) for a, b in zip(got, want)]
    clipped = int(opt.clip_count)
    print(f"Trainer {device}/{mode}: max loss gap {max(gaps):.3g}, clipped {clipped} of "
          f"{TRAINER_STEPS} steps")
    assert clipped > 0, "emsa never clipped: the recipe did not hand it max_grad_norm"
    assert max(gaps) <= 1e-4, f"logged losses differ by up to {max(gaps):.3g}: {gaps}"


@requires_hf
@requires_api
@requires_emsa_hf
@pytest.mark.numerics
@pytest.mark.parametrize("mode", ["step", "backward"])
def test_trainer_resumes_an_emsa_checkpoint_as_torch_runs_on(mode, tmp_path, deterministic):
    """Trainer saves emsa's state at step 25 (optimizer.pt: emsa's state_dict), a new Trainer
    with a new emsa.AdamW resumes from it, and its logged losses for steps 26..50 equal those
    of torch's uninterrupted run within 1e-4, as the uninterrupted emsa run's do."""
    device = "cpu"
    if device not in _TORCH_TRAINER_LOSSES:
        _TORCH_TRAINER_LOSSES[device] = _trainer_losses(device, tmp_path / "torch")[0]
    want = _TORCH_TRAINER_LOSSES[device][TRAINER_STEPS // 2:]
    kw = mode_kwargs(device, mode)
    _trainer_losses(device, tmp_path / "first", kw, save_steps=TRAINER_STEPS // 2)
    checkpoint = tmp_path / "first" / f"checkpoint-{TRAINER_STEPS // 2}"
    assert (checkpoint / "optimizer.pt").is_file()
    got, opt = _trainer_losses(device, tmp_path / "resumed", kw, resume=str(checkpoint))
    assert len(got) == TRAINER_STEPS // 2, got
    steps = {float(st["step"]) for st in opt.state_dict()["state"].values()}
    assert steps == {float(TRAINER_STEPS)}, steps
    gaps = [abs(a - b) for a, b in zip(got, want)]
    assert max(gaps) <= 1e-4, f"resumed losses differ from torch's by up to {max(gaps):.3g}"


@requires_hf
@requires_api
@requires_emsa_hf
@pytest.mark.numerics
@pytest.mark.parametrize("mode", ["step", "backward"])
def test_trainer_gradient_accumulation_matches_torch(mode, tmp_path, deterministic):
    """Trainer(gradient_accumulation_steps=2): with step_in_backward the callback hands the 2
    to emsa (accumulate=2), which updates and clips in every second backward. The 50 logged
    losses equal torch's under the same accumulation within 1e-4 (with emsa updating in every
    backward they were up to 0.09 apart)."""
    want = _trainer_losses("cpu", tmp_path / "torch", accumulation=2)[0]
    got, opt = _trainer_losses("cpu", tmp_path / "emsa", mode_kwargs("cpu", mode),
                               accumulation=2)
    assert int(opt.clip_count) > 0
    assert opt._accumulate == 1, "the callback did not restore accumulate= at train end"
    gaps = [abs(a - b) for a, b in zip(got, want)]
    assert max(gaps) <= 1e-4, f"logged losses differ by up to {max(gaps):.3g}: {gaps}"


@requires_hf
@requires_api
@requires_emsa_hf
def test_trainer_refuses_an_accumulation_that_disagrees_with_emsas(tmp_path):
    kw = dict(mode_kwargs("cpu", "backward"), accumulate=3)
    with pytest.raises(ValueError, match="gradient_accumulation_steps is 2"):
        _trainer_losses("cpu", tmp_path, kw, accumulation=2)


def test_a_dropped_in_backward_optimizer_stops_updating(monkeypatch):
    """With transformers loaded (any script training its models), an in-backward optimizer
    dropped inside the function that made it is freed at once, and a backward after that
    changes no parameter. The first step()'s look for a calling Trainer read every calling
    frame's f_locals, which up to Python 3.12 stores a snapshot of the frame's locals in the
    frame: the dropped optimizer lived on in it, its hooks still updating in every backward
    (a torch optimizer put in its place then doubled the steps)."""
    fake = types.ModuleType("transformers.trainer")
    fake.Trainer = type("Trainer", (), {})
    monkeypatch.setitem(sys.modules, "transformers.trainer", fake)

    def train_then_drop():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 1))
        x = torch.randn(8, 16)
        opt = emsa.AdamW(model.parameters(), lr=1e-2, step_in_backward=True,
                         profile=CPU_PROFILE)
        for _ in range(2):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        gone = weakref.ref(opt)
        del opt
        alive = gone() is not None
        before = [p.detach().clone() for p in model.parameters()]
        model(x).square().mean().backward()
        changed = [i for i, (p, b) in enumerate(zip(model.parameters(), before))
                   if not torch.equal(p.detach(), b)]
        return alive, changed

    alive, changed = train_then_drop()
    assert not alive
    assert changed == []


def test_the_first_step_does_not_import_transformers_trainer(monkeypatch):
    """transformers loads `transformers.Trainer` lazily, with everything its module imports: an
    in-backward optimizer's first step() looks for a calling Trainer only in a loaded
    transformers.trainer, so a script that merely builds transformers models pays no import
    inside its first step (the lookup of transformers.Trainer did)."""
    asked = []
    lazy = types.ModuleType("transformers")

    def lazy_getattr(name):
        asked.append(name)
        raise AttributeError(name)

    lazy.__getattr__ = lazy_getattr
    monkeypatch.setitem(sys.modules, "transformers", lazy)
    monkeypatch.delitem(sys.modules, "transformers.trainer", raising=False)
    model = torch.nn.Linear(4, 1)
    opt = emsa.AdamW(model.parameters(), lr=1e-2, step_in_backward=True, profile=CPU_PROFILE)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    assert asked == []


def test_a_trainer_method_behind_a_decorator_is_still_found(monkeypatch):
    """The Trainer is found by its methods' code, also behind a decorator that keeps
    __wrapped__: a Trainer that clips, stepping an in-backward optimizer without the callback,
    is refused as before."""
    def logged(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            return fn(*args, **kwargs)
        return wrapper

    class Trainer:
        args = types.SimpleNamespace(max_grad_norm=1.0, gradient_accumulation_steps=1)

        @logged
        def loop(self, opt):
            opt.step()

    fake = types.ModuleType("transformers")
    fake.Trainer = Trainer
    fake.TrainerCallback = type("TrainerCallback", (), {})
    monkeypatch.setitem(sys.modules, "transformers", fake)
    monkeypatch.setitem(sys.modules, "transformers.trainer", fake)
    model = torch.nn.Linear(4, 1)
    opt = emsa.AdamW(model.parameters(), lr=1e-2, step_in_backward=True, profile=CPU_PROFILE)
    model(torch.randn(2, 4)).sum().backward()
    with pytest.raises(RuntimeError, match="without emsa.hf.EmsaTrainerCallback"):
        Trainer().loop(opt)


@requires_hf
@requires_api
@requires_emsa_hf
@pytest.mark.parametrize("clip,accumulation", [(1.0, 1), (0.0, 2)])
def test_trainer_without_the_callback_is_refused_in_backward(clip, accumulation, tmp_path):
    """In backward without EmsaTrainerCallback, Trainer's clipping (its default 1.0) would find
    no gradients and its accumulation would let emsa update in every backward: the first step()
    raises and says what to do. Neither asked, the run trains; the norm Trainer asks for to
    log (clip_grad_norm_ with max_norm=inf) is nan, with a warning, as emsa computes none
    without max_grad_norm (torch's call would find no gradients and say 0)."""
    kw = mode_kwargs("cpu", "backward")
    with pytest.raises(RuntimeError, match="without emsa.hf.EmsaTrainerCallback"):
        _trainer_losses("cpu", tmp_path / "refused", kw, accumulation=accumulation,
                        callback=False, max_grad_norm=clip)
    with pytest.warns(RuntimeWarning, match="computes their norm only when it clips"):
        losses, _ = _trainer_losses("cpu", tmp_path / "plain", kw, callback=False,
                                    max_grad_norm=0.0, strict=False)
    assert len(losses) == TRAINER_STEPS
