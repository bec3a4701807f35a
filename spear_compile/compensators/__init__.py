"""Error compensators: the SPEAR EC, its initialisation, and how ECs attach to layers."""
from .ec import ErrorCompensator
from .registry import attach_, detach_, lookup_ec, register_ec

__all__ = ["ErrorCompensator", "attach_", "detach_", "lookup_ec", "register_ec"]
