"""Lightning's ``Trainer`` on bagua: :class:`BaguaStrategy`.

    import lightning as L
    from bagua.lightning import BaguaStrategy

    trainer = L.Trainer(strategy=BaguaStrategy(algorithm="bytegrad"), accelerator="cpu", devices=2)
    trainer.fit(model, train_loader)

Importing this package registers the strategy with Lightning's
``StrategyRegistry`` as ``"bagua"`` (gradient all-reduce), so
``Trainer(strategy="bagua")`` works once ``bagua.lightning`` was imported:
Lightning 2.x has no entry point that finds a third-party strategy by
itself. Lightning (the ``lightning`` package, 2.x) is an optional
dependency: nothing else in bagua imports this package.
"""

from bagua.lightning.strategy import BaguaStrategy

__all__ = ["BaguaStrategy"]
