"""``GET /key/info``: what the key a request presents may do and what it
has used, for the key's own holder (LiteLLM's route of that name is what
its users know). A team member otherwise learns a limit only from its 429.

Any key may ask, about itself only (no other key, no secret, no hash):

* a key of the keys file: its name, models, expiry, and per limit it has
  (``rpm``, ``tpm``, ``max_parallel``, ``tokens_per_day|week|month``,
  ``spend_per_month``) the most, what is used in the current window, what
  is left and the seconds until the window resets (UTC calendar windows, as
  the limits count them); then its windows as ``GET /keys`` shows them;
* the admin key, an ``--api-key`` key, or no key on a server without keys:
  its kind and no limits (these are never limited).

Shape::

    {"object": "key", "kind": "keys-file", "name": "alice",
     "models": ["smollm2-135m"], "expires": null, "disabled": false,
     "limits": [{"limit": "rpm", "max": 60, "used": 3, "left": 57,
                 "resets_in_s": 41}, ...],
     "usage": {"requests_this_minute": 3, ..., "spend_this_month": 0.0}}
"""

from __future__ import annotations

LIMITS = (  # (the policy's field, the usage window's, its window: None for none)
    ("rpm", "requests_this_minute", "minute"),
    ("tpm", "tokens_this_minute", "minute"),
    ("max_parallel", "in_flight", None),
    ("tokens_per_day", "tokens_today", "day"),
    ("tokens_per_week", "tokens_this_week", "week"),
    ("tokens_per_month", "tokens_this_month", "month"),
    ("spend_per_month", "spend_this_month", "month"),
)


def key_view(policy: dict, usage: dict, resets_in_s: dict[str, float]) -> dict:
    """The answer for a keys-file key: ``policy`` its published policy (the
    key table's, without ``sha256``), ``usage`` its windows
    (:meth:`~.admission.KeyAdmission.usage`), ``resets_in_s`` the seconds
    until each window (``minute``, ``day``, ``week``, ``month``) resets."""
    limits = []
    for field, used_field, window in LIMITS:
        most = policy.get(field) or 0
        if not most:
            continue  # 0: no limit
        used = usage.get(used_field, 0)
        left = most - used
        limits.append({"limit": field, "max": most, "used": used,
                       "left": round(left, 6) if isinstance(left, float) else max(left, 0),
                       "resets_in_s": None if window is None else round(resets_in_s[window])})
    return {"object": "key", "kind": "keys-file", "name": policy.get("name"),
            "models": policy.get("models") or ["*"], "expires": policy.get("expires") or None,
            "disabled": bool(policy.get("disabled")), "limits": limits, "usage": usage}


def unlimited_view(kind: str) -> dict:
    """The answer for a key that is never limited: ``kind`` is ``admin``,
    ``api-key`` or ``none`` (a server without keys, asked without one)."""
    return {"object": "key", "kind": kind, "name": None, "models": ["*"], "expires": None,
            "disabled": False, "limits": [], "usage": None}


__all__ = ["LIMITS", "key_view", "unlimited_view"]
