"""The trainer-side client: ``TrajectoryClient`` (see ``services.client.client``)."""

from services.client.client import (
    DEFAULT_GROUP_TIMEOUT,
    Delivered,
    Dropped,
    Group,
    TrajectoryClient,
)

__all__ = ["DEFAULT_GROUP_TIMEOUT", "Delivered", "Dropped", "Group", "TrajectoryClient"]
