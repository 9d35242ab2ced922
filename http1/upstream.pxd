# Cython declarations of upstream.py (read only by the build): the fields
# are upstream_state.pxd's; these cimports type the hot methods' locals.
from .exchange cimport Exchange
from .request cimport Request
from .upstream_failure cimport UpstreamFailure

cdef class Upstream(UpstreamFailure):
    pass
