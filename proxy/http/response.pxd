# Cython declarations of response.py (read only by the build).
from .request cimport Request
from .state cimport ConnectionState

cdef class ResponseWriter(ConnectionState):
    pass
