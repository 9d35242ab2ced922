# Cython declarations of activity.py (read only by the build): the C types
# of the records its per-request writer reads.
from ..http1.request cimport Request
from ..http1.exchange cimport Exchange
