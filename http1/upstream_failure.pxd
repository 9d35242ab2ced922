# Cython declarations of upstream_failure.py (read only by the build).
from .upstream_state cimport UpstreamState

cdef class UpstreamFailure(UpstreamState):
    pass
