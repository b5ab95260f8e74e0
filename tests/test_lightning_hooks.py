"""ExactResume works through Lightning's public hooks: the loader keeps its class, its state follows the
batch trained on at every step (also for a train loader reloaded each Lightning epoch), validation
loaders need nothing, and a pytorch_lightning Trainer is told to use lightning.pytorch."""

import importlib.util
import json

import pytest
import torch

from portable_loader.adapters.torch import TorchLoader
from test_lightning import plain

# Lightning (and lightning_job, which imports it) only inside the tests: importing it costs seconds in
# every test process that collects this module.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="needs lightning")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    from lightning_job import make_cache

    return make_cache(str(tmp_path_factory.mktemp("c")))


@pytest.mark.parametrize("mode", ["serial", "async"])
def test_the_loader_keeps_its_class_and_its_state_follows_the_batch_trained_on(cache, tmp_path, mode):
    from lightning_job import TinyLM, Watch, trainer

    watch = Watch()
    model = TinyLM(cache, mode)
    t = trainer(str(tmp_path), max_steps=5, every=5, accum=1)
    t.callbacks.append(watch)
    t.fit(model)
    seen, states = plain(cache, mode, 5)
    assert model.seen == seen
    assert watch.states == states  # after batch i, at every step: not the batch Lightning fetched ahead
    assert set(watch.classes) == {TorchLoader} and type(t.train_dataloader) is TorchLoader


def test_validation_loaders_need_no_callback(cache, tmp_path):
    import lightning as L
    from lightning_job import WithValidation

    from portable_loader.adapters.lightning import ExactResume

    model = WithValidation(cache, "serial")
    options = dict(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                   limit_val_batches=3)
    L.Trainer(**options).validate(model)  # no ExactResume: a validation loader is never checkpointed
    assert model.validated == 3
    # Fitting with the callback, the sanity check and the validation runs read their loader as they are.
    L.Trainer(**options, max_steps=4, val_check_interval=2, num_sanity_val_steps=2, enable_checkpointing=False,
              callbacks=[ExactResume()]).fit(model)
    assert model.validated == 3 + 2 + 3 + 3
    assert model.seen == plain(cache, "serial", 4)[0]


def test_a_pytorch_lightning_trainer_is_told_to_use_lightning_pytorch(cache):
    from lightning_job import make_loader

    pytorch_lightning = pytest.importorskip("pytorch_lightning")

    class Module(pytorch_lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.head = torch.nn.Linear(1, 1)

        def training_step(self, batch, batch_idx):
            return self.head(batch["input_ids"][:, :1].float()).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    tl = TorchLoader(make_loader(cache, "serial"), async_collation=False)
    fit = pytorch_lightning.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_progress_bar=False,
                                    enable_model_summary=False, enable_checkpointing=False)
    with tl, pytest.raises(RuntimeError, match="import the Trainer from lightning.pytorch"):
        fit.fit(Module(), train_dataloaders=tl)
    assert json.loads(tl.state_dict()["portable_loader"])["step"] == 0  # refused before a batch was fetched


def test_a_train_loader_reloaded_at_an_epoch_start_is_counted_too(cache, tmp_path):
    import lightning as L
    from lightning_job import OneEpochLoaders, Watch, finite

    from portable_loader.adapters.lightning import ExactResume

    watch = Watch()
    model = OneEpochLoaders(cache, "serial")
    L.Trainer(accelerator="cpu", max_steps=9, reload_dataloaders_every_n_epochs=1, logger=False,
              enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
              callbacks=[ExactResume(), watch]).fit(model)
    with TorchLoader(finite(cache), async_collation=False) as tl:
        states = [(next(tl), tl.state_dict())[1] for _ in range(6)]
    assert watch.states == states + states[:3]  # each epoch's own loader, at the batch trained on
