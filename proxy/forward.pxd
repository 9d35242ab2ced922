# Cython declarations of forward.py (read only by the build): the C type of
# the request its fast path reads.
from ..http1.request cimport Request
from ..http1.exchange cimport Exchange
