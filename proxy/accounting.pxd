# Cython declarations of accounting.py (read only by the build): the C types
# of the exchange and request it reads.
from ..http1.request cimport Request
from ..http1.exchange cimport Exchange
