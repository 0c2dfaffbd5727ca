"""The trainer-side client: ``TrajectoryClient`` (see ``services.client.client``), and
where the stack is (``services.client.connection``)."""

from services.client.client import (
    DEFAULT_GROUP_TIMEOUT,
    Delivered,
    Dropped,
    Group,
    TrajectoryClient,
)
from services.client.connection import Connection, from_environment

__all__ = [
    "DEFAULT_GROUP_TIMEOUT",
    "Connection",
    "Delivered",
    "Dropped",
    "Group",
    "TrajectoryClient",
    "from_environment",
]
