"""One world of Lightning Trainers on CPU, launched as Lightning users launch it: by Lightning itself
(``python lightning_script.py --out DIR`` starts the second rank) or by torchrun
(``torchrun --nproc_per_node 2 lightning_script.py --out DIR``).

Every run fits the same LightningModule on the same data for two epochs: Lightning's own DDP strategy
(the reference), Lightning's ``DeepSpeedStrategy`` at ZeRO-1, 2 and 3 (its default config, and at stage 3
a ``config=`` that shards every parameter) with ``import deepspeed`` answered by
zeroshard, and zeroshard's own strategy at stages 1-3 (with gradient accumulation and clipping); then a
resume from the first epoch's ``ModelCheckpoint`` by ``ckpt_path``.  Rank 0 writes result.json: the
largest relative difference of each run's final weights from its reference, and the steps taken.
"""

import argparse
import json
import logging
from pathlib import Path

import zeroshard

zeroshard.install_as_deepspeed()  # before Lightning imports deepspeed

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.fabric.utilities.seed import reset_seed  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy  # noqa: E402
from torch import nn  # noqa: E402

import zeroshard.lightning  # noqa: E402  (registers zeroshard_stage_1/2/3)
from zeroshard.lightning import ZeroshardStrategy  # noqa: E402

#: every stage-3 parameter sharded (none kept whole), so that stage 3 gathers what it computes with
SHARD_ALL = {"stage3_param_persistence_threshold": 0}


class CPUDeepSpeedStrategy(DeepSpeedStrategy):
    """Lightning's DeepSpeedStrategy with its two CUDA-only checks lifted, and nothing else changed:
    Lightning refuses DeepSpeed on a CPU whichever DeepSpeed it finds, and this suite runs on CPUs.
    On a GPU, ``Trainer(strategy="deepspeed_stage_3")`` is the same code."""

    def setup_environment(self) -> None:
        DDPStrategy.setup_environment(self)  # without "only supported on CUDA GPUs"

    def setup_distributed(self) -> None:  # without the check that devices are cuda:0..N-1
        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()


class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))

    def training_step(self, batch, index):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("loss", loss)
        return loss

    def validation_step(self, batch, index):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y), sync_dist=True)

    def test_step(self, batch, index):
        x, y = batch
        self.log("test_loss", nn.functional.cross_entropy(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=2e-2, weight_decay=0.01)


class BuiltInConfigureModel(Classifier):
    """The same module, its layers built in ``configure_model`` (under the strategy's sharded-model
    context: ``zeroshard.Init`` at stage 3), as Lightning users build models too large for one rank."""

    def __init__(self) -> None:
        L.LightningModule.__init__(self)
        self.net = None

    def configure_model(self) -> None:
        if self.net is None:
            self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
            BUILT_SHARDED.append(all(hasattr(p, "ds_id") for p in self.net.parameters()))  # Init's parameters


#: for each module built in configure_model: whether every parameter came out of zeroshard.Init
BUILT_SHARDED: list = []


def loader() -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=generator)
    y = (x[:, :4].argmax(dim=1) + (x[:, 4] > 0).long()) % 4
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)


def fit(strategy, accumulate: int = 1, ckpt_path=None, callbacks=(), kind=Classifier) -> tuple[dict, int]:
    """Fit a fresh module (the same initial weights every time) for two epochs; its final weights."""
    torch.manual_seed(0)
    module = kind()
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=2, logger=False,
                        enable_progress_bar=False, enable_checkpointing=bool(callbacks), callbacks=list(callbacks),
                        accumulate_grad_batches=accumulate, gradient_clip_val=0.5)
    trainer.fit(module, loader(), ckpt_path=ckpt_path)
    engine = getattr(trainer.strategy, "model", None)
    weights = engine.full_state_dict(rank0_only=False) if hasattr(engine, "full_state_dict") else \
        {k: v.detach().clone() for k, v in module.state_dict().items()}
    return weights, trainer.global_step


def bf16_with_evaluation() -> dict:
    """``precision="bf16-mixed"`` at stage 2, then ``validate`` and ``test`` on the fitted engine and a
    ``test`` of a fresh module (an engine without optimizer): the losses each one logs."""
    torch.manual_seed(0)
    module = Classifier()
    trainer = L.Trainer(strategy="zeroshard_stage_2", accelerator="cpu", devices=2, max_epochs=1, logger=False,
                        enable_progress_bar=False, enable_checkpointing=False, precision="bf16-mixed")
    trainer.fit(module, loader(), loader())
    found = {"dtype": str(next(trainer.strategy.model.module.parameters()).dtype)}
    found.update(trainer.validate(module, loader(), verbose=False)[0])
    found.update(trainer.test(module, loader(), verbose=False)[0])
    fresh = L.Trainer(strategy="zeroshard_stage_2", accelerator="cpu", devices=2, logger=False,
                      enable_progress_bar=False)
    found["fresh_test_loss"] = fresh.test(Classifier(), loader(), verbose=False)[0]["test_loss"]
    return found


def rel_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k].float() - b[k].float()).abs().max() / b[k].float().abs().max()) for k in a)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = Path(parser.parse_args().out)
    logging.getLogger("lightning").setLevel(logging.WARNING)
    result: dict = {}
    ddp, result["ddp_steps"] = fit("ddp")
    ddp_accumulated, result["ddp_accumulated_steps"] = fit("ddp", accumulate=2)
    for stage in (1, 2):
        door, result[f"deepspeed_stage_{stage}_steps"] = fit(CPUDeepSpeedStrategy(stage=stage))
        result[f"deepspeed_stage_{stage}"] = rel_diff(door, ddp)
    door, result["deepspeed_stage_3_steps"] = fit(
        CPUDeepSpeedStrategy(config={"zero_optimization": {"stage": 3, **SHARD_ALL}}))
    result["deepspeed_stage_3"] = rel_diff(door, ddp)
    for stage in (1, 2):
        weights, result[f"zeroshard_stage_{stage}_steps"] = fit(f"zeroshard_stage_{stage}", accumulate=2)
        result[f"zeroshard_stage_{stage}"] = rel_diff(weights, ddp_accumulated)
    result["bf16_with_evaluation"] = bf16_with_evaluation()
    built_under_init, _ = fit(ZeroshardStrategy(stage=3, config={"zero_optimization": SHARD_ALL}), accumulate=2,
                              kind=BuiltInConfigureModel)
    result["zeroshard_stage_3_configure_model"] = rel_diff(built_under_init, ddp_accumulated)
    result["configure_model_under_init"] = BUILT_SHARDED
    checkpoints = out / "checkpoints"
    saving = ModelCheckpoint(dirpath=checkpoints, save_top_k=-1, every_n_epochs=1)
    stage3, result["zeroshard_stage_3_steps"] = fit(ZeroshardStrategy(stage=3, config={"zero_optimization": SHARD_ALL}),
                                                    accumulate=2, callbacks=[saving])
    result["zeroshard_stage_3"] = rel_diff(stage3, ddp_accumulated)
    first_epoch = checkpoints / "epoch=0-step=4.ckpt"
    result["checkpoints"] = sorted(p.name for p in checkpoints.iterdir())
    resumed, result["resumed_steps"] = fit(ZeroshardStrategy(stage=3, config={"zero_optimization": SHARD_ALL}),
                                           accumulate=2, ckpt_path=str(first_epoch))
    result["resumed"] = rel_diff(resumed, stage3)
    if torch.distributed.get_rank() == 0:
        (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
