"""What the operator sees (DESIGN.md "Processes"): the web page
(:mod:`.page`, its static files in ``ui/``), the log ring's lines
(:mod:`.logs`: ``/logs``, ``/logs/stream``) and what runs (:mod:`.overview`:
``/ps``).
"""
