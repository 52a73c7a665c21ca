"""Placement: a distribution policy turns the FDG into a placed graph (groups and channels).

``registry`` finds the policies (one file each in ``distribution_policies/``) and reads their
options; ``placed`` is the placed graph and the placement the single-learner policies share.
"""

from fragflow.placement.placed import Channel, Group, Overflow, PlacedGraph, acting_and_learning, edge_label
from fragflow.placement.registry import PolicySpec, distribute

__all__ = ["Channel", "Group", "Overflow", "PlacedGraph", "PolicySpec", "acting_and_learning", "distribute",
           "edge_label"]
