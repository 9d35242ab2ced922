# Cython declarations of connection.py (read only by the build).
from .reading cimport RequestReader
from .request cimport Request

cdef class HttpConnection(RequestReader):
    cpdef finish(self, Request req)
    cpdef close(self)
