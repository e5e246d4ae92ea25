"""``hetero preflight``: check an AWS account and region before ``cdk deploy`` spends anything.

What a deploy of the spec needs and what would stop it only after minutes of CloudFormation
(or leave Auto Scaling groups retrying forever) is checked up front with the user's credentials,
read-only:

1. vCPU quotas (Service Quotas), Spot and On-Demand, per instance family class;
2. the AZ that ``availability_zone_index`` selects, and that every group's types are offered there;
3. the public SSM parameters that name the AMIs resolve in the region;
4. the Spot placement score of that AZ for each Spot group (advisory);
5. the CDK bootstrap stack exists and is recent enough for the synthesized templates;
6. each group that uses a cluster placement group lists one instance type, as AWS advises
   (advisory, from the spec alone: no AWS call).

Each check is a function of boto3 clients that returns ``Check`` rows; any AWS error becomes that
check's FAIL with its error code and the fix (for a missing permission: the IAM action), never a
traceback. Exit code: 0 when nothing failed (warnings allowed), 1 otherwise.

Modules by concern, each importing only those before it: ``core`` (the ``Check`` row, AWS errors
as FAIL rows, paging), ``quotas`` (1), ``zones`` (2, 4 and 6), ``account`` (credentials, 3 and 5)
and ``command`` (``run_checks`` in table order, and the subcommand).
"""

from training.preflight.account import CDK_BOOTSTRAP_VERSION_PARAMETER
from training.preflight.command import Clients, add_arguments, run, run_checks
from training.preflight.core import AWS_ERRORS, Check, Status
from training.preflight.quotas import QUOTA_CLASSES, quota_class, vcpu_needs
from training.preflight.zones import Zone, check_cluster_placement, cloudformation_azs
