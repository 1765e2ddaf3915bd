"""zeroshard as a PyTorch Lightning strategy: ``Trainer(strategy="zeroshard_stage_3")``.

    import lightning as L
    import zeroshard.lightning                      # registers zeroshard_stage_1/2/3 with Lightning

    trainer = L.Trainer(strategy="zeroshard_stage_3", accelerator="cpu", devices=2,
                        accumulate_grad_batches=2, gradient_clip_val=1.0)
    trainer.fit(model, loader)                      # ModelCheckpoint saves zeroshard checkpoints
    trainer.fit(model, loader, ckpt_path=path)      # and resumes from them

``ZeroshardStrategy(stage=..., config=...)`` takes a zeroshard (DeepSpeed-style) config for everything
else.  Lightning is imported here only: ``import zeroshard`` never needs it (docs/LIGHTNING.md).
"""

from __future__ import annotations

from lightning.pytorch.strategies import StrategyRegistry

from .precision import ZeroshardPrecision
from .strategy import ZeroshardStrategy

__all__ = ["ZeroshardStrategy", "ZeroshardPrecision"]

ZeroshardStrategy.register_strategies(StrategyRegistry)
