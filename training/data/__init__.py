"""Datasets (synthetic, image folder, S3 prefix), augmentation recipes and the local loader.

Import from the module that defines a name (``training.data.order``, ``training.data.splits``...):
the package itself imports nothing, so a process that needs an epoch's order does not load timm
and torchvision with the augmentation.
"""
