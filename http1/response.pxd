# Cython declarations of response.py (read only by the build).
from .request cimport Request
from .state cimport ConnectionState

cdef class ResponseWriter(ConnectionState):
    cpdef _out(self, data)
    cpdef write(self, data)
    cpdef cork(self)
    cpdef uncork(self)
    cpdef head(self, Request req, int status, headers, framing)
    cpdef send_chunk(self, data)
    cpdef end_stream(self, Request req, trailer=*)
