"""set_weights, skip and stats through the adapters that prefetch (TorchLoader, JaxLoader): the same
batches as the bare iterator given the same calls, counts of what was handed out, exact resume."""

from __future__ import annotations

import numpy as np
import pytest

import portable_loader as pl
from test_control_weights import loader, rows_of, run

torch_adapter = pytest.importorskip("portable_loader.adapters.torch")
jax_adapter = pytest.importorskip("portable_loader.adapters.jax")

ACTIONS = ([("next",)] * 3 + [("w", {"code": 1})] + [("next",)] * 2 + [("skip", 3)] + [("next",)] * 2
           + [("w", {"math": 2, "web": 1})] + [("next",)] * 3)


def drive(it, actions, to_numpy):
    got = []
    for a in actions:
        if a[0] == "next":
            got.append({k: to_numpy(v) for k, v in next(it).items()})
        elif a[0] == "skip":
            it.skip(a[1])
        else:
            it.set_weights(a[1])
    return got


def wrap(kind, ld):
    if kind == "torch":
        return torch_adapter.TorchLoader(ld, async_collation=True)
    return jax_adapter.JaxLoader(ld, prefetch=2)


def as_numpy(v):
    return np.asarray(v)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["torch", "jax"])
@pytest.mark.parametrize("packing,workers", [(False, 0), (True, 2)])
def test_an_adapter_steers_like_the_bare_iterator(kind, packing, workers):
    with iter(loader(packing, prefetch=0)) as bare:
        want = drive(bare, ACTIONS, as_numpy)
        want_state = bare.get_state()
    with wrap(kind, loader(packing, num_workers=workers)) as ad:
        got = drive(iter(ad), ACTIONS, as_numpy)
        stats = ad.stats["sources"]
        state = ad.state_dict()
    assert len(got) == len(want)
    for x, y in zip(got, want):
        assert all(np.array_equal(x[k], y[k]) for k in y)
    counted = {name: 0 for name in ("web", "code", "math")}
    for b in got:
        for s, _ in rows_of(b):
            counted[("web", "code", "math")[s]] += 1
    assert {n: c["records"] for n, c in stats.items()} == counted
    with wrap(kind, loader(packing)) as resumed:
        resumed.load_state_dict(state)
        with iter(loader(packing, prefetch=0)) as bare:
            bare.set_state(want_state)
            for _ in range(6):
                a, b = next(resumed), next(bare)
                assert all(np.array_equal(as_numpy(a[k]), b[k]) for k in b)


def test_a_refused_call_on_an_adapter_changes_nothing():
    with iter(loader(prefetch=0)) as bare:
        want = [next(bare) for _ in range(6)]
    with torch_adapter.TorchLoader(loader(num_workers=2)) as tl:
        got = [next(tl) for _ in range(3)]
        with pytest.raises(ValueError, match="not a source"):
            tl.set_weights({"nope": 1})
        got += [next(tl) for _ in range(3)]
    for x, y in zip(got, want, strict=True):
        assert np.array_equal(x["input_ids"].numpy(), y["input_ids"])


def test_set_weights_on_an_adapter_over_a_plain_loader_says_so():
    plain = pl.DataLoader([{"input_ids": np.arange(5)}] * 20, global_batch_size=4, seq_len=8)
    with torch_adapter.TorchLoader(plain) as tl, pytest.raises(ValueError, match="does not read a mixture"):
        next(tl)
        tl.set_weights({"a": 1})


def test_the_calls_apply_the_same_with_run_on_the_bare_iterator():
    # the helper of the other module drives the bare iterator the same way (a self-check of `drive`)
    acts = [a for a in ACTIONS if a[0] != "skip"]
    with iter(loader(prefetch=0)) as a, iter(loader(prefetch=0)) as b:
        x, y = drive(a, acts, as_numpy), run(b, acts)
    assert all(np.array_equal(p["input_ids"], q["input_ids"]) for p, q in zip(x, y, strict=True))


def test_a_lightning_step_that_re_weights_lands_two_batches_on_and_its_checkpoint_resumes_with_it():
    L = pytest.importorskip("lightning")
    import torch

    from portable_loader.adapters.lightning import ExactResume

    class Steer(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))
            self.seen, self.states = [], []

        def train_dataloader(self):
            return torch_adapter.TorchLoader(loader())

        def training_step(self, batch, i):
            self.seen.append(batch["input_ids"].numpy().copy())
            if i == 2:  # Lightning has fetched batch 3 already
                self.trainer.train_dataloader.set_weights({"code": 1})
            return (self.w * batch["input_ids"][:, :1].float()).sum()

        def on_train_batch_end(self, outputs, batch, i):
            self.states.append(self.trainer.train_dataloader.state_dict())  # what a checkpoint stores

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    model = Steer()
    L.Trainer(accelerator="cpu", max_steps=8, logger=False, enable_progress_bar=False, enable_model_summary=False,
              enable_checkpointing=False, callbacks=[ExactResume()]).fit(model)
    sources = [{s for s, _ in rows_of({"input_ids": b, "attention_mask": b > 0})} for b in model.seen]
    assert sources[3] != {1} and all(s == {1} for s in sources[4:])  # the batch after the next one on
    with torch_adapter.TorchLoader(loader()) as resumed:  # from the checkpoint of step 2, where the call was made
        resumed.load_state_dict(model.states[2])
        for want in model.seen[3:]:
            assert np.array_equal(next(resumed)["input_ids"].numpy(), want)
