# Cython declarations of state.py (pure-Python mode: the .py is the source;
# read only by the build): the connection's fields as C struct members.
from .request cimport Request

cdef class ConnectionState:
    cdef public Request _active
    cdef public bint _body_ok
    cdef public double _body_until
    cdef public long long _chunk_at
    cdef public bint _chunked
    cdef public bint _closed
    cdef public object _cork
    cdef public bint _counted
    cdef public Request _cur
    cdef public double _deadline
    cdef public bint _discard
    cdef public bint _discarded
    cdef public list _drain_waiters
    cdef public object _error
    cdef public long long _head_seen
    cdef public object _idle
    cdef public bint _in_head
    cdef public object _ip
    cdef public object _ip_idle
    cdef public bint _lost
    cdef public long long _max_body
    cdef public long long _max_head
    cdef public object _on_close
    cdef public object _pending_error
    cdef public object _queue
    cdef public long long _queued_bytes
    cdef public bint _reading_paused
    cdef public object _reg
    cdef public bint _responding
    cdef public object _send_timer
    cdef public object _tail
    cdef public object _task
    cdef public object _timer
    cdef public double _timer_at
    cdef public int _tkind
    cdef public object fast
    cdef public object handler
    cdef public object limits
    cdef public object loop
    cdef public object parser
    cdef public bint receiving
    cdef public bint sheddable
    cdef public object transport
    cdef public bint write_paused
    cdef public object write_paused_cb
