"""Lightning's Trainer with emsa optimizers (emsa.lightning): gradient clipping moved into emsa
and equal to torch.optim.AdamW under Lightning's own clipping, in step() mode and in backward.
Clipping that Lightning would apply to gradients already consumed in backward is refused before
anything changes.

The model is a small MLP with no parameter whose true gradient is zero, so 20 steps of two runs
stay within float32 noise of each other."""

import warnings

import pytest
import torch

import emsa

L = pytest.importorskip("lightning.pytorch", reason="needs lightning (scripts/lib/setup.sh "
                        "installs it into the venv)")
from emsa.lightning import EmsaLightningCallback  # noqa: E402  (needs lightning)

HAS_CUDA = torch.cuda.is_available()
STEPS = 20
CLIP = 0.05  # the MLP's gradient norm is above it every step
HYPER = dict(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95))


class _MLP(L.LightningModule):
    def __init__(self, make_optimizer):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                                       torch.nn.Linear(32, 1))
        self.make_optimizer = make_optimizer
        self.losses = []
        self.opt = None

    def training_step(self, batch, index):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        self.opt = self.make_optimizer(self.parameters())
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(self.opt, T_max=STEPS)
        return {"optimizer": self.opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _loader():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8 * STEPS, 16, generator=g), torch.randn(8 * STEPS, 1, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


def _fit(make_optimizer, device, callbacks=(), clip=CLIP, algorithm="norm", max_steps=STEPS,
         ckpt_path=None, accumulate=1):
    model = _MLP(make_optimizer)
    trainer = L.Trainer(
        max_steps=max_steps, gradient_clip_val=clip, gradient_clip_algorithm=algorithm,
        accumulate_grad_batches=accumulate,
        accelerator="gpu" if device == "cuda" else "cpu", devices=1, deterministic=True,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=list(callbacks))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module="lightning")  # its advice on workers, logging
        trainer.fit(model, _loader(), ckpt_path=ckpt_path)
    return model, trainer


_TORCH_RUNS: dict[str, _MLP] = {}


def _torch_run(device):
    if device not in _TORCH_RUNS:
        _TORCH_RUNS[device] = _fit(lambda p: torch.optim.AdamW(p, **HYPER), device)[0]
    return _TORCH_RUNS[device]


