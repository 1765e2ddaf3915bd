"""``zeroshard selftest``: one command that says whether a machine can be trusted with zeroshard.

It launches N ranks with torchrun (:mod:`.command`); each rank runs :mod:`.worker`, which checks
correctness against plain PyTorch and DDP (:mod:`.parity`), model-state memory against the ZeRO
formulas (:mod:`.memory`), counts host syncs per step (:mod:`.syncs`), times all-gather and
reduce-scatter (:mod:`.bandwidth`) and training throughput beside plain PyTorch and FSDP2
(:mod:`.throughput`); :mod:`.verdict` decides pass or fail and :mod:`.report` prints the table and
draws the plot.  The models are built in-process (:mod:`.sizes`); nothing is downloaded.
"""
