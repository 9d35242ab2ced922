# Cython declarations of request.py (pure-Python mode: the .py is the source;
# this file is read only by the build, compiled.py's HOT_MODULES). A Request
# is a C struct for the compiled modules that declare their locals as one.
cdef class Request:
    cdef public object body
    cdef public object body_json
    cdef public bint chunked
    cdef public tuple conn_tokens
    cdef public long long content_length
    cdef public object content_type
    cdef public bint disconnected
    cdef public object expect
    cdef public bint expect_continue
    cdef public object extra_head
    cdef public bint head_only
    cdef public long long header_bytes
    cdef public list headers
    cdef public int hop
    cdef public bint hop_marked
    cdef public object host
    cdef public bint http10
    cdef public bint keep_alive
    cdef public object key_hold
    cdef public long long key_row
    cdef public object method
    cdef public object on_disconnect
    cdef public object origin
    cdef public object path
    cdef public bint preheaded
    cdef public object query
    cdef public object request_id
    cdef public long long started_ns
    cdef public int status
    cdef public object url
