"""The gRPC preprocessing service: data servers augment images and stream batches to trainers.

Generated code lives in ``v1/`` (``python scripts/gen_proto.py`` rewrites it); the server is
``training.dataplane.server``; the trainer-side client is ``training.dataplane.client``.
"""
