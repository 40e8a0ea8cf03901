"""The reference model: pure Python (stdlib + numpy), never imports torch."""

from meshsim.model.conventions import CONVENTIONS, expect
from meshsim.model.expected import ROLES, Expected, Kind
from meshsim.model.groups import Group, Groups, RankGroup
from meshsim.model.layout import Layout
from meshsim.model.mesh_layout import FlatLayout, MeshLayout
from meshsim.model.sweep import LayoutCase, RefusedCase, layouts, refused_configs

__all__ = [
    "CONVENTIONS",
    "ROLES",
    "Expected",
    "FlatLayout",
    "Group",
    "Groups",
    "Kind",
    "Layout",
    "LayoutCase",
    "MeshLayout",
    "RankGroup",
    "RefusedCase",
    "expect",
    "layouts",
    "refused_configs",
]
