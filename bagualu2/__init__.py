"""bagualu2: runtime-adaptive activation provisioning for Mixture-of-Experts training."""
from bagualu2 import _C

__all__ = ["backends"]


def backends() -> list:
    """Names of the backends compiled into this build ('cpu' always first)."""
    return list(_C.backends())
