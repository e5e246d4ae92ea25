"""The cluster's job pointer: an SSM parameter that names the current job and its checkpoints.

The stack writes the job a deploy starts: id ``d-<first 12 hex of sha256(spec)>``, checkpoints
in ``<checkpoint bucket URI><id>/``, ``started`` null (a template has no deploy time). Deploying
a changed spec therefore starts a fresh job in a new folder, and deploying the same spec again
leaves the parameter's value as it is. ``hetero job start`` overwrites the value to start
another job without a deploy; the launcher on every instance reads it (format and readers:
``training/common/jobparam.py``).
"""

from __future__ import annotations

from aws_cdk import aws_iam as iam
from aws_cdk import aws_ssm as ssm
from constructs import Construct

from training.common.jobparam import JobPointer, deployed_job_pointer
from training.common.names import job_parameter_name


class JobParameter(Construct):
    """The SSM String parameter (standard tier) ``/hetero/<cluster>/job``.

    Attributes: ``parameter``, ``parameter_name`` and ``pointer`` (the value the stack writes;
    its ``checkpoint_uri`` holds the bucket's name as a deploy-time token). ``init`` and
    ``init_uri``: a ``timm:`` init and where the deploy staged it (``infra/init_asset.py``).
    """

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        cluster_name: str,
        spec_text: str,
        checkpoint_base_uri: str,
        init: str | None = None,
        init_uri: str | None = None,
    ) -> None:
        super().__init__(scope, construct_id)
        self.parameter_name = job_parameter_name(cluster_name)
        self.pointer: JobPointer = deployed_job_pointer(
            spec_text, checkpoint_base_uri, init=init, init_uri=init_uri
        )
        self.parameter = ssm.StringParameter(
            self,
            "Parameter",
            # A fixed name: the instances, IAM and `hetero job start` find it without a lookup.
            parameter_name=self.parameter_name,
            string_value=self.pointer.to_json(),
            tier=ssm.ParameterTier.STANDARD,
            description=f"{cluster_name}: the current job (hetero job start changes it)",
        )

    def grant_read(self, grantee: iam.IGrantable) -> None:
        """Let ``grantee`` read this parameter and nothing else (``ssm:GetParameter``)."""
        grantee.grant_principal.add_to_principal_policy(
            iam.PolicyStatement(
                sid="ReadJobPointer",
                actions=["ssm:GetParameter"],
                resources=[self.parameter.parameter_arn],
            )
        )
