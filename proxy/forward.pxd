# Cython declarations of forward.py (read only by the build): the C type of
# the request its fast path reads.
from .http.request cimport Request
from .http.exchange cimport Exchange
