"""The inference routes' paths: those routed by the JSON body's ``model``
(:data:`INFERENCE`, llama.cpp router's list; the forwarding's fast path
and the route table read it), and among them the token routes
(:data:`TOKEN_ROUTES`), whose bodies are bounded before they are parsed.
"""

from __future__ import annotations

# routed by the JSON body's "model" (llama.cpp router's list)
INFERENCE = frozenset(
    (
        b"/v1/chat/completions",
        b"/chat/completions",
        b"/v1/completions",
        b"/completions",
        b"/v1/embeddings",
        b"/embeddings",
        b"/embedding",
        b"/completion",
        b"/tokenize",
        b"/detokenize",
        b"/infill",
        b"/rerank",
        b"/v1/rerank",
        b"/reranking",
        b"/apply-template",
        b"/v1/chat/completions/input_tokens",  # llama-server's prompt token count
        b"/chat/completions/input_tokens",
    )
)  # /v1/messages, /v1/responses, /api/*: apis.ROUTES
# the token routes: a body over HttpLimits.max_tokenize_bytes gets 413
# before it is parsed (issue 31, item 1: their JSON, megabytes of text or
# millions of ids, is decoded on the loop that writes other tenants' streams)
TOKEN_ROUTES = frozenset((b"/tokenize", b"/detokenize", b"/apply-template",
                          b"/v1/chat/completions/input_tokens", b"/chat/completions/input_tokens"))
