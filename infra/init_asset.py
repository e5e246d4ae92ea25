"""A ``timm:NAME.TAG`` init for the job a deploy starts: the weights, resolved on the machine that
runs ``cdk deploy``, as a CDK asset the instances read.

The instances have no internet route, so they cannot download ``timm:`` weights from the
Hugging Face Hub. At synth, ``training.common.timm_hub.resolve_timm_init`` finds the hub-form
folder (``config.json`` + ``model.safetensors``) in the deploying user's Hugging Face cache, or
downloads it there; an ``aws_s3_assets.Asset`` of those two files makes ``cdk deploy`` upload
them, zipped, to the CDK bootstrap's asset bucket under a key named by their content hash (once:
an unchanged asset is not uploaded again). The instance role may read that one object
(``s3:GetObject``) and the job pointer names it (``init_uri``); the trainer reads a ``.zip`` as a
zipped hub-form folder (``training.trainer.init_weights``).

Why an asset rather than a copy into the checkpoint bucket: the checkpoint bucket is created by
the same deploy, so putting files into it would take a Lambda-backed custom resource
(``aws_s3_deployment.BucketDeployment``: a function, its role and layer, sized for the weights),
while the asset bucket is there before the deploy and the CDK CLI uploads to it.
``hetero job start`` and ``hetero sagemaker submit`` stage into the checkpoint bucket instead
(``<checkpoint prefix>/init/<sha256>/``).
"""

from __future__ import annotations

import aws_cdk as cdk
from aws_cdk import aws_iam as iam
from aws_cdk import aws_s3_assets as s3_assets
from constructs import Construct

from training.spec import SpecError


class InitWeightsAsset(Construct):
    """``init``'s files as one asset the ``reader`` role may read.

    Attributes: ``init`` (the spec's value), ``hub`` (what it resolved to: repository, files,
    size), ``asset``, ``uri`` (the asset's ``s3://`` URL: the zip the job reads).
    """

    def __init__(
        self, scope: Construct, construct_id: str, *, init: str, reader: iam.IGrantable, source: str
    ) -> None:
        super().__init__(scope, construct_id)
        # Deferred: timm imports torch, which only a spec with a timm: init needs at synth.
        from training.common.timm_hub import HubInitError, resolve_timm_init

        try:
            self.hub = resolve_timm_init(init)
        except HubInitError as e:
            raise SpecError([f"job.model.init = {e}"], source) from None
        self.init = self.hub.init
        self.asset = s3_assets.Asset(
            self,
            "Files",
            path=str(self.hub.folder),
            # The snapshot folder may hold other files of the repository: only these two.
            exclude=["*", *(f"!{f.name}" for f in self.hub.files)],
            # The cache's snapshot files are links to its blobs: the asset holds their bytes.
            follow_symlinks=cdk.SymlinkFollowMode.ALWAYS,
        )
        self.uri = self.asset.s3_object_url
        # This one object, read-only (Asset.grant_read would allow the whole asset bucket).
        reader.grant_principal.add_to_principal_policy(
            iam.PolicyStatement(
                sid="ReadInitWeights",
                actions=["s3:GetObject"],
                resources=[self.asset.bucket.arn_for_objects(self.asset.s3_object_key)],
            )
        )
