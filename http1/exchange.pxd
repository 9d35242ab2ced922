# Cython declarations of exchange.py (read only by the build): an exchange
# is a C struct for the compiled modules that declare their locals as one.
cdef class Exchange:
    cdef public int status
    cdef public long long sent_ns
    cdef public long long first_byte_ns
    cdef public long long bytes_out
    cdef public bint retried
    cdef public bint fault
    cdef public bint timed_out
    cdef public object headers
    cdef public object body
    cdef public object usage
    cdef public bint sse
    cdef public long long events
    cdef public object tail
    cdef public object kept