MODES = [("cpu", "step"), ("cpu", "step+callback"), ("cpu", "backward+callback")] + [
    pytest.param("cuda", m, marks=pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU"))
    for m in ("step+callback", "backward+callback", "host+callback")]


@pytest.mark.numerics
@pytest.mark.parametrize("device,mode", MODES)
def test_lightning_clipping_matches_torch(device, mode):
    """Trainer(gradient_clip_val=0.05), cosine schedule by step, 20 steps: emsa.AdamW trained by
    Lightning ends where torch.optim.AdamW does under Lightning's clip_grad_norm_. "step" leaves
    the clipping to Lightning; with the callback emsa clips, every step, also in backward and
    on the host tier. The tolerance is tighter than what training moved the parameters."""
    ref = _torch_run(device)
    kw = {}
    if mode.startswith(("backward", "host")):
        kw["step_in_backward"] = True
    if mode.startswith("host"):
        kw["tier"] = "host"
    callbacks = [EmsaLightningCallback()] if mode.endswith("callback") else []
    ours, trainer = _fit(lambda p: emsa.AdamW(p, **HYPER, **kw), device, callbacks)
    opt = ours.opt
    opt.synchronize()
    assert trainer.gradient_clip_val == CLIP, "the callback did not restore gradient_clip_val"
    if mode.startswith("host"):  # Lightning moved the state "to the device": written in place
        assert all(t.device.type == "cpu" for st in opt.state.values()
                   for k, t in st.items() if k != "step"), "the host tier's state was replaced"
    if callbacks:
        assert opt.max_grad_norm == CLIP
        assert int(opt.clip_count) == STEPS, f"emsa clipped {int(opt.clip_count)} of {STEPS}"
    start = _MLP(None)
    moved = max((p.cpu() - q).abs().max().item()
                for p, q in zip(ref.parameters(), start.parameters()))
    assert moved > 1e-2, f"the reference moved its parameters by only {moved}"
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    gaps = [abs(a - b) for a, b in zip(ours.losses, ref.losses)]
    assert len(ours.losses) == STEPS and max(gaps) <= 1e-5, gaps


def _initial():
    return [p.detach().clone() for p in _MLP(None).parameters()]


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_lightning_clipping_of_consumed_gradients_is_refused(algorithm):
    """step_in_backward without the callback: Lightning would clip gradients emsa has already
    updated from and released. The first step is refused, before its forward, so the model is
    unchanged."""
    holder = {}

    def make(params):
        holder["opt"] = emsa.AdamW(params, **HYPER, step_in_backward=True)
        return holder["opt"]

    model = _MLP(make)
    trainer = L.Trainer(max_steps=STEPS, gradient_clip_val=CLIP, gradient_clip_algorithm=algorithm,
                        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    match = "EmsaLightningCallback" if algorithm == "norm" else "clips by the global norm only"
    with pytest.raises(RuntimeError, match=match), warnings.catch_warnings():
        warnings.filterwarnings("ignore", module="lightning")
        trainer.fit(model, _loader())
    assert model.losses == [], "the step ran before it was refused"
    for p, q in zip(model.parameters(), _initial()):
        assert torch.equal(p, q)
    for state in holder["opt"].state.values():  # planned at construction, never stepped
        assert float(state["step"]) == 0 and not state["exp_avg"].any(), "state was written"


def test_callback_refuses_clipping_by_value_in_backward_and_leaves_it_in_step_mode():
    with pytest.raises(ValueError, match="global norm only"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", module="lightning")
        _fit(lambda p: emsa.AdamW(p, **HYPER, step_in_backward=True), "cpu",
             [EmsaLightningCallback()], algorithm="value")
    ours, trainer = _fit(lambda p: emsa.AdamW(p, **HYPER), "cpu", [EmsaLightningCallback()],
                         clip=1e-3, algorithm="value")
    assert ours.opt.max_grad_norm is None and trainer.gradient_clip_val == 1e-3
    ref, _ = _fit(lambda p: torch.optim.AdamW(p, **HYPER), "cpu", clip=1e-3, algorithm="value")
    for p, q in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def _resumed(make_first, make_second, tmp_path, name, callbacks=()):
    """10 steps, a Lightning checkpoint, then a new Trainer resumed from it to 20. Lightning
    restarts the epoch's data on resume, so resumed runs are compared with resumed runs."""
    first, trainer = _fit(make_first, "cpu", callbacks, max_steps=STEPS // 2)
    path = str(tmp_path / f"{name}.ckpt")
    trainer.save_checkpoint(path)
    return first, _fit(make_second, "cpu", callbacks, ckpt_path=path)[0]


@pytest.mark.numerics
@pytest.mark.parametrize("in_backward", [False, True])
def test_lightning_checkpoint_resumes_as_torch_and_loads_into_torch(in_backward, tmp_path):
    """A Lightning checkpoint of an emsa run (clipped by emsa through the callback), resumed
    by emsa and by torch.optim.AdamW, ends where torch's own checkpoint resumed by torch ends."""
    def make_emsa(params):
        return emsa.AdamW(params, **HYPER, step_in_backward=in_backward)

    def make_torch(params):
        return torch.optim.AdamW(params, **HYPER)

    callback = [EmsaLightningCallback()]
    half, ours = _resumed(make_emsa, make_emsa, tmp_path, "emsa", callback)
    _, into_torch = _resumed(make_emsa, make_torch, tmp_path, "emsa-torch", callback)
    _, ref = _resumed(make_torch, make_torch, tmp_path, "torch")
    steps = {float(s["step"]) for s in ours.opt.state_dict()["state"].values()}
    assert steps == {float(STEPS)}, steps
    moved = max((p - q).abs().max().item() for p, q in zip(ref.parameters(), half.parameters()))
    assert moved > 1e-3, f"the resumed steps moved the parameters by only {moved}"
    for run in (ours, into_torch):
        for (name, p), q in zip(run.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.numerics
@pytest.mark.parametrize("in_backward", [False, True])
def test_lightning_accumulation_matches_torch(in_backward):
    """Trainer(accumulate_grad_batches=2): in backward the callback hands the 2 to emsa, which
    updates, and clips by the accumulated gradients' norm, in every second backward."""
    ref, _ = _fit(lambda p: torch.optim.AdamW(p, **HYPER), "cpu", accumulate=2,
                  max_steps=STEPS // 2)
    ours, _ = _fit(lambda p: emsa.AdamW(p, **HYPER, step_in_backward=in_backward), "cpu",
                   [EmsaLightningCallback()], accumulate=2, max_steps=STEPS // 2)
    assert int(ours.opt.clip_count) == STEPS // 2
    assert ours.opt._accumulate == 1, "the callback did not restore accumulate= at fit end"
    start = _MLP(None)
    moved = max((p - q).abs().max().item() for p, q in zip(ref.parameters(), start.parameters()))
    assert moved > 1e-2
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_lightning_accumulation_emsa_does_not_share_is_refused():
    """In backward without the callback, emsa would update in each of the accumulated
    backwards: refused at the step after them (the first one Lightning hands emsa)."""
    with pytest.raises(RuntimeError, match="accumulates 2 batches"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", module="lightning")
        _fit(lambda p: emsa.AdamW(p, **HYPER, step_in_backward=True), "cpu", clip=None,
             accumulate=2)
    with pytest.raises(ValueError, match="accumulate_grad_batches is 2"):
        _fit(lambda p: emsa.AdamW(p, **HYPER, step_in_backward=True, accumulate=3), "cpu",
             [EmsaLightningCallback()], accumulate=2)
