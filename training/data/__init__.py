"""Datasets (synthetic, image folder, S3 prefix), augmentation recipes and the local loader."""

from training.data.augment import AugmentedSamples, augment_samples, load_image
from training.data.batch import Batch, Unreadable
from training.data.datasets import (
    FolderImages,
    ImageSource,
    S3Images,
    SyntheticImages,
)
from training.data.decode import decode_image
from training.data.loader import local_loader
from training.data.order import batch_seed, epoch_order, epoch_seed
from training.data.splits import (
    Split,
    SubsetImages,
    build_dataset,
    build_split,
    build_splits,
    split_indices,
)
from training.data.transforms import build_transform
