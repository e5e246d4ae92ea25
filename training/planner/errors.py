"""The planner's error type, and how an AWS error becomes one line of a plan's notes."""

from __future__ import annotations

from botocore.exceptions import ClientError

# IAM action per API operation the planner calls: named when a call is denied.
IAM_ACTIONS = {
    "GetProducts": "pricing:GetProducts",
    "DescribeSpotPriceHistory": "ec2:DescribeSpotPriceHistory",
    "GetSpotPlacementScores": "ec2:GetSpotPlacementScores",
    "DescribeAvailabilityZones": "ec2:DescribeAvailabilityZones",
    "DescribeSubnets": "ec2:DescribeSubnets",
}
_DENIED = {"AccessDenied", "AccessDeniedException", "UnauthorizedOperation"}


class PlanError(ValueError):
    """The plan cannot be made as asked; the message says what to change."""


def aws_problem(error: Exception) -> str:
    """One line for a failed AWS call: its code and message, and the IAM action if denied."""
    if not isinstance(error, ClientError):
        return f"{type(error).__name__}: {error}"
    code = str(error.response.get("Error", {}).get("Code", "Unknown"))
    message = error.response.get("Error", {}).get("Message", "")
    line = f"{code} on {error.operation_name}: {message}"
    if code in _DENIED:
        action = IAM_ACTIONS.get(error.operation_name, error.operation_name)
        line += f" (allow {action} to the identity running hetero plan)"
    return line
