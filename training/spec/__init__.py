"""The cluster spec: one typed TOML file that both the CDK app and the launcher read.

``load_spec(path)`` parses and validates the whole file once. Every problem found is reported
together in one ``SpecError`` whose lines name the field (``groups[1].count``) and the fix, so a
bad spec fails before anything is deployed or launched.
"""

from training.spec.enums import (
    CLUSTER_PLACEMENT_DOC,
    PLACEMENT_WARNING_FIX,
    RANDOM_ERASING_MODES,
    DatasetSource,
    Efa,
    GradCompression,
    Interpolation,
    LrScale,
    Market,
    MixupMode,
    Optimizer,
    Parallelism,
    Placement,
    Precision,
    Recipe,
    Role,
    Schedule,
    SpecError,
)
from training.spec.parse import DEFAULT_SPEC_PATH, load_spec, parse_augmentation, parse_spec
from training.spec.schema import (
    SYNTHETIC_CLASSES,
    AugmentationSpec,
    CheckpointSpec,
    ClusterSpec,
    DataPlaneSpec,
    DatasetSpec,
    EmaSpec,
    EvalSpec,
    InstanceGroup,
    JobSpec,
    MixupSpec,
    ModelSpec,
    ParallelismSpec,
    PricesSpec,
)
