"""The trainer-side client: ``TrajectoryClient`` (see ``services.client.client``)."""

from services.client.client import Delivered, Group, TrajectoryClient

__all__ = ["Delivered", "Group", "TrajectoryClient"]
