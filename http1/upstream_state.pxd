# Cython declarations of upstream_state.py (pure-Python mode: the .py is the
# source; read only by the build). The exchange's records are C structs:
# the relay's per-read work touches them without CPython's attribute lookups.
from .exchange cimport Exchange
from .request cimport Request

cdef class UpstreamState:
    cdef public object _on_gone
    cdef public object _on_paused
    cdef public bint _resp_chunked
    cdef public bint _resp_keepalive
    cdef public object _settle
    cdef public long long acked
    cdef public bint capture
    cdef public object client  # an HttpConnection, or what stands in for one (apis.translate)
    cdef public bint closed
    cdef public tuple conn_tokens
    cdef public long long deadline_ns
    cdef public object err_body
    cdef public Exchange ex
    cdef public bint finished
    cdef public bint got_bytes
    cdef public bint head_sent
    cdef public list headers
    cdef public long long idle_ns
    cdef public bint junk
    cdef public object key
    cdef public object mark
    cdef public object on_done
    cdef public object on_head
    cdef public object parser
    cdef public bint paused
    cdef public object pool
    cdef public Request req
    cdef public bint reused
    cdef public long long sent_total
    cdef public bint sse
    cdef public bint sse_error
    cdef public object sse_tail
    cdef public int status
    cdef public object transport
    cdef public bint until_close
