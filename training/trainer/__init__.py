"""The ViT trainer, launched by torchrun: ``python -m training.trainer --spec ... --run-dir ...``.

Modules by concern: ``config`` (typed settings from the spec), ``parallel_dims`` (degrees and
the 2-D mesh), ``parallelize`` (DDP / FSDP2 / HSDP), ``model`` (timm factory), ``stream`` (the
inputs' contract), ``inputs`` and ``remote`` (data plane, local DataLoader, synthetic),
``checkpoint`` (DCP ``step-N/`` folders, local or S3), ``checkpoint_policy`` (when and how to
save, failed saves, background saves), ``sample_log`` (sample ids per applied step),
``metrics``, ``signals`` (stop and checkpoint requests, agreed per step), ``train`` (the Trainer
and its loop) and ``export`` (model files out; with ``model_config``, ``checkpoint_read``,
``s3_ranges`` and ``export_cli``). Exit codes and outcome
files: ``training.common.outcome``.
"""
