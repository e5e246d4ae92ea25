"""Parsing the ``[job]`` table: ``_parse_job`` and one parser per section of it."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from training.common.s3 import is_s3_uri
from training.common.timm_hub import HubInitError, is_timm_init, timm_model_name
from training.spec.augmentation import _parse_augmentation
from training.spec.enums import (
    DatasetSource,
    GradCompression,
    Interpolation,
    LrScale,
    MixupMode,
    Optimizer,
    Parallelism,
    Precision,
    Schedule,
)
from training.spec.reader import _cap, _fraction, _Reader
from training.spec.schema import (
    SYNTHETIC_CLASSES,
    CheckpointSpec,
    DataPlaneSpec,
    DatasetSpec,
    EmaSpec,
    EvalSpec,
    JobSpec,
    MixupSpec,
    ModelSpec,
    ParallelismSpec,
    PricesSpec,
)


def _parse_job(r: _Reader, t: Mapping[str, Any]) -> JobSpec:
    r.check_keys(t, JobSpec)
    d = JobSpec()

    model = _parse_model(r, t, d)
    dataset = _parse_dataset(r, t, d)

    with r.at("augmentation"):
        augmentation = (
            _parse_augmentation(r, t["augmentation"]) if "augmentation" in t else d.augmentation
        )

    mixup = _parse_mixup(r, t, d)
    ema = _parse_ema(r, t)
    evaluation = _parse_eval(r, t, d, dataset)

    targets_raw = r.get(t, "accuracy_targets", list, [])
    targets: list[float] = []
    for i, v in enumerate(targets_raw):
        if isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v <= 1:
            r.problem(f"accuracy_targets[{i}]", f"expected a top-1 share in (0, 1], got {v!r}")
        else:
            targets.append(float(v))
    if targets and not dataset.has_validation:
        r.problem(
            "accuracy_targets",
            "need a validation set; set job.dataset.val_path or job.dataset.val_fraction",
        )

    checkpoint = _parse_checkpoint(r, t, d)
    parallelism = _parse_parallelism(r, t)
    prices = _parse_prices(r, t, d)
    dataplane = _parse_dataplane(r, t, d)

    steps = r.positive(t, "steps", 0) if "steps" in t else None
    epochs = r.positive(t, "epochs", 0) if "epochs" in t else None
    if steps and epochs:
        r.problem("epochs", "set either steps or epochs, not both")
    lr = r.get(t, "lr", float, d.lr)
    if lr <= 0:
        r.problem("lr", f"must be positive, got {lr}")
    lr_base, lr_base_size, lr_base_scale = _parse_lr_base(r, t, d)
    min_lr = r.get(t, "min_lr", float, d.min_lr)
    if lr_base is not None:
        # The peak depends on the trainer ranks: parse_spec compares min_lr with it.
        if min_lr < 0:
            r.problem("min_lr", f"must be >= 0, got {min_lr:g}")
            min_lr = 0.0
    elif not 0 <= min_lr <= lr:
        r.problem("min_lr", f"must be in [0, lr = {lr:g}], got {min_lr:g}")
        min_lr = 0.0
    layer_decay = r.get(t, "layer_decay", float, None)
    if layer_decay is not None and not 0 < layer_decay <= 1:
        r.problem(
            "layer_decay",
            f"must be in (0, 1] (e.g. 0.75; 1: every layer at the full rate), got {layer_decay:g}",
        )
        layer_decay = None
    weight_decay = r.get(t, "weight_decay", float, d.weight_decay)
    if weight_decay < 0:
        r.problem("weight_decay", f"must be >= 0, got {weight_decay:g}")
    clip = r.get(t, "clip_grad_norm", float, d.clip_grad_norm)
    if clip < 0:
        r.problem("clip_grad_norm", f"must be > 0 (or 0: no clipping), got {clip:g}")
    batch_size = r.positive(t, "batch_size", d.batch_size)
    if mixup.enabled and batch_size % 2:
        r.problem(
            "batch_size",
            f"{batch_size} is odd, but timm's Mixup mixes a batch with its reverse and needs an "
            "even batch; use an even batch_size",
        )
    return JobSpec(
        model=model,
        batch_size=batch_size,
        grad_accum_steps=r.positive(t, "grad_accum_steps", d.grad_accum_steps),
        steps=steps or None,
        epochs=epochs or None,
        lr=lr,
        lr_base=lr_base,
        lr_base_size=lr_base_size,
        lr_base_scale=lr_base_scale,
        layer_decay=layer_decay,
        weight_decay=weight_decay,
        warmup_steps=r.positive(t, "warmup_steps", d.warmup_steps, minimum=0),
        optimizer=r.choice(t, "optimizer", Optimizer, d.optimizer),
        momentum=_fraction(r, t, "momentum", d.momentum),
        schedule=r.choice(t, "schedule", Schedule, d.schedule),
        min_lr=min_lr,
        clip_grad_norm=clip,
        max_nonfinite_steps=r.positive(t, "max_nonfinite_steps", d.max_nonfinite_steps),
        label_smoothing=_fraction(r, t, "label_smoothing", d.label_smoothing, high=0.5),
        mixup=mixup,
        ema=ema,
        eval=evaluation,
        accuracy_targets=tuple(sorted(set(targets))),
        precision=r.choice(t, "precision", Precision, d.precision),
        compile=r.get(t, "compile", bool, d.compile),
        seed=r.get(t, "seed", int, d.seed),
        log_every_steps=r.positive(t, "log_every_steps", d.log_every_steps),
        dataset=dataset,
        augmentation=augmentation,
        checkpoint=checkpoint,
        parallelism=parallelism,
        prices=prices,
        dataplane=dataplane,
        max_hours=_cap(r, t, "max_hours", "hours"),
        max_usd=_cap(r, t, "max_usd", "USD"),
    )


def _parse_lr_base(
    r: _Reader, t: Mapping[str, Any], d: JobSpec
) -> tuple[float | None, int, LrScale | None]:
    """``lr_base``, ``lr_base_size`` and ``lr_base_scale`` (timm's ``train.py --lr-base``)."""
    lr_base = r.get(t, "lr_base", float, None)
    if lr_base is not None and "lr" in t:
        r.problem(
            "lr_base",
            "set either lr (the peak learning rate) or lr_base (the rate at a global batch of "
            "lr_base_size, scaled to the job's), not both",
        )
    if lr_base is not None and not 0 < lr_base < float("inf"):
        r.problem("lr_base", f"must be positive, got {lr_base}")
        lr_base = None
    size = r.positive(t, "lr_base_size", d.lr_base_size)
    scale = r.choice(t, "lr_base_scale", LrScale, d.lr_base_scale)
    if lr_base is None and "lr_base" not in t:
        for key in ("lr_base_size", "lr_base_scale"):
            if key in t:
                r.problem(key, "only applies with lr_base; set lr_base or remove it")
    return lr_base, size, scale


def _parse_model(r: _Reader, t: Mapping[str, Any], d: JobSpec) -> ModelSpec:
    model_t = r.table(t, "model")
    with r.at("model"):
        r.check_keys(model_t, ModelSpec)
        overrides = r.table(model_t, "overrides")
        init = r.get(model_t, "init", str, None)
        if init is not None and not init.strip():
            r.problem(
                "init",
                "empty; give a weights file or hub-form folder (path or s3:// URI), or remove it",
            )
            init = None
        elif is_timm_init(init):
            # The form only: timm's registry and the Hugging Face cache are asked by
            # `hetero spec check` (training.trainer.model.check_init), not by every spec reader.
            try:
                timm_model_name(str(init))
            except HubInitError as e:
                r.problem("init", str(e))
        init_ema = r.get(model_t, "init_ema", bool, d.model.init_ema)
        if "init_ema" in model_t and init is None:
            r.problem("init_ema", "only applies with init (a train.py checkpoint); remove it")
        rates: dict[str, float | None] = {}
        for key in ("drop_rate", "drop_path_rate"):
            rates[key] = r.get(model_t, key, float, None)
            if key in overrides and key in model_t:
                r.problem(
                    key,
                    f"also set as job.model.overrides.{key}; set it once: keep "
                    f"job.model.{key} and remove the override",
                )
            value = rates[key]
            if value is not None and not 0 <= value < 1:
                r.problem(key, f"must be in [0, 1), got {value:g}")
                rates[key] = None
        return ModelSpec(
            name=r.get(model_t, "name", str, d.model.name),
            overrides=overrides,
            init=init,
            init_ema=init_ema,
            mean=_channels(r, model_t, "mean", low=0.0, low_open=False),
            std=_channels(r, model_t, "std", low=0.0, low_open=True),
            drop_rate=rates["drop_rate"],
            drop_path_rate=rates["drop_path_rate"],
        )


def _channels(
    r: _Reader, t: Mapping[str, Any], key: str, *, low: float, low_open: bool
) -> tuple[float, float, float] | None:
    """Three per-channel (R, G, B) numbers in [low, 1] (or (low, 1]), or None when left out."""
    raw = r.get(t, key, list, None)
    if raw is None:
        return None
    if len(raw) != 3 or not all(
        isinstance(v, int | float)
        and not isinstance(v, bool)
        and (low < v if low_open else low <= v)
        and v <= 1
        for v in raw
    ):
        left = "(" if low_open else "["
        r.problem(key, f"expected [R, G, B], each in {left}{low:g}, 1], got {raw!r}")
        return None
    return float(raw[0]), float(raw[1]), float(raw[2])


def _parse_dataset(r: _Reader, t: Mapping[str, Any], d: JobSpec) -> DatasetSpec:
    ds_t = r.table(t, "dataset")
    with r.at("dataset"):
        r.check_keys(ds_t, DatasetSpec)
        source = r.choice(ds_t, "source", DatasetSource, DatasetSource.SYNTHETIC)
        path = r.get(ds_t, "path", str, None)
        if source is DatasetSource.FOLDER and not path:
            r.problem("path", "source 'folder' needs path = a folder of class sub-folders")
        if source is DatasetSource.S3 and not (path and is_s3_uri(path)):
            r.problem("path", "source 's3' needs path = 's3://bucket/prefix/'")
        if source is DatasetSource.SHARDS and not path:
            r.problem(
                "path",
                "source 'shards' needs path = the folder or s3:// prefix that `hetero dataset "
                "prep --out` wrote",
            )
        val_path = r.get(ds_t, "val_path", str, None)
        val_fraction = _fraction(r, ds_t, "val_fraction", 0.0, high=0.5)
        if source is DatasetSource.SHARDS and (val_path is not None or val_fraction):
            r.problem(
                "val_path" if val_path is not None else "val_fraction",
                "source 'shards' takes its validation split from the manifest; prepare the "
                "dataset with `hetero dataset prep --val-src` or `--val-fraction` instead",
            )
        manifest_sha256 = r.get(ds_t, "manifest_sha256", str, None)
        if manifest_sha256 is not None and not re.fullmatch(r"[0-9a-fA-F]{64}", manifest_sha256):
            r.problem("manifest_sha256", "expected the 64 hex digits hetero dataset verify prints")
        shards_keys = ("manifest_sha256", "shuffle_shards", "cache_dir", "cache_gb")
        if source is not DatasetSource.SHARDS:
            for key in shards_keys:
                if key in ds_t:
                    r.problem(key, "only for source 'shards'")
        cache_gb = r.get(ds_t, "cache_gb", (int, float), None)
        if cache_gb is not None and (isinstance(cache_gb, bool) or not cache_gb > 0):
            r.problem("cache_gb", f"expected a size in GB above 0, got {cache_gb!r}")
        if val_path is not None:
            if val_fraction:
                r.problem(
                    "val_fraction",
                    "set either val_path (a validation folder or prefix) or val_fraction "
                    "(a held-out share of the dataset), not both",
                )
            if source is DatasetSource.SYNTHETIC:
                r.problem("val_path", "source 'synthetic' has no folder; use val_fraction")
            elif source is DatasetSource.S3 and not is_s3_uri(val_path):
                r.problem("val_path", "source 's3' needs val_path = 's3://bucket/prefix/'")
            elif source is DatasetSource.FOLDER and is_s3_uri(val_path):
                r.problem("val_path", "source 'folder' needs val_path = a local folder")
            elif val_path.rstrip("/") == (path or "").rstrip("/"):
                r.problem("val_path", "is the training path; validation must be other images")
        return DatasetSpec(
            source=source,
            path=path,
            num_samples=r.positive(ds_t, "num_samples", d.dataset.num_samples),
            num_classes=_num_classes(r, ds_t, source),
            image_size=r.positive(ds_t, "image_size", d.dataset.image_size, minimum=16),
            val_path=val_path,
            val_fraction=val_fraction,
            max_unreadable=_fraction(r, ds_t, "max_unreadable", d.dataset.max_unreadable),
            split_seed=r.get(ds_t, "split_seed", int, d.dataset.split_seed),
            manifest_sha256=manifest_sha256.lower() if manifest_sha256 else None,
            shuffle_shards=r.positive(ds_t, "shuffle_shards", d.dataset.shuffle_shards),
            cache_dir=r.get(ds_t, "cache_dir", str, None),
            cache_gb=float(cache_gb) if isinstance(cache_gb, int | float) else None,
        )


def _num_classes(r: _Reader, ds_t: Mapping[str, Any], source: DatasetSource) -> int | None:
    """``num_classes`` as given; left out, ``SYNTHETIC_CLASSES`` for synthetic data and None
    (the data's own count, found when a job opens it) for the others."""
    if "num_classes" not in ds_t:
        return SYNTHETIC_CLASSES if source is DatasetSource.SYNTHETIC else None
    return r.positive(ds_t, "num_classes", SYNTHETIC_CLASSES)


def _parse_mixup(r: _Reader, t: Mapping[str, Any], d: JobSpec) -> MixupSpec:
    mx_t = r.table(t, "mixup")
    with r.at("mixup"):
        r.check_keys(mx_t, MixupSpec)
        alphas = {}
        for key in ("mixup_alpha", "cutmix_alpha"):
            alphas[key] = r.get(mx_t, key, float, 0.0)
            if alphas[key] < 0:
                r.problem(key, f"must be >= 0 (0: off), got {alphas[key]:g}")
                alphas[key] = 0.0
        mixup = MixupSpec(
            mixup_alpha=alphas["mixup_alpha"],
            cutmix_alpha=alphas["cutmix_alpha"],
            prob=_fraction(r, mx_t, "prob", d.mixup.prob),
            switch_prob=_fraction(r, mx_t, "switch_prob", d.mixup.switch_prob),
            mode=r.choice(mx_t, "mode", MixupMode, d.mixup.mode),
        )
        if mx_t and not mixup.enabled:
            r.problem(None, "set mixup_alpha and/or cutmix_alpha above 0, or remove [job.mixup]")
    return mixup


def _parse_ema(r: _Reader, t: Mapping[str, Any]) -> EmaSpec:
    ema_t = r.table(t, "ema")
    with r.at("ema"):
        r.check_keys(ema_t, EmaSpec)
        if ema_t and "decay" not in ema_t:
            r.problem("decay", "missing; e.g. decay = 0.999 (0 or no [job.ema]: no EMA)")
        d = EmaSpec()
        warmup = r.get(ema_t, "warmup", bool, d.warmup)
        shape: dict[str, float] = {}
        for key in ("warmup_power", "warmup_gamma"):
            if key in ema_t and not warmup:
                r.problem(key, "only applies with warmup = true; set warmup = true or remove it")
            shape[key] = r.get(ema_t, key, float, getattr(d, key))
        if not 0 < shape["warmup_power"] <= 1:
            r.problem(
                "warmup_power",
                f"must be in (0, 1] (timm: 2/3 for long runs, 3/4 for shorter ones), got "
                f"{shape['warmup_power']:g}",
            )
        if not 0 < shape["warmup_gamma"] < float("inf"):
            r.problem("warmup_gamma", f"must be positive (timm: 1), got {shape['warmup_gamma']:g}")
        return EmaSpec(
            decay=_fraction(r, ema_t, "decay", 0.0, high=0.999999),
            warmup=warmup,
            warmup_power=shape["warmup_power"],
            warmup_gamma=shape["warmup_gamma"],
        )


def _parse_eval(r: _Reader, t: Mapping[str, Any], d: JobSpec, dataset: DatasetSpec) -> EvalSpec:
    ev_t = r.table(t, "eval")
    with r.at("eval"):
        r.check_keys(ev_t, EvalSpec)
        eval_batch = r.positive(ev_t, "batch_size", 0) if "batch_size" in ev_t else None
        crop = _fraction(r, ev_t, "crop_pct", 1.0, low_open=True) if "crop_pct" in ev_t else None
        evaluation = EvalSpec(
            every_steps=r.positive(ev_t, "every_steps", d.eval.every_steps, minimum=0),
            at_start=r.get(ev_t, "at_start", bool, d.eval.at_start),
            crop_pct=crop,
            interpolation=r.choice(ev_t, "interpolation", Interpolation, None),
            batch_size=eval_batch or None,
        )
        if evaluation.interpolation is Interpolation.RANDOM:
            r.problem("interpolation", "'random' is for training; use bilinear or bicubic")
        if ev_t and not dataset.has_validation:
            r.problem(
                None,
                "no validation set to evaluate on; set job.dataset.val_path or "
                "job.dataset.val_fraction (source 'shards': the manifest's val split)",
            )
    return evaluation


def _parse_checkpoint(r: _Reader, t: Mapping[str, Any], d: JobSpec) -> CheckpointSpec:
    ck_t = r.table(t, "checkpoint")
    with r.at("checkpoint"):
        r.check_keys(ck_t, CheckpointSpec)
        return CheckpointSpec(
            interval_steps=r.positive(ck_t, "interval_steps", d.checkpoint.interval_steps),
            dir=r.get(ck_t, "dir", str, d.checkpoint.dir),
            keep=r.positive(ck_t, "keep", d.checkpoint.keep),
            async_save=r.get(ck_t, "async_save", bool, d.checkpoint.async_save),
        )


def _parse_parallelism(r: _Reader, t: Mapping[str, Any]) -> ParallelismSpec:
    par_t = r.table(t, "parallelism")
    with r.at("parallelism"):
        r.check_keys(par_t, ParallelismSpec)
        strategy = r.choice(par_t, "strategy", Parallelism, Parallelism.DDP)
        shard = r.positive(par_t, "shard_degree", 0) if "shard_degree" in par_t else None
        replicate = (
            r.positive(par_t, "replicate_degree", 0) if "replicate_degree" in par_t else None
        )
        if strategy is not Parallelism.HSDP:
            for key, val in (("shard_degree", shard), ("replicate_degree", replicate)):
                if val is not None:
                    r.problem(key, f"only applies to strategy 'hsdp' (strategy is {strategy})")
        compression = r.choice(par_t, "grad_compression", GradCompression, GradCompression.NONE)
        if compression is not GradCompression.NONE and strategy is not Parallelism.DDP:
            # FSDP2 reduce-scatters in its MixedPrecisionPolicy's reduce dtype, not via DDP hooks.
            r.problem(
                "grad_compression",
                f"'{compression}' only applies to strategy 'ddp' (strategy is {strategy}: it "
                "reduce-scatters gradients in its own dtype); set strategy = 'ddp' or remove "
                "grad_compression",
            )
            compression = GradCompression.NONE
        return ParallelismSpec(strategy, shard or None, replicate or None, compression)


def _parse_prices(r: _Reader, t: Mapping[str, Any], d: JobSpec) -> PricesSpec:
    pr_t = r.table(t, "prices")
    with r.at("prices"):
        r.check_keys(pr_t, PricesSpec)
        usd = r.table(pr_t, "usd_per_hour")
        clean: dict[str, float] = {}
        with r.at("usd_per_hour"):
            for k, v in usd.items():
                if isinstance(v, bool) or not isinstance(v, int | float) or v < 0:
                    r.problem(k, f"expected a price in USD per hour (>= 0), got {v!r}")
                else:
                    clean[k] = float(v)
        ratio = r.get(pr_t, "spot_price_ratio", float, d.prices.spot_price_ratio)
        if not 0 < ratio <= 1:
            r.problem("spot_price_ratio", f"must be in (0, 1], got {ratio}")
            ratio = d.prices.spot_price_ratio
        return PricesSpec(usd_per_hour=clean, spot_price_ratio=ratio)


def _parse_dataplane(r: _Reader, t: Mapping[str, Any], d: JobSpec) -> DataPlaneSpec:
    dp_t = r.table(t, "dataplane")
    with r.at("dataplane"):
        r.check_keys(dp_t, DataPlaneSpec)
        port = r.positive(dp_t, "port", d.dataplane.port)
        if port > 65535:
            r.problem("port", f"must be a TCP port (1-65535), got {port}")
        timeout = r.get(dp_t, "rpc_timeout_s", float, d.dataplane.rpc_timeout_s)
        if timeout <= 0:
            r.problem("rpc_timeout_s", f"must be positive, got {timeout}")
        seconds: dict[str, float] = {}
        for key in ("refresh_s", "wait_for_data_s"):
            value = r.get(dp_t, key, float, getattr(d.dataplane, key))
            if not 0 < value < float("inf"):
                r.problem(key, f"must be a positive number of seconds, got {value}")
                value = getattr(d.dataplane, key)
            seconds[key] = value
        cooldown = r.get(dp_t, "autoscale_cooldown_s", float, d.dataplane.autoscale_cooldown_s)
        if not 0 <= cooldown < float("inf"):
            r.problem("autoscale_cooldown_s", f"must be 0 or more seconds, got {cooldown}")
            cooldown = d.dataplane.autoscale_cooldown_s
        dataplane = DataPlaneSpec(
            port=port,
            prefetch_batches=r.positive(dp_t, "prefetch_batches", d.dataplane.prefetch_batches),
            chunk_batches=r.positive(dp_t, "chunk_batches", d.dataplane.chunk_batches),
            streams_per_server=r.positive(
                dp_t, "streams_per_server", d.dataplane.streams_per_server
            ),
            refresh_s=seconds["refresh_s"],
            wait_for_data_s=seconds["wait_for_data_s"],
            workers_per_server=r.positive(
                dp_t, "workers_per_server", d.dataplane.workers_per_server, minimum=0
            ),
            rpc_timeout_s=timeout,
            server_memory_mb=r.positive(
                dp_t, "server_memory_mb", d.dataplane.server_memory_mb, minimum=0
            ),
            autoscale_target_wait=_fraction(
                r, dp_t, "autoscale_target_wait", d.dataplane.autoscale_target_wait,
                high=0.9, low_open=True,
            ),
            autoscale_max_busy=_fraction(
                r, dp_t, "autoscale_max_busy", d.dataplane.autoscale_max_busy, low_open=True
            ),
            autoscale_window=r.positive(dp_t, "autoscale_window", d.dataplane.autoscale_window),
            autoscale_cooldown_s=cooldown,
        )  # fmt: skip
    return dataplane
