# Cython declarations of reading.py (read only by the build).
from .request cimport Request
from .response cimport ResponseWriter

cdef class RequestReader(ResponseWriter):
    pass
