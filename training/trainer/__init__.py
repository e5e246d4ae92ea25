"""The ViT trainer, launched by torchrun: ``python -m training.trainer --spec ... --run-dir ...``.

Modules by concern: ``config`` (typed settings from the spec), ``parallel_dims`` (degrees and
the 2-D mesh), ``parallelize`` (DDP / FSDP2 / HSDP), ``model`` (timm factory), ``inputs``
(data plane, local DataLoader, synthetic), ``checkpoint`` (DCP ``step-N/`` folders),
``metrics``, ``signals`` (graceful stop) and ``train`` (the Trainer and its loop).
"""
